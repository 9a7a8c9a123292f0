"""The scheduler's KV-block admission and prefill-token decisions, on hand-made pipeline reports
(engines/pipelines/base.py ``Capacity``) and in a served engine: the pipeline reports, the
scheduler decides (the prefill token budget included), the pipeline executes."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from engines.core.scheduler import DEFAULT_PREFILL_TOKEN_BUDGET, Scheduler
from engines.pipelines.base import Capacity
from testsupport.talker import waiting_prompt


@pytest.mark.parametrize("capacity, waiting_blocks, admitted", [
    (Capacity(free_rows=4), 0, 4),  # nothing waits for blocks: every free row
    (Capacity(free_rows=0, free_blocks=100), 2, 0),  # no free row
    # 10 free blocks, 2 kept for the 2 decoding rows' growth: 8 // (3 + 1) = 2 prompts of 3 blocks
    (Capacity(free_rows=4, free_blocks=10, growth_blocks=2), 3, 2),
    (Capacity(free_rows=1, free_blocks=10, growth_blocks=2), 3, 1),  # rows bound it
    (Capacity(free_rows=4, free_blocks=3, growth_blocks=0), 3, 0),  # prompt fits, growth not
    (Capacity(free_rows=4, free_blocks=1, growth_blocks=5), 1, 0),  # never negative
])
def test_admission_keeps_blocks_for_the_prompt_and_every_rows_growth(capacity, waiting_blocks, admitted):
    assert Scheduler.admissible(capacity, waiting_blocks) == admitted


def test_the_scheduler_keeps_blocks_for_the_longest_prompt_in_its_own_queue():
    """The waiting prompts' positions are the scheduler's (Prepared.prompt_positions of its WAITING
    requests), not the pipeline's: it counts their blocks at the pool's block size, only while they
    wait, and a started request's prompt no longer holds room back."""
    scheduler = Scheduler(max_slots=4)
    pool = Capacity(free_rows=4, free_blocks=10, growth_blocks=2, block_size=8)
    assert scheduler.free_slots(pool) == 4  # nothing waits
    waiting_prompt(scheduler, 20, "short")  # 21 positions with its first frame: 3 blocks of 8
    waiting_prompt(scheduler, 40, "long")  # 41: 6 blocks
    assert scheduler.waiting_blocks(pool) == 6 and scheduler.free_slots(pool) == 1  # 8 // (6 + 1)
    scheduler.started(scheduler.requests["long"])
    assert scheduler.waiting_blocks(pool) == 3 and scheduler.free_slots(pool) == 2
    assert scheduler.step_plan(Capacity(free_rows=1, free_blocks=3, block_size=8)).kv_wait
    assert Capacity(free_rows=1).blocks_for(40) == 0, "no KV pool: no blocks"


def test_prefill_positions_go_oldest_first_until_the_budget_is_spent():
    assert Scheduler.prefill_tokens((5, 7, 3), budget=9) == (5, 4)  # the second gets what is left
    assert Scheduler.prefill_tokens((20, 3), budget=8) == (8,)  # a long prompt takes several steps
    assert Scheduler.prefill_tokens((2, 3), budget=64) == (2, 3)
    assert Scheduler.prefill_tokens((), budget=8) == ()


def test_step_plan_counts_a_free_row_that_waits_for_blocks():
    scheduler = waiting_prompt(Scheduler(max_slots=4, prefill_token_budget=10), 40)  # 3 blocks of 16
    waiting = Capacity(free_rows=3, free_blocks=4, growth_blocks=1, block_size=16, prefill_waiting=(6, 6))
    plan = scheduler.step_plan(waiting)
    assert plan.kv_wait and plan.prefill == (6, 4)
    fits = Capacity(free_rows=3, free_blocks=9, growth_blocks=1, block_size=16)
    assert not scheduler.step_plan(fits).kv_wait and scheduler.step_plan(fits).prefill == ()
    assert not scheduler.step_plan(Capacity(free_rows=0, free_blocks=0, block_size=16)).kv_wait


@pytest.mark.parametrize("budget, planned", [(1, (1,)), (5, (5,)), (9, (7, 2)), (12, (7, 4, 1)), (512, (7, 4, 30))])
def test_the_scheduler_alone_sets_each_steps_prefill_allowance(budget, planned):
    """The pipeline reports only what its prompts have left; how many positions a step prefills in
    all is the scheduler's configured budget, spread over the prompts oldest first."""
    assert not [f.name for f in fields(Capacity) if "budget" in f.name], "a pipeline reports no budget"
    report = Capacity(free_rows=0, prefill_waiting=(7, 4, 30))
    plan = Scheduler(max_slots=4, prefill_token_budget=budget).step_plan(report)
    assert plan.prefill == planned
    assert sum(plan.prefill) == min(budget, sum(report.prefill_waiting))


def test_the_default_prefill_budget_and_a_bad_one():
    assert Scheduler(max_slots=4).prefill_token_budget == DEFAULT_PREFILL_TOKEN_BUDGET == 512
    with pytest.raises(ValueError, match="prefill_token_budget"):
        Scheduler(max_slots=4, prefill_token_budget=0)


def test_the_engine_prefills_what_its_scheduler_allows_and_the_audio_stays_the_same():
    """--prefill-token-budget reaches the core scheduler, not the talker: with a budget of 3 every
    step's plan (recorded where the pipeline receives it) prefills at most 3 prompt positions, the
    prompt takes several steps, and the audio equals the default budget's (one step) bit for bit."""
    from engine_helpers import run_requests

    from engines.build import build_engine
    from engines.config import EngineConfig
    from engines.contract import SynthesisRequest
    from tests.oracle import talker_fixtures as fx

    checkpoint = str(fx.checkpoint_dir("cv_proj"))
    audio, planned = {}, {}
    for budget in (3, None):
        engine = build_engine(EngineConfig.for_tests(checkpoint=checkpoint, warmup=False, prefill_token_budget=budget))
        assert engine.worker.scheduler.prefill_token_budget == (budget or DEFAULT_PREFILL_TOKEN_BUDGET)
        assert not hasattr(engine.pipeline.source, "prefill_token_budget"), "the talker keeps no budget"
        plans = planned[budget] = []
        pipeline_tick = engine.pipeline.tick

        def recording_tick(plan, plans=plans, pipeline_tick=pipeline_tick):
            plans.append(sum(plan.prefill))
            return pipeline_tick(plan)

        engine.pipeline.tick = recording_tick
        engine.start()
        try:
            [done] = run_requests(engine, [SynthesisRequest(id="p", text="Hello there, prefill.", seed=0,
                                                            temperature=0, max_new_tokens=12)])
        finally:
            engine.stop()
        assert done.error is None
        audio[budget] = done.pcm
    prompt = sum(planned[None])
    assert prompt > 6 and [n for n in planned[None] if n] == [prompt], "the default budget: one step"
    assert max(planned[3]) == 3 and sum(planned[3]) == prompt and sum(1 for n in planned[3] if n) >= prompt // 3
    # the same codes; the audio chunks may be cut at other frames (their size follows the measured
    # step period), and the decoder's float sums then round differently: far below one int16 step
    np.testing.assert_allclose(audio[3], audio[None], rtol=0, atol=1e-5)
