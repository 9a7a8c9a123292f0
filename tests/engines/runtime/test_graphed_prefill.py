"""GraphedPrefill: the talker's prompt prefill padded into static (prompts, width) buckets. On CPU
the padded path runs eagerly, so these tests hold it to the plain prefill: the same codes (greedy,
exactly) and the same hidden states (1e-5 in fp32: the padded forward multiplies matrices of another
shape, which may sum in another order), and only first chunks take it. The CUDA test checks the
replayed graphs the same way, at bf16's own tolerance."""

from __future__ import annotations

import pytest
import torch

from engines.contract import SynthesisRequest
from engines.core.scheduler import Scheduler
from engines.pipelines.talker.source import SourceRunners, TalkerSource
from engines.runtime.graphed_prefill import GraphedPrefill
from testsupport.talker import make_bundle

TEXTS = ["Hello.", "A somewhat longer sentence for the prefill to chew on.", "Two words", "Numbers like 42 too."]


def run(bundle, runner: bool, budget: int = 512, steps: int = 6):
    """Admit TEXTS greedily, prefill under ``budget`` positions per step, decode ``steps`` steps ->
    (codes per request, hidden states after prefill, the runner's calls)."""
    calls = []

    def counted(spec):  # the source's prefill runner: a GraphedPrefill whose calls are counted
        graphed = GraphedPrefill(spec)
        graphed.capture_all()

        def counting(*args):
            out = graphed(*args)
            calls.append(out is not None)
            return out
        return counting

    source = TalkerSource.from_bundle(bundle, max_slots=4, max_seq_len=256, kv_cache_gb=0.01, prefix_cache_fraction=0.0,
                                      runners=SourceRunners(prefill=counted if runner else None))
    scheduler = Scheduler(max_slots=4, prefill_token_budget=budget)
    for i, text in enumerate(TEXTS):
        source.admit(SynthesisRequest(id=f"r{i}", text=text, voice="ryan", temperature=0), max_new_tokens=steps + 2)
    with torch.no_grad():
        while source._prefill_queue:
            source.prefill_step(scheduler.step_plan(source.capacity()).prefill)
        hidden = source.state.h[:4].clone()
        codes: dict[str, list] = {}
        for _ in range(steps):
            for frames in source.tick(scheduler.step_plan(source.capacity())):
                codes.setdefault(frames.request_id, []).append(frames.codes)
    return {k: torch.cat(v).tolist() for k, v in codes.items()}, hidden, calls


def test_graphed_prefill_equals_the_plain_prefill_on_cpu():
    bundle = make_bundle(seed=3, eos_gain=0.0)
    plain_codes, plain_h, _ = run(bundle, runner=False)
    codes, h, calls = run(bundle, runner=True)
    assert calls == [True], "the four prompts' first chunks are one call, through a bucket"
    assert codes == plain_codes and len(codes) == len(TEXTS)
    torch.testing.assert_close(h, plain_h, rtol=1e-5, atol=1e-5)


def test_later_chunks_of_a_long_prompt_run_eagerly():
    bundle = make_bundle(seed=3, eos_gain=0.0)
    plain_codes, _, _ = run(bundle, runner=False, budget=8)
    codes, _, calls = run(bundle, runner=True, budget=8)
    assert codes == plain_codes
    # 8 positions a step: 14 prefill calls; only the three made of first chunks alone (r0's, r2's,
    # r3's) reach the runner, the ones that continue a prompt (start > 0) run eagerly
    assert calls == [True, True, True]


def test_buckets_hold_at_most_max_positions():
    bundle = make_bundle(seed=3)
    source = TalkerSource.from_bundle(bundle, max_slots=4, max_seq_len=256, kv_cache_gb=0.01)
    runner = GraphedPrefill(source.prefill_spec())
    assert all(p * w <= 1024 for p, w in runner.keys) and (1, 512) in runner.keys and (32, 32) in runner.keys
    assert runner.bucket(3, 20) == (4, 32) and runner.bucket(1, 600) is None and runner.bucket(8, 256) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_prefill_replays_equal_the_plain_prefill_on_cuda():
    bundle = make_bundle(seed=3, eos_gain=0.0, device="cuda", dtype=torch.bfloat16)
    plain_codes, plain_h, _ = run(bundle, runner=False)
    codes, h, calls = run(bundle, runner=True)
    assert calls == [True]
    torch.testing.assert_close(h, plain_h)  # bf16 defaults: the padded GEMMs may round differently
    agree = sum(a == b for k in codes for a, b in zip(codes[k], plain_codes[k]))
    assert agree >= 0.9 * sum(len(v) for v in plain_codes.values())
