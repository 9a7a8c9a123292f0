"""The first-audio path of the engine core (engines/core/scheduler.py, outbox.py, worker.py), driven
step by step on CPU with fake pipelines: a first chunk of one frame at any load, later chunks sized
by each stream's buffered lead, an idle gap that is not mistaken for a slow device, and a first
chunk delivered as soon as its PCM lands instead of behind the next step. What is checked is the
recorded order of steps and deliveries and the chunk sizes, never a timing threshold."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engines.contract import AudioChunk, Priority, RequestHandle, SynthesisRequest
from engines.core.scheduler import LEAD_SCHEDULE, RequestState, RequestStatus, Scheduler
from engines.core.worker import Worker, WorkerConfig, first_chunk
from engines.pipelines.base import Capacity, Chunking, Prepared, Produced
from engines.pipelines.vocoder import VocalizeResult

G = 4
SAMPLES_PER_FRAME = 8


def state(rid: str, priority=Priority.REALTIME, pending_frames: int = 0, first_audio_at=None, frames_done=0,
          first_chunk_frames: int | None = None) -> RequestState:
    request = SynthesisRequest(id=rid, text="x", priority=priority, initial_codec_chunk_frames=first_chunk_frames)
    s = RequestState(handle=RequestHandle(request), deliver=print, prepared=Prepared(frames=1))
    if pending_frames:
        s.pending = [Produced(rid, frames_done, False, torch.zeros(pending_frames, G, dtype=torch.int64))]
    s.first_audio_at, s.frames_done = first_audio_at, frames_done
    return s


class FakeVocalizer:
    def vocalize(self, items):
        return [VocalizeResult(it.stream_id, it.codes, torch.zeros(it.num_frames * SAMPLES_PER_FRAME))
                for it in items]

    def close(self, stream_id):
        pass


class OneFramePipeline:
    """Every request makes ``frames`` frames, one per tick, like the talker (first chunk 4 frames,
    then chunks as long as all the audio before them, up to 12)."""

    name = "one-frame"
    chunking = Chunking(4, 12)

    def __init__(self, slots: int = 4, frames: int = 20):
        self.slots, self.frames = slots, frames
        self.made: dict[str, int] = {}
        self.in_slot: list[str] = []
        self.last_batch_rows = 0

    def prepare(self, request):
        self.made[request.id] = 0
        return Prepared(frames=self.frames)

    def prepare_many(self, requests):
        return [self.prepare(r) for r in requests]

    def start(self, request_id, prepared):
        self.in_slot.append(request_id)

    def capacity(self):
        return Capacity(free_rows=self.slots - len(self.in_slot))

    def tick(self, plan):
        self.last_batch_rows = len(self.in_slot)
        out = []
        for rid in list(self.in_slot):
            k = self.made[rid]
            self.made[rid] = k + 1
            last = k + 1 == self.frames
            if last:
                self.in_slot.remove(rid)
            out.append(Produced(rid, k, last, torch.zeros(1, G, dtype=torch.int64)))
        return out

    def drop(self, request_id):
        if request_id in self.in_slot:
            self.in_slot.remove(request_id)
        self.made.pop(request_id, None)

    def languages(self):
        return None

    def capture_graphs(self):
        pass

    @property
    def active_slots(self):
        return len(self.in_slot)


def speak(worker: Worker, rid: str, trace: list | None = None) -> list[AudioChunk]:
    """Submit one request and step the worker until its final chunk."""
    chunks: list[AudioChunk] = []
    done = threading.Event()

    def deliver(chunk: AudioChunk):
        chunks.append(chunk)
        if trace is not None and chunk.pcm.size:
            trace.append(("deliver", chunk.index))
        if chunk.is_final:
            done.set()

    worker.enqueue(SynthesisRequest(id=rid, text="x"), deliver)
    with torch.no_grad():
        for _ in range(1000):
            if done.is_set():
                break
            worker.step()
    assert done.is_set() and chunks[-1].error is None
    return chunks


def frames_per_chunk(chunks: list[AudioChunk]) -> list[int]:
    return [c.pcm.size // SAMPLES_PER_FRAME for c in chunks if c.pcm.size]


def test_a_first_chunk_is_one_frame_whatever_the_step_period():
    """A slow device (steps of 60 ms: the old sustainable-chunk rule gave 4 frames) and an idle one
    both start a stream with one frame; a request's own first-chunk size still wins."""
    for period in (0.0, 0.012, 0.060):
        sched = Scheduler(max_slots=4, chunking=Chunking(4, 4))
        sched.step_period = period
        assert sched.flush_size(state("new", pending_frames=1)) == LEAD_SCHEDULE[0] == 1
    own = state("own", pending_frames=1, first_chunk_frames=3)
    assert Scheduler(max_slots=4, chunking=Chunking(4, 4)).flush_size(own) == 3


