"""The scheduler's KV-block admission and prefill-token decisions, on hand-made pipeline reports
(engines/pipelines/base.py ``Capacity``): the pipeline reports, the scheduler decides."""

from __future__ import annotations

from dataclasses import fields

import pytest

from engines.core.scheduler import DEFAULT_PREFILL_TOKEN_BUDGET, Scheduler
from engines.pipelines.base import Capacity


@pytest.mark.parametrize("capacity, admitted", [
    (Capacity(free_rows=4), 4),  # nothing waits for blocks: every free row
    (Capacity(free_rows=0, free_blocks=100, waiting_blocks=2), 0),  # no free row
    # 10 free blocks, 2 kept for the 2 decoding rows' growth: 8 // (3 + 1) = 2 prompts of 3 blocks
    (Capacity(free_rows=4, free_blocks=10, growth_blocks=2, waiting_blocks=3), 2),
    (Capacity(free_rows=1, free_blocks=10, growth_blocks=2, waiting_blocks=3), 1),  # rows bound it
    (Capacity(free_rows=4, free_blocks=3, growth_blocks=0, waiting_blocks=3), 0),  # prompt fits, growth not
    (Capacity(free_rows=4, free_blocks=1, growth_blocks=5, waiting_blocks=1), 0),  # never negative
])
def test_admission_keeps_blocks_for_the_prompt_and_every_rows_growth(capacity, admitted):
    assert Scheduler.admissible(capacity) == admitted


def test_prefill_positions_go_oldest_first_until_the_budget_is_spent():
    assert Scheduler.prefill_tokens((5, 7, 3), budget=9) == (5, 4)  # the second gets what is left
    assert Scheduler.prefill_tokens((20, 3), budget=8) == (8,)  # a long prompt takes several steps
    assert Scheduler.prefill_tokens((2, 3), budget=64) == (2, 3)
    assert Scheduler.prefill_tokens((), budget=8) == ()


def test_step_plan_counts_a_free_row_that_waits_for_blocks():
    scheduler = Scheduler(max_slots=4, prefill_token_budget=10)
    waiting = Capacity(free_rows=3, free_blocks=4, growth_blocks=1, waiting_blocks=3, prefill_waiting=(6, 6))
    plan = scheduler.step_plan(waiting)
    assert plan.kv_wait and plan.prefill == (6, 4)
    fits = Capacity(free_rows=3, free_blocks=9, growth_blocks=1, waiting_blocks=3)
    assert not scheduler.step_plan(fits).kv_wait and scheduler.step_plan(fits).prefill == ()
    assert not scheduler.step_plan(Capacity(free_rows=0, free_blocks=0, waiting_blocks=3)).kv_wait


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
