"""The identity-fair slot policy of ``engines/core/scheduler.py`` on hand-made request
states: least-served tenant first, the last free slot kept for a tenant
holding none, and streams far ahead of their listener yield while a newcomer's first
chunk is generated. No timing: only which requests are picked."""

from __future__ import annotations

import time

from engines.contract import Priority, RequestHandle, SynthesisRequest
from engines.core.scheduler import RequestState, RequestStatus, Scheduler
from engines.pipelines.base import Prepared


def state(rid: str, tenant: str, priority: Priority = Priority.REALTIME, started: bool = False) -> RequestState:
    """A request of two slot units (a started one between them wants its second, as the DiT's chunks do)."""
    s = RequestState(handle=RequestHandle(SynthesisRequest(id=rid, text="x", tenant=tenant, priority=priority)),
                     deliver=lambda chunk: None, prepared=Prepared(frames=1, units=2))
    if started:
        s.status, s.units_started = RequestStatus.RUNNING, 1
    return s


def pick(scheduler: Scheduler, states: list[RequestState], free: int, in_slot: set[str]) -> list[str]:
    for s in states:
        s.holds_slot = s.request_id in in_slot
    return [s.request_id for s in scheduler.slot_order(states, free)]


def test_least_served_tenant_goes_first_not_the_oldest():
    scheduler = Scheduler(max_slots=8)
    heavy_running = [state(f"h{i}", "heavy", started=True) for i in range(4)]
    heavy_waiting = [state(f"hw{i}", "heavy") for i in range(4)]
    light = state("light", "light")
    states = heavy_running + heavy_waiting + [light]  # light arrived last
    assert pick(scheduler, states, 1, {s.request_id for s in heavy_running})[0] == "light"
    # Plain FIFO (the old policy) would have started hw0 first.


def test_the_last_free_slot_waits_for_a_tenant_holding_none():
    scheduler = Scheduler(max_slots=8)
    running = [state(f"h{i}", "heavy", started=True) for i in range(6)]
    waiting = [state(f"hw{i}", "heavy") for i in range(4)]
    in_slot = {s.request_id for s in running}
    assert pick(scheduler, running + waiting, 2, in_slot) == ["hw0"]  # one of the two stays free
    newcomer = state("light", "light")
    assert pick(scheduler, running + waiting + [newcomer], 1, in_slot) == ["light"]


def test_requests_without_a_tenant_are_first_come_first_served_and_use_every_slot():
    scheduler = Scheduler(max_slots=8)
    waiting = [state(f"r{i}", "") for i in range(10)]
    assert pick(scheduler, waiting, 8, set()) == [f"r{i}" for i in range(8)]


def test_realtime_still_goes_before_batch_whatever_the_tenant():
    scheduler = Scheduler(max_slots=8)
    batch = state("batch", "light", Priority.BATCH)
    realtime = [state(f"rt{i}", "heavy") for i in range(2)]
    assert pick(scheduler, [batch, *realtime], 3, set()) == ["rt0", "rt1", "batch"]


def test_streams_far_ahead_of_their_listener_yield_to_a_first_chunk():
    scheduler = Scheduler(max_slots=8, ahead_seconds=1.0)
    now = time.monotonic()
    ahead = state("ahead", "heavy", started=True)
    ahead.first_audio_at, ahead.frames_done = now, 100  # 8 s of audio handed over just now
    behind = state("behind", "heavy", started=True)
    behind.first_audio_at, behind.frames_done = now - 10, 100  # its listener is about to run dry
    newcomer = state("light", "light", started=True)  # in a slot, first chunk not produced yet
    states = [ahead, behind, newcomer]
    assert pick(scheduler, states, 4, {"light"}) == ["behind"]
    newcomer.first_audio_at, newcomer.frames_done = now, 1  # its first chunk is out: nobody yields any more
    assert sorted(pick(scheduler, states, 4, {"light"})) == ["ahead", "behind"]