@pytest.mark.parametrize("lead_s, expected", [(-0.2, 1), (0.05, 1), (0.08, 2), (0.12, 4), (0.2, 8), (0.5, 12)])
def test_later_chunks_grow_with_the_streams_lead(lead_s, expected):
    """Steps of 20 ms: a chunk of n frames is made and delivered in (n + 1.5) steps, so the stream
    waits for n frames only while its listener holds that much audio beyond now."""
    sched = Scheduler(max_slots=4, chunking=Chunking(12, 12))
    sched.step_period = 0.020
    now = 100.0
    s = state("s", pending_frames=1, first_audio_at=now + lead_s - 12 * 0.08, frames_done=12)  # lead = lead_s
    assert sched.flush_size(s, now=now) == expected
    # never longer than the pipeline's longest chunk
    sched.chunking = Chunking(3, 3)
    assert sched.flush_size(s, now=now) == max(n for n in LEAD_SCHEDULE if n <= min(expected, 3))
    # nor than all the audio before it
    young = state("young", pending_frames=1, first_audio_at=now + lead_s - 2 * 0.08, frames_done=2)
    sched.chunking = Chunking(12, 12)
    assert sched.flush_size(young, now=now) == max(n for n in LEAD_SCHEDULE if n <= min(expected, 2))


def test_an_idle_gap_between_requests_is_not_a_slow_step():
    """Two requests with the engine idle between them: the gap is not a step interval, so the
    second request's first chunk is one frame like the first's (it was 4: a first audio 3 steps
    later, what the H100 showed at one client in run 7)."""
    pipeline, vocalizer = OneFramePipeline(), FakeVocalizer()
    worker = Worker(pipeline, vocalizer, WorkerConfig(max_slots=4))
    first = speak(worker, "a")
    for _ in range(3):  # the loop turns of an idle engine
        worker.step()
    time.sleep(0.3)  # the next client arrives a while later (any gap: the old rule grew with it)
    second = speak(worker, "b")
    assert frames_per_chunk(first)[0] == frames_per_chunk(second)[0] == 1
    assert sum(frames_per_chunk(second)) == pipeline.frames


class SlowCopy:
    """A PCM copy on a device that is always behind the host: done only once it is waited for."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_a_first_chunk_is_delivered_before_the_next_step_not_behind_it():
    """The device runs behind the host (a copy completes only when waited for): the first chunk
    is waited for and delivered at the start of the next loop turn, before that turn's step; a
    later chunk waits in the outbox behind steps as before (the host never waits for those)."""
    trace: list = []
    worker = Worker(OneFramePipeline(frames=6), FakeVocalizer(), WorkerConfig(max_slots=4), trace=trace,
                    host_copy_event=SlowCopy)
    speak(worker, "a", trace)
    first_vocode = trace.index(("vocode", 1))
    assert trace[first_vocode + 1] == ("deliver", 0), trace  # before the next ("generate", 1)
    second_vocode = trace.index(("vocode", 1), first_vocode + 1)
    assert trace[second_vocode + 1] == ("generate", 1), trace  # steady chunks do not hold steps up


def test_first_chunks_are_realtime_ones():
    """Batch work (jobs) keeps the old delivery: its first chunk is not waited for."""
    realtime, batch = state("r"), state("b", Priority.BATCH)
    assert first_chunk((realtime, False, None, 1)) and not first_chunk((batch, False, None, 1))
    realtime.delivered = 1
    assert not first_chunk((realtime, False, None, 2))


def test_on_a_loaded_device_later_chunks_are_the_pipelines_first_chunk_size_for_every_stream():
    """Steps over half real time: whatever its lead, a stream that has ramped up makes chunks of the
    pipeline's first-chunk size (few chunk lengths, few decoder calls); a young one grows from its
    one-frame start to that size by its lead, so the first frame is not followed by a gap."""
    sched = Scheduler(max_slots=4, chunking=Chunking(4, 12))  # the talker's: first 4, up to 12
    sched.step_period = 0.060
    now = 100.0
    for lead_s in (-0.1, 0.05, 0.5, 2.0):
        s = state("s", pending_frames=1, first_audio_at=now + lead_s - 10 * 0.08, frames_done=10)
        assert sched.flush_size(s, now=now) == 4
    assert sched.flush_size(state("new", pending_frames=1), now=now) == 1
    for lead_s, expected in ((0.08, 1), (0.25, 2), (0.4, 4), (2.0, 4)):  # young: 4 frames out (< 2 x 4)
        s = state("young", pending_frames=1, first_audio_at=now + lead_s - 4 * 0.08, frames_done=4)
        assert sched.flush_size(s, now=now) == expected


@pytest.mark.parametrize("frames_done, lead_s, expected", [
    (7, 0.15, 5),  # the lead buys 4 frames, which would end at 11: grown to the window end at 12
    (8, 0.15, 4),  # 4 from 8: a window
    (14, 0.4, 14),  # 12 from 14 would end at 26: to 28
    (3, 0.1, 2), (10, 0.05, 1)])  # shorter than a window: as the lead says
def test_chunks_of_a_window_or_more_end_on_window_ends_for_a_windowed_decoder(frames_done, lead_s, expected):
    """A codec decoder on fixed windows of 4 frames (bf16, engines/pipelines/vocoder.py): chunks of 4
    frames or more end on a multiple of 4, so no window is decoded twice; shorter ones (the first
    audio) stay as the lead says."""
    sched = Scheduler(max_slots=4, align_frames=4, chunking=Chunking(12, 12))
    sched.step_period = 0.020
    now = 100.0
    s = state("s", pending_frames=1, first_audio_at=now + lead_s - frames_done * 0.08, frames_done=frames_done)
    assert sched.flush_size(s, now=now) == expected
    assert Scheduler(max_slots=4).align_frames == 1  # a decoder that takes any chunk: as before


def run_steps(sched: Scheduler, period: float, steps: int = 100) -> None:
    """``steps`` generation steps ``period`` apart, on the scheduler's own measure (no clock read)."""
    for k in range(steps):
        sched.observe(1, now=1000.0 + k * period)


