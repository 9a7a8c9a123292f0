"""GraphedTalkerStep knows the pipeline only through the StepSpec it is handed: a hand-made spec
(a plain step over a small row table) shows what the wrapper does with it on CPU - rows padded
with the scratch row to a bucket, KV blocks rounded up to a power of two within the per-row
limit, outputs copied out for the real rows only."""

from __future__ import annotations

import torch

from engines.runtime.graphed_talker import GraphedTalkerStep, StepSpec


def make_spec(calls: list, slots: int = 6, max_blocks: int = 8) -> StepSpec:
    table = torch.arange(100, 100 + slots + 1)  # one value per row, the scratch row last

    def step(idx: torch.Tensor, n_blocks: int, all_greedy: bool, any_top_p: bool):
        calls.append((idx.tolist(), n_blocks, all_greedy, any_top_p))
        return table[idx][:, None].repeat(1, 3), table[idx] * 2

    return StepSpec(step=step, max_rows=slots, scratch_row=slots, max_blocks_per_row=max_blocks,
                    device=torch.device("cpu"), buffers_version=lambda: 0, before_capture=lambda rows: None,
                    compile_layers=lambda backend: None, compiled=lambda: False, uncompile=lambda: None)


def test_rows_pad_with_the_scratch_row_and_only_real_rows_come_back():
    calls: list = []
    runner = GraphedTalkerStep(make_spec(calls))
    assert runner.buckets == (1, 2, 4, 6)
    assert runner.shape(3, 3) == (4, 4) and runner.shape(5, 20) == (6, 8), "blocks capped per row"
    codes, cols = runner([2, 0, 5], 3, True, False)
    assert calls == [([2, 0, 5, 6], 4, True, False)], "the scratch row (6) pads the bucket of 4"
    assert codes.tolist() == [[102] * 3, [100] * 3, [105] * 3] and cols.tolist() == [204, 200, 210]
    again, _ = runner([1], 1, False, True)
    assert codes.tolist() == [[102] * 3, [100] * 3, [105] * 3], "earlier outputs are copies, not the static buffers"
    assert again.tolist() == [[101] * 3] and calls[-1] == ([1], 1, False, True)
