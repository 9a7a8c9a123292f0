"""The talker's prompt prefill behind static buffers, one CUDA graph per (prompts, width) bucket.

    runner = GraphedPrefill(source.prefill_spec())      # the pipeline says what to capture
    h = runner(x, positions, rows, last, write_slots)   # or None: not a graphed shape, run it eagerly

Eager, one prefill call costs what its ~600 kernel launches cost whatever its length (26-29 ms on an
H200 from 1 to 16 prompts of up to 256 positions), and it sits on the path to every first audio. A
call whose prompts all start at position 0 (no shared prefix, the first chunk of each prompt) is
copied into the static buffers of the smallest (prompts, width) bucket that holds it, padding as the
eager path pads (position 0, the null slot, the pipeline's scratch row), and the bucket's graph
replays the talker forward over it; the first ``prompts`` rows of the static hidden states come
back. Other calls (a prompt continued from a cached prefix or an earlier chunk, or larger than every
bucket) return None and run eagerly. On CPU exactly the same padded path runs eagerly, so the CPU
tests check the buckets against the plain prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engines.runtime.cuda_graphs import BucketedGraphs, GraphedWrapper, smallest_bucket

PROMPT_BUCKETS = (1, 2, 4, 8, 16, 32)
WIDTH_BUCKETS = (16, 32, 64, 128, 256, 512)
WARMUP_ITERS = 2


@dataclass(frozen=True)
class PrefillSpec:
    """What the pipeline hands the runtime: the forward to capture and the sizes around it."""

    # (x [P, W, D], positions [P, W], rows [P], last [P], write_slots [P, W], n_blocks) -> hidden [P, D]
    forward: Callable[..., torch.Tensor]
    hidden: int
    dtype: torch.dtype
    device: torch.device
    scratch_row: int  # a row padding may use: it owns no block, its writes go to the null slot
    block_size: int
    max_positions: int  # the most prompt positions one call may pad to (buckets past it are not kept)


class GraphedPrefill(GraphedWrapper):
    def __init__(self, spec: PrefillSpec, prompt_buckets: tuple[int, ...] = PROMPT_BUCKETS,
                 width_buckets: tuple[int, ...] = WIDTH_BUCKETS, warmup_iters: int = WARMUP_ITERS):
        self.spec = spec
        self.keys = [(p, w) for p in prompt_buckets for w in width_buckets if p * w <= spec.max_positions]
        self.prompt_buckets = tuple(sorted({p for p, _ in self.keys}))
        self.width_buckets = tuple(sorted({w for _, w in self.keys}))
        dev, top = spec.device, max(self.prompt_buckets)
        # one buffer per width holding the most prompts any of its buckets has: a bucket is its
        # leading rows, contiguous; every buffer's address is fixed for the runner's lifetime
        self._x = {w: torch.zeros(top, w, spec.hidden, dtype=spec.dtype, device=dev) for w in self.width_buckets}
        self._positions = {w: torch.zeros(top, w, dtype=torch.int64, device=dev) for w in self.width_buckets}
        self._slots = {w: torch.zeros(top, w, dtype=torch.int64, device=dev) for w in self.width_buckets}
        self._rows = torch.full((top,), spec.scratch_row, dtype=torch.int64, device=dev)
        self._last = torch.zeros(top, dtype=torch.int64, device=dev)
        self.cuda = dev.type == "cuda"
        self.graphs = BucketedGraphs(self._forward, dev, self.cuda, warmup_iters, before_capture=self._reset,
                                     name="talker prefill")

    def bucket(self, prompts: int, width: int) -> tuple[int, int] | None:
        """The (prompts, width) bucket a call runs at, None when no kept bucket holds it."""
        p, w = smallest_bucket(self.prompt_buckets, prompts), smallest_bucket(self.width_buckets, width)
        if p is None or w is None or (p, w) not in self.keys:
            return None
        return p, w

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, last: torch.Tensor,
                 write_slots: torch.Tensor) -> torch.Tensor | None:
        """Hidden states [P, D] of a call whose prompts all start at position 0, or None (run it
        eagerly). The result is a copy: the next replay rewrites the static output."""
        n, width = positions.shape
        key = self.bucket(n, width)
        if key is None:
            return None
        p, w = key
        self.graphs.ensure(key)  # before the inputs go in: warm-up and capture see padding only
        self._reset(key)
        self._x[w][:n, :width].copy_(x)
        self._positions[w][:n, :width].copy_(positions)
        self._slots[w][:n, :width].copy_(write_slots)
        self._rows[:n].copy_(rows)
        self._last[:n].copy_(last)
        return self.graphs.run(key)[:n].clone()

    @property
    def captured(self) -> tuple:
        """The (prompts, width) buckets captured so far."""
        return self.graphs.captured

    def capture_all(self) -> None:
        """Capture every kept bucket (engine start, before /readyz); without graphs, note them."""
        self.graphs.capture_all(self.keys)

    def _reset(self, key: tuple[int, int]) -> None:
        """The bucket's inputs all padding: position 0, the null slot, the scratch row."""
        p, w = key
        self._x[w][:p].zero_()
        self._positions[w][:p].zero_()
        self._slots[w][:p].zero_()
        self._rows[:p].fill_(self.spec.scratch_row)
        self._last[:p].zero_()

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        p, w = key
        n_blocks = -(-w // self.spec.block_size)  # prompts start at 0: their positions fit the width
        return self.spec.forward(self._x[w][:p], self._positions[w][:p], self._rows[:p], self._last[:p],
                                 self._slots[w][:p], n_blocks)


__all__ = ["GraphedPrefill", "PrefillSpec"]