def test_past_capacity_a_new_request_waits_while_a_playing_stream_is_at_risk():
    """Steps of 60 ms for a while (past capacity) on a fake clock: a stream playing with 100 ms of
    audio in its listener's hands would run dry before its next chunk is made and delivered, so the
    new request is held in the queue (a new row would lengthen those steps); once that stream is
    ahead again the new request starts, with the pipeline's first-chunk size (a lead for a device
    past capacity). A started request's next unit is never held; below half real time nothing is."""
    now = [100.0]
    sched = Scheduler(max_slots=4, chunking=Chunking(4, 12), clock=lambda: now[0])
    run_steps(sched, 0.060)
    playing = state("playing", frames_done=10, first_audio_at=now[0] - 10 * 0.08 + 0.100)  # lead 100 ms
    new = state("new")
    sched.add(playing, Prepared(frames=100))
    playing.status, playing.units_started, playing.holds_slot = RequestStatus.RUNNING, 1, True
    sched.add(new, Prepared(frames=100))
    states = sched.in_flight()
    assert sched.streams_at_risk(states)
    assert sched.slot_order(states, free=3) == []  # held: the free rows stay free
    assert new.status is RequestStatus.WAITING and new.held

    now[0] -= 0.5  # the same stream, 600 ms ahead: its next chunk is made in time
    assert not sched.streams_at_risk(states)
    assert sched.slot_order(states, free=3) == [new]
    assert sched.flush_size(new) == 4 and sched.flush_size(state("not-held")) == 1


def test_a_load_that_does_not_last_holds_nothing():
    """The same stream at risk, on a device under half real time, or over it for a step or two
    only (a burst of prefills): the new request starts, with a one-frame first chunk."""
    now = 100.0
    for spike in (False, True):
        sched = Scheduler(max_slots=4, chunking=Chunking(4, 12), clock=lambda: now)
        run_steps(sched, 0.030)
        if spike:  # one step of 120 ms: the step period is over half real time, the load did not last
            sched.observe(1, now=1000.0 + 99 * 0.030 + 0.120)
            assert not sched.room_to_grow
        playing = state("playing", frames_done=10, first_audio_at=now - 10 * 0.08 + 0.050)
        playing.status, playing.units_started, playing.holds_slot = RequestStatus.RUNNING, 1, True
        new = state("new")
        sched.add(new, Prepared(frames=100))
        assert not sched.streams_at_risk([playing, new])
        assert sched.slot_order([playing, new], free=3) == [new] and sched.flush_size(new) == 1


def test_past_capacity_only_playing_realtime_streams_hold_admissions():
    """A stream that cannot run dry through the device - batch work, a paused listener, no audio
    yet - holds nothing back, whatever its lead."""
    now = 100.0
    sched = Scheduler(max_slots=4, chunking=Chunking(4, 12), clock=lambda: now)
    run_steps(sched, 0.060)
    behind = dict(frames_done=10, first_audio_at=now - 10 * 0.08)  # lead 0
    batch = state("batch", Priority.BATCH, **behind)
    paused = state("paused", **behind)
    paused.handle.pause()
    not_started = state("young")  # no audio yet: its deadline is its submission
    for s in (batch, paused, not_started):
        s.status = RequestStatus.RUNNING
    assert not sched.streams_at_risk([batch, paused, not_started], now=now)
    playing = state("playing", **behind)
    playing.status = RequestStatus.RUNNING
    assert sched.streams_at_risk([batch, paused, not_started, playing], now=now)
