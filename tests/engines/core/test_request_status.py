"""A request's explicit status (engines/core/scheduler.py ``RequestStatus``), watched step by step
on the real tiny DiT engine and forced aligner: every request moves forward through waiting,
prefilling, running, vocalizing (and aligning, when it asked for word times) and ends finished
or cancelled; the scheduler holds exactly the requests in flight and those aligning."""

from __future__ import annotations

import pytest
import torch

from engines.build import build_engine
from engines.config import EngineConfig
from engines.contract import SynthesisRequest
from engines.core.scheduler import RequestStatus as S
from engine_helpers import Collected

ORDER = [S.WAITING, S.PREFILLING, S.RUNNING, S.VOCALIZING, S.ALIGNING]
TEXT = "One sentence, then another one; and a third clause to make several chunks."


def drive(worker, requests: list[SynthesisRequest], cancel_after: dict[str, int] | None = None,
          steps: int = 5_000) -> tuple[dict[str, list[S]], dict[str, Collected]]:
    """Enqueue ``requests``, step the worker on this thread until each has its final chunk; each
    request's distinct statuses in the order seen after every step, and what it was delivered.
    ``cancel_after``: request id -> the step at which its handle is cancelled."""
    out = {r.id: Collected() for r in requests}
    handles = {r.id: worker.enqueue(r, out[r.id].deliver) for r in requests}
    states, seen = {}, {r.id: [] for r in requests}
    with torch.no_grad():
        for step in range(steps):
            worker.step()
            sched = worker.scheduler
            assert all(s.status.in_flight for s in sched.requests.values())
            assert all(s.status is S.ALIGNING for s in sched.aligning)
            for state in [*sched.requests.values(), *sched.aligning]:
                states[state.request_id] = state
            for rid, state in states.items():
                if not seen[rid] or seen[rid][-1] is not state.status:
                    seen[rid].append(state.status)
            for rid, at in (cancel_after or {}).items():
                if step == at:
                    handles[rid].cancel()
            if all(c.done.is_set() for c in out.values()):
                break
    assert all(c.done.is_set() for c in out.values()), "the requests did not finish"
    assert not worker.scheduler.requests and not worker.scheduler.aligning and worker.idle
    return seen, out


def forward(statuses: list[S]) -> bool:
    """Live statuses in lifecycle order (none repeated after a later one), then one end."""
    live = [ORDER.index(s) for s in statuses if not s.done]
    return live == sorted(live) and all(s.done for s in statuses[len(live):]) and statuses[-1].done


def test_statuses_move_forward_and_waiting_is_the_queue():
    engine = build_engine(EngineConfig.for_tests(max_slots=1, warmup=False))  # one slot: the second waits
    worker = engine.worker
    seen, out = drive(worker, [SynthesisRequest(id="a", text=TEXT, seed=1),
                               SynthesisRequest(id="b", text="Short one.", seed=2)])
    for rid in "ab":
        assert forward(seen[rid]), seen[rid]
        assert seen[rid][-1] is S.FINISHED and out[rid].error is None and out[rid].pcm.size
        assert {S.PREFILLING, S.VOCALIZING} <= set(seen[rid])
    assert S.RUNNING in seen["a"]  # several chunks: frames before its last ones
    assert seen["b"][0] is S.WAITING  # "a" held the one slot
    assert worker.queue_depth == 0


def test_a_cancelled_request_ends_cancelled_and_the_others_finish():
    engine = build_engine(EngineConfig.for_tests(warmup=False))
    seen, out = drive(engine.worker, [SynthesisRequest(id="keep", text=TEXT, seed=1),
                                      SynthesisRequest(id="drop", text=TEXT, seed=2)], cancel_after={"drop": 2})
    assert forward(seen["drop"]) and seen["drop"][-1] is S.CANCELLED and out["drop"].error == "cancelled"
    assert forward(seen["keep"]) and seen["keep"][-1] is S.FINISHED and out["keep"].error is None


def test_word_times_are_a_stage_after_the_audio(aligner_dir):
    aligned: list = []  # (request id, its status) as the aligner takes it

    def hook(request_id: str, stage: str) -> None:
        if stage == "align":
            aligned.extend([(s.request_id, s.status) for s in engine.worker.scheduler.aligning if s.request_id == request_id])

    engine = build_engine(EngineConfig.for_tests(aligner=str(aligner_dir), warmup=False), hook)
    seen, out = drive(engine.worker, [SynthesisRequest(id="timed", text="Hello there.", seed=1, timestamps=True),
                                      SynthesisRequest(id="plain", text="Hello there.", seed=1)])
    assert aligned == [("timed", S.ALIGNING)]  # (its audio delivered and aligned in one step: seen here)
    assert forward(seen["timed"]) and seen["timed"][-2:] == [S.VOCALIZING, S.FINISHED]
    assert seen["plain"][-1] is S.FINISHED
    final = out["timed"].chunks[-1]
    assert final.is_final and final.pcm.size == 0 and final.alignment is not None  # the final chunk follows the audio
    assert out["timed"].pcm.size == out["plain"].pcm.size  # the same audio, its word times after it


@pytest.fixture(scope="module")
def aligner_dir():
    from conftest import ALIGNER

    if not (ALIGNER / "config.json").exists():
        pytest.fail("no aligner fixture: run `bash scripts/aligner-oracle-env.sh` (builds tests/fixtures/aligner)")
    return ALIGNER
