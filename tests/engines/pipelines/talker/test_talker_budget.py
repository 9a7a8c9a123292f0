"""A talker utterance's frame budget is planned once, before it is submitted (``plan``: its ids and
its budget, engines/pipelines/talker/budget.py), and travels in its request
(``SynthesisRequest.budget``): admission runs the row to the budget the request carries and
counts nothing again from its text; the engine checks a carried budget once, at submit.

On an in-process random talker whose EOS never wins (testsupport/talker.py), so that a row runs
exactly to its limit, and on the talker oracle fixture's engine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engines.contract import FrameBudget, InvalidRequest, SynthesisRequest
from engines.pipelines.talker.budget import frame_budget
from engines.pipelines.talker.source import TalkerSource
from testsupport.talker import make_bundle, step

TEXT = "Hello world, this is a small test of streaming speech."


@pytest.fixture(scope="module")
def endless():
    return make_bundle(seed=5, eos_gain=0.0, max_new_tokens=400)  # EOS scores 0: greedy never picks it


def spoken(source: TalkerSource, request: SynthesisRequest) -> tuple[int, str | None]:
    """Admit ``request`` alone and run it to its end: (frames, why it was cut)."""
    source.admit(request)
    frames, last = 0, None
    while source.active_slots:
        for out in step(source):
            frames += out.codes.shape[0]
            last = out
    return frames, last.truncated


def test_admission_runs_a_row_to_the_budget_its_request_carries(endless):
    source = TalkerSource.from_bundle(endless, max_slots=1)
    planned = source.plan(SynthesisRequest(id="a", text=TEXT, voice="ryan", greedy=True))
    own = frame_budget(len(planned.prompt_ids[3:-5]))  # its text's budget: 15 frames a token + 50
    assert planned.budget == FrameBudget(own, "budget", own) and own < 400 - 1
    assert source.plan(planned) is planned  # planned once: nothing is planned again
    assert spoken(source, planned) == (own, "budget")
    # Admission takes the budget the request carries, whatever its text would give.
    assert spoken(source, replace(planned, id="b", budget=FrameBudget(7, "budget", own))) == (7, "budget")
    assert spoken(source, replace(planned, id="c", budget=FrameBudget(5, "max_new_tokens"))) == (5, "max_new_tokens")


def test_the_engine_plans_a_request_once_and_checks_the_budget_it_carries(talker_engine):
    planned = talker_engine.plan(SynthesisRequest(id="p", text="Hello there.", temperature=0))
    assert planned.prompt_ids and planned.budget.frames <= planned.budget.text_frames  # (the fixture's max_new_tokens)
    assert talker_engine.plan(planned) is planned
    checked = talker_engine.validate(planned)  # what submit does first: checked, not planned again
    assert (checked.prompt_ids, checked.budget) == (planned.prompt_ids, planned.budget)
    assert talker_engine.planned_work(planned).model_steps == planned.budget.frames
    with pytest.raises(InvalidRequest) as refused:
        talker_engine.validate(replace(planned, budget=FrameBudget(10**6, "budget")))
    assert refused.value.field == "budget"
