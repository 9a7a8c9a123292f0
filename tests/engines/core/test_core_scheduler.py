"""The engine core's scheduling, driven step by step on CPU with a fake pipeline and vocoder.

What is checked is the recorded step trace (which generation steps and vocoder pieces ran,
in order), never a timing threshold: a burst of finished chunks from many streams must not
hold the next generation step up by more than one bounded vocoder piece.
"""

from __future__ import annotations

import threading
import time

import torch

from engines.contract import AudioChunk, Priority, RequestHandle, SynthesisRequest
from engines.core.scheduler import RequestState, Scheduler
from engines.core.worker import Worker, WorkerConfig
from engines.pipelines.base import Capacity, Chunking, Prepared, Produced
from engines.pipelines.vocoder import VocalizeResult

G = 4
SAMPLES_PER_FRAME = 8


class FakePipeline:
    """Every request is ``chunks`` chunks of ``frames`` frames; a chunk finishes after ``steps``
    ticks in its slot. Requests started together finish their chunks in the same tick: a burst."""

    name = "fake"

    def __init__(self, slots: int, chunks: int = 3, frames: int = 12, steps: int = 4):
        self.slots, self.chunks, self.frames, self.steps = slots, chunks, frames, steps
        self.next_chunk: dict[str, int] = {}
        self.in_slot: dict[str, int] = {}  # request id -> ticks left
        self.last_batch_rows = 0

    chunking = Chunking(1, 1)  # each chunk goes to the vocoder as it is

    def prepare(self, request):
        self.next_chunk[request.id] = 0
        return Prepared(frames=self.chunks * self.frames, units=self.chunks)  # a slot per chunk, one after another

    def prepare_many(self, requests):
        return [self.prepare(r) for r in requests]

    def start(self, request_id, prepared):
        self.in_slot[request_id] = self.steps

    def capacity(self):
        return Capacity(free_rows=self.slots - len(self.in_slot))

    def tick(self, plan):
        self.last_batch_rows = len(self.in_slot)
        out = []
        for rid in list(self.in_slot):
            self.in_slot[rid] -= 1
            if self.in_slot[rid] == 0:
                del self.in_slot[rid]
                k = self.next_chunk[rid]
                self.next_chunk[rid] = k + 1
                out.append(Produced(rid, k * self.frames, k + 1 == self.chunks,
                                    torch.zeros(self.frames, G, dtype=torch.int64), unit_done=True))
        return out

    def drop(self, request_id):
        self.in_slot.pop(request_id, None)
        self.next_chunk.pop(request_id, None)

    def languages(self):
        return None

    def capture_graphs(self):
        pass

    @property
    def active_slots(self):
        return len(self.in_slot)


class FakeVocalizer:
    def __init__(self):
        self.calls: list[list[str]] = []

    def vocalize(self, items):
        self.calls.append([it.stream_id for it in items])
        return [VocalizeResult(it.stream_id, it.codes, torch.zeros(it.num_frames * SAMPLES_PER_FRAME))
                for it in items]

    def close(self, stream_id):
        pass


def run_burst(streams: int, vocoder_frames: int, chunks: int = 3, frames: int = 12, keep_up: float = 0.0,
              steps: int = 4):
    """Drive the core step by step until every stream's final chunk is delivered. ``keep_up=0``
    switches the scheduler's production-rate floor off, so the bound is exactly ``vocoder_frames``."""
    pipeline, vocalizer, trace = FakePipeline(streams, chunks, frames, steps), FakeVocalizer(), []
    worker = Worker(pipeline, vocalizer, WorkerConfig(max_slots=streams, vocoder_frames=vocoder_frames,
                                                      vocoder_keep_up=keep_up), trace=trace)
    audio: dict[str, list[AudioChunk]] = {}
    done = threading.Event()
    finals = []

    def deliver(chunk: AudioChunk):
        audio.setdefault(chunk.request_id, []).append(chunk)
        if chunk.is_final:
            finals.append(chunk)
            if len(finals) == streams:
                done.set()

    for i in range(streams):
        worker.enqueue(SynthesisRequest(id=f"s{i}", text="x"), deliver)
    with torch.no_grad():
        for _ in range(10_000):
            if done.is_set():
                break
            worker.step()
    assert done.is_set(), "the requests did not finish"
    return trace, audio, vocalizer


def test_a_burst_of_finished_chunks_holds_generation_up_by_at_most_one_piece():
    streams, frames, budget = 16, 12, 24  # a burst of 16 x 12 = 192 frames, pieces of <= 24
    trace, audio, _ = run_burst(streams, budget, frames=frames)
    generate_at = [i for i, (kind, _) in enumerate(trace) if kind == "generate"]
    assert len(generate_at) >= 3 * 4  # 3 chunks of 4 steps each
    for a, b in zip(generate_at, generate_at[1:]):
        between = trace[a + 1:b]
        assert len(between) <= 1, f"{len(between)} vocoder pieces between generation steps {a} and {b}"
    assert all(kind == "generate" or n <= budget for kind, n in trace)  # every piece is bounded
    assert ("vocode", budget) in trace  # the burst was one: pieces ran full
    assert sum(n for kind, n in trace if kind == "vocode") == streams * 3 * frames
    # Nothing lost or reordered: every stream's audio arrives whole and in order.
    for rid, chunks in audio.items():
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert sum(c.pcm.size for c in chunks) == 3 * frames * SAMPLES_PER_FRAME and chunks[-1].error is None


def test_an_unbounded_budget_vocodes_a_whole_burst_in_one_piece():
    trace, _, vocalizer = run_burst(16, 10_000)
    assert max(len(call) for call in vocalizer.calls) == 16  # the old behaviour: one batch per tick
    assert [kind for kind, _ in trace].count("vocode") == 3


def test_sustained_production_above_the_floor_does_not_build_a_backlog():
    """Every stream finishes a 12-frame chunk every step (192 frames/step) against a floor of 24:
    the bound follows the production rate, so the vocoder keeps up and the run ends soon
    after generation does."""
    trace, _, _ = run_burst(16, 24, chunks=30, steps=1, keep_up=2.0)
    kinds = [kind for kind, _ in trace]
    last_generate = len(kinds) - 1 - kinds[::-1].index("generate")
    assert kinds.count("generate") == 30
    assert len(kinds) - last_generate - 1 <= 10  # vocoder steps left once generation ended
    assert max(n for kind, n in trace if kind == "vocode") > 24  # the bound rose above the floor


def test_the_first_piece_after_a_burst_goes_to_the_earliest_deadline():
    """Streams still waiting for their first audio come first (by submission), then the streams
    whose buffered audio runs out soonest."""
    _, _, vocalizer = run_burst(6, 12, chunks=2)  # one 12-frame chunk per piece, 4 steps per chunk
    # s4 and s5 still wait for their first audio when the second burst arrives: they go before
    # everyone's second chunk; those follow in the order the streams started playing.
    assert vocalizer.calls == [[f"s{i}"] for i in range(6)] * 2


def state(rid: str, priority=Priority.REALTIME, pending_frames: int = 0, first_audio_at=None, frames_done=0):
    s = RequestState(handle=RequestHandle(SynthesisRequest(id=rid, text="x", priority=priority)), deliver=print,
                     prepared=Prepared(frames=1))
    if pending_frames:
        s.pending = [Produced(rid, frames_done, False, torch.zeros(pending_frames, G, dtype=torch.int64))]
    s.first_audio_at, s.frames_done = first_audio_at, frames_done
    return s


def test_vocoder_piece_is_bounded_by_frames_and_ordered_by_deadline():
    now = time.monotonic()
    late = state("late", pending_frames=10, first_audio_at=now, frames_done=50)  # 4 s of audio buffered
    soon = state("soon", pending_frames=10, first_audio_at=now, frames_done=5)
    new = state("new", pending_frames=4)  # nothing played yet: most urgent
    batch = state("batch", Priority.BATCH, pending_frames=4)
    sched = Scheduler(max_slots=8, vocoder_frames=16)
    piece = sched.vocoder_piece([late, soon, batch, new])
    assert [w.state.request_id for w in piece] == ["new", "soon"]  # 14 frames; late (10) would exceed 16
    big = Scheduler(max_slots=8, vocoder_frames=4).vocoder_piece([soon])
    assert [w.num_frames for w in big] == [10]  # the first request's flush size always goes
    backlog = state("backlog", pending_frames=10)
    backlog.pending = backlog.pending * 3  # three 10-frame chunks waiting
    prefix = Scheduler(max_slots=8, vocoder_frames=25).vocoder_piece([backlog])
    assert [w.num_frames for w in prefix] == [20]  # a prefix of whole chunks within the bound


def test_slot_order_is_realtime_first_within_the_batch_budget():
    sched = Scheduler(max_slots=4)  # batch may hold 3 slots
    batch = [state(f"b{i}", Priority.BATCH) for i in range(4)]
    realtime = state("r")
    order = sched.slot_order(batch + [realtime], free=4)
    assert [s.request_id for s in order] == ["r", "b0", "b1", "b2"]
