"""The scheduler: the requests in the engine, each with one explicit :class:`RequestStatus`, and
the policy of which waiting requests get a slot and which finished code frames the vocoder
decodes this step (vLLM's ``schedule()``; the executor runs what it picks).

A request's life, as the worker (core/worker.py) moves it through its stages:

    WAITING -> PREFILLING -> RUNNING -> VOCALIZING -> [ALIGNING] -> FINISHED
         (any of them) -> CANCELLED | FAILED

* WAITING: the pipeline prepared it (``Prepared``: its frames, prompt positions, live text); it
  waits here for a slot (it counts in the queue depth). This is the only queue of waiting requests:
  the pipeline keeps none and starts what ``slot_order`` picks.
* PREFILLING: it holds a slot, no frame of it produced yet (the talker prefills its prompt).
* RUNNING: the pipeline produces its frames (a DiT request between two chunks waits for a slot
  again, still running).
* VOCALIZING: the pipeline produced its last frames; the vocoder decodes the rest.
* ALIGNING: all its audio is delivered; its final chunk waits for its word times (core/aligning.py).
The scheduler holds the requests in flight (WAITING to VOCALIZING: their ids are the pipeline's
and the vocoder's keys) and, apart, those ALIGNING (the pipeline and vocoder have forgotten them).

* Slots: realtime first; batch work (jobs, non-streamed calls) holds at most
  ``batch_slot_limit`` slots, so a realtime arrival always finds one within a chunk's lifetime.
* Fairness among tenants (``SynthesisRequest.tenant``: an API key or a client address):
  within a class the tenant holding the fewest slots goes first (first come first served
  between equals), and a tenant that already holds a slot never takes the last
  ``newcomer_slots`` free ones - they are kept for a tenant holding none, so a client
  with many streams cannot make another wait for one of them to finish. Requests without
  a tenant (direct engine use) are plain first come first served.
* Running streams before new ones, past capacity: on a device past capacity (steps over half real
  time for ~20 steps on end), while a realtime stream already playing would run dry before its
  next chunk is made and delivered (its lead under (frames still to make + CHUNK_OVERHEAD_STEPS)
  steps of the measured period: ``streams_at_risk``), no new request starts: a new row and its
  prompt's prefill would lengthen the very steps that stream waits for. The newcomers wait in the
  queue (its bound refuses more: EngineOverloaded, a 429 with Retry-After) and start together once
  the streams are ahead again (one prefill call for them all), each with the pipeline's first-chunk
  size rather than one frame: a lead to ride out a loaded device's jitter. First audio grows with
  the load instead of every stream underrunning. Below half real time every stream gains lead with
  each step: nothing is held.
* First audio first: while a realtime request generates its first chunk, streams with more
  than ``ahead_seconds`` of audio in their listener's hands take no new slot and no vocoder
  time (they lose nothing: their listener is that far ahead). Their work waits for one
  first chunk only, so the newcomer's chunk runs on a device that is not busy with audio
  nobody needs yet - a client with many streams cannot multiply others' time to first audio.
* Live text: a request whose text is still arriving (``Prepared.text``) waits until its gate is
  ready (its first text unit committed, or its text complete) and is started only then.
* KV blocks: a free row is admissible only while the pipeline's KV pool can give the longest
  waiting prompt (``Prepared.prompt_positions``, held here) its blocks plus one block of growth,
  after one block of growth per row already decoding (the others wait in the engine's queue; a
  free row that waits is counted).
* Prefill tokens: at most ``prefill_token_budget`` prompt positions per step, in all; queued
  prompts prefill oldest first, each as much as the budget has left (a long prompt takes
  several steps), so an arriving request never stalls the streams already speaking. The
  pipeline reports what its prompts have left and prefills what the plan says.
* First audio fast: a stream's first chunk is one frame (``LEAD_SCHEDULE[0]``; a request's own
  ``initial_codec_chunk_frames`` wins), whatever the load (one held past capacity aside, above), so its first audio is one prefill and
  one step away; it goes to the vocoder the step it is made (its deadline, the submission, is
  the earliest there is) and the worker delivers it as soon as its PCM lands (worker.py).
* Chunk sizes by buffered lead: while steps take under half real time, each later chunk is the
  largest of ``LEAD_SCHEDULE`` (1, 2, 4, 8, 12 frames) that the stream's lead - the audio its
  listener holds beyond now - covers while it is made, vocoded and delivered ((n +
  CHUNK_OVERHEAD_STEPS) steps of the measured period), and never longer than all the audio before
  it nor the pipeline's longest chunk (``flush_frames``, from the pipeline's ``Chunking``). A stream with a short lead gets short chunks (no underrun);
  one far ahead gets long ones (fewer decoder calls). On a loaded device a stream's chunks grow so
  only up to the pipeline's first-chunk size (4 frames on the talker) and then stay there: few chunk
  lengths, few decoder calls, and its one-frame start is bridged without a gap.
  The step period counts only back-to-back steps: a turn without a step (the engine idle
  between requests) starts the measure again, so an idle gap never looks like a slow device.
* Vocoder: one bounded piece per step, taken by earliest playback deadline - the moment a
  listener runs out of audio - so a burst of finished chunks from many streams never holds
  up the next generation step by more than one piece. The bound is ``vocoder_frames`` code
  frames, raised to ``keep_up`` x the average frames produced per step, so that sustained
  production above the floor (a talker with hundreds of rows) never builds an endless backlog.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from engines.contract import Deliver, Priority, RequestHandle, SynthesisRequest
from engines.pipelines.base import Capacity, Chunking, Prepared, Produced, StepPlan

FRAME_SECONDS = 0.08  # one code frame of audio (12.5 Hz codec)
# A chunk of n frames takes n steps to make plus about this many more for its vocoding, delivery
# and jitter: a stream may wait for n frames only while its listener's lead covers that.
CHUNK_OVERHEAD_STEPS = 1.5
# Chunk sizes a stream grows through as its lead allows (frames; nari-qwen3-tts's ``ttfa`` profile):
# the first is the first chunk's, the last the talker's longest (its ``chunk_frames``).
LEAD_SCHEDULE = (1, 2, 4, 8, 12)
# On a loaded device a stream's chunks grow by its lead from one frame to the pipeline's first-chunk
# size over its first this-many such chunks' worth of frames, then stay there (few chunk lengths).
RAMP_CHUNKS = 2
DEFAULT_PREFILL_TOKEN_BUDGET = 512  # prompt positions prefilled per step (the service's --prefill-token-budget)
# On a GPU a prefill call is launch bound: on the H200 (benchmarks/costs/h200-0.6b.json) 16 prompts
# of 256 positions cost what one of 16 does (27-29 ms), so a burst of arrivals prefills in one call.
DEFAULT_PREFILL_TOKEN_BUDGET_GPU = 4096


class RequestStatus(Enum):
    """Where a request is in its life (this module's docstring)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    VOCALIZING = "vocalizing"
    ALIGNING = "aligning"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def in_flight(self) -> bool:
        """The pipeline or the vocoder still holds state of it (under its request id)."""
        return self in IN_FLIGHT

    @property
    def generating(self) -> bool:
        """It holds a slot or is between slots: the pipeline has frames of it to make."""
        return self in (RequestStatus.PREFILLING, RequestStatus.RUNNING)

    @property
    def done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED)


IN_FLIGHT = frozenset({RequestStatus.WAITING, RequestStatus.PREFILLING, RequestStatus.RUNNING,
                       RequestStatus.VOCALIZING})


@dataclass
class RequestState:
    """One admitted request, as the core tracks it."""

    handle: RequestHandle
    deliver: Deliver
    frames_total: int = 0
    status: RequestStatus = RequestStatus.WAITING
    frames_done: int = 0  # frames handed to the vocoder (their audio is delivered or on its way)
    delivered: int = 0  # chunks delivered
    first_audio_at: float | None = None  # first audio handed to the outbox: playback starts
    truncated: str | None = None  # the pipeline cut it before its natural end: why (AudioChunk.truncated)
    pending: list[Produced] = field(default_factory=list)  # produced, not yet vocoded
    kept_audio: Any = None  # core/aligning.py KeptAudio: its audio, kept for word times (None: not asked)
    prepared: Prepared | None = None  # what the pipeline prepared (set when it is WAITING)
    units_started: int = 0  # slot units the pipeline was handed (Prepared.units in all)
    holds_slot: bool = False  # a unit of it is in a slot now
    held: bool = False  # it waited for the running streams (past capacity: ``streams_at_risk``)

    @property
    def request(self) -> SynthesisRequest:
        return self.handle.request

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    @property
    def text_arriving(self) -> bool:
        """Its text is still arriving (a live utterance before its text is complete)."""
        gate = self.prepared.text if self.prepared is not None else None
        return gate is not None and not gate.done

    def wants_slot(self) -> bool:
        """It has a unit of work for a slot and none in one; a live utterance once its text lets it start."""
        if self.holds_slot or self.prepared is None or self.units_started >= self.prepared.units:
            return False
        if self.status is RequestStatus.WAITING:
            gate = self.prepared.text
            return gate is None or gate.pull() or gate.ready
        return self.status is RequestStatus.RUNNING  # the next unit of a request between two (the DiT's chunks)


@dataclass(frozen=True)
class VocoderWork:
    """A request's gathered frames, taken for this step's vocoder piece."""

    state: RequestState
    frames: list[Produced]

    @property
    def num_frames(self) -> int:
        return sum(p.num_frames for p in self.frames)


class Scheduler:
    def __init__(self, max_slots: int, batch_slot_share: float = 0.75, vocoder_frames: int = 128,
                 keep_up: float = 2.0, newcomer_slots: int = 1, ahead_seconds: float = 1.0,
                 prefill_token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET,
                 clock: Callable[[], float] = time.monotonic, align_frames: int = 1,
                 chunking: Chunking = Chunking()):
        """``align_frames``: chunks of at least this many frames end on a multiple of it (a codec
        decoder on fixed windows of that size: engines/pipelines/vocoder.py; 1: anywhere).
        ``chunking``: the pipeline's chunk lengths (its first chunk on a loaded device, its longest)."""
        if vocoder_frames < 1:
            raise ValueError(f"vocoder_frames must be >= 1, got {vocoder_frames}")
        if prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be >= 1, got {prefill_token_budget}")
        # Batch work may hold at most this share of the slots, so realtime arrivals always find one.
        self.batch_slot_limit = max(1, int(max_slots * batch_slot_share))
        self.vocoder_frames = vocoder_frames
        self.keep_up = keep_up
        self.align_frames = align_frames
        self.chunking = chunking
        # Free slots a tenant already holding one may not take (kept for a newcomer); never
        # more than a quarter of the slots, so one tenant alone keeps most of the device.
        self.newcomer_slots = min(newcomer_slots, max_slots // 4)
        self.ahead_seconds = ahead_seconds
        self.prefill_token_budget = prefill_token_budget  # prompt positions one step may prefill in all
        self.clock = clock  # the time deadlines and leads are read on (the worker stamps first audio with it)
        self._rate = 0.0  # frames produced per generation step, moving average
        self.step_period = 0.0  # seconds between generation steps while busy, moving average
        # the same over ~20 steps: a load that lasts (``past_capacity``), not one slow step's spike
        self.sustained_period = 0.0
        self._last_step: float | None = None
        self.requests: OrderedDict[str, RequestState] = OrderedDict()  # in flight, in admission order
        self.aligning: list[RequestState] = []  # ALIGNING, in the order their audio completed

    # ------------------------------------------------------------ the requests and their status
    def in_flight(self) -> list[RequestState]:
        return list(self.requests.values())

    def add(self, state: RequestState, prepared: Prepared) -> None:
        """A prepared request: WAITING for a slot."""
        state.status = RequestStatus.WAITING
        state.prepared = prepared
        state.frames_total = prepared.frames
        self.requests[state.request_id] = state

    def started(self, state: RequestState) -> bool:
        """A unit of it took a slot; True the first time (it leaves the queue: PREFILLING)."""
        state.holds_slot = True
        state.units_started += 1
        if state.status is not RequestStatus.WAITING:
            return False
        state.status = RequestStatus.PREFILLING
        return True

    @staticmethod
    def produced(state: RequestState, p: Produced) -> None:
        """The pipeline produced frames of it: RUNNING, VOCALIZING after its last."""
        state.pending.append(p)
        state.truncated = state.truncated or p.truncated
        if p.frees_slot:
            state.holds_slot = False
        if p.is_last:
            state.status = RequestStatus.VOCALIZING
        elif state.status is RequestStatus.PREFILLING:
            state.status = RequestStatus.RUNNING

    def align(self, state: RequestState) -> None:
        """All its audio is delivered: it leaves the requests in flight and waits for its word times."""
        del self.requests[state.request_id]
        state.status = RequestStatus.ALIGNING
        self.aligning.append(state)

    def end(self, state: RequestState, error: str | None) -> RequestStatus | None:
        """It leaves the engine: FINISHED without ``error``, CANCELLED or FAILED. Returns the status
        it had, None when it had already ended (or another request holds its id)."""
        was = state.status
        if was.in_flight:
            if self.requests.get(state.request_id) is not state:
                return None
            del self.requests[state.request_id]
        elif was is RequestStatus.ALIGNING:
            self.aligning.remove(state)
        else:
            return None
        state.status = (RequestStatus.FINISHED if error is None else
                        RequestStatus.CANCELLED if error == "cancelled" else RequestStatus.FAILED)
        state.kept_audio = None  # (its audio may be long)
        return was

    def observe(self, frames_produced: int, now: float | None = None) -> None:
        """One generation step produced this many frames (``now``: when, for the step period)."""
        self._rate += 0.1 * (frames_produced - self._rate)
        now = self.clock() if now is None else now
        if self._last_step is not None and now - self._last_step < 1.0:  # (a stalled host is no step either)
            self.step_period += 0.2 * (now - self._last_step - self.step_period)
            self.sustained_period += 0.05 * (now - self._last_step - self.sustained_period)
        self._last_step = now

    def no_step(self) -> None:
        """A loop turn ran no generation step (nothing in a slot): the next step's interval would
        measure the idle gap, not the device, so the step period's measure starts again there."""
        self._last_step = None

    @property
    def room_to_grow(self) -> bool:
        """Steps under half real time: the device has room. Above it (a loaded device) chunks stay
        the pipeline's first-chunk size: small chunks by a short lead would multiply the codec calls
        (one call per chunk length, ~4 ms each on an H100 whatever its rows) and the load with them,
        and equal chunks of many streams spread the vocoder's work evenly over the steps."""
        return self.step_period <= FRAME_SECONDS / 2

    @property
    def past_capacity(self) -> bool:
        """Steps over half real time for ~20 steps on end: the device no longer gains every stream
        lead with each step, and a new row would make the running streams' steps longer still. (A
        load that comes and goes - a burst of prefills, a slow vocoder piece - is not past it.)"""
        return self.sustained_period > FRAME_SECONDS / 2

    @property
    def piece_frames(self) -> int:
        """This step's bound on a vocoder piece, in code frames."""
        return max(self.vocoder_frames, math.ceil(self.keep_up * self._rate))

    def waiting_blocks(self, capacity: Capacity) -> int:
        """KV blocks the longest prompt waiting for a slot needs (0: none waits, or no KV pool)."""
        longest = max((s.prepared.prompt_positions for s in self.requests.values()
                       if s.status is RequestStatus.WAITING and s.prepared is not None), default=0)
        return capacity.blocks_for(longest)

    @staticmethod
    def admissible(capacity: Capacity, waiting_blocks: int = 0) -> int:
        """Rows that may be filled now: the free rows, as many as the KV pool can give the
        longest waiting prompt (``waiting_blocks``) plus one block of growth each, after the
        decoding rows' growth."""
        rows = capacity.free_rows
        if not rows or not waiting_blocks:
            return rows
        spare = capacity.free_blocks - capacity.growth_blocks
        return max(0, min(rows, spare // (waiting_blocks + 1)))

    def free_slots(self, capacity: Capacity) -> int:
        """Slots the waiting requests may take now (the KV rule above)."""
        return self.admissible(capacity, self.waiting_blocks(capacity))

    @staticmethod
    def prefill_tokens(waiting: tuple[int, ...], budget: int) -> tuple[int, ...]:
        """Positions each queued prompt (oldest first, ``waiting`` positions left each) prefills
        this step: each takes what the budget has left, until it is spent."""
        takes = []
        for left in waiting:
            take = min(left, budget)
            if take <= 0:
                break
            takes.append(take)
            budget -= take
        return tuple(takes)

    def step_plan(self, capacity: Capacity) -> StepPlan:
        """This step's prefill positions per queued prompt (``prefill_token_budget`` in all), and
        whether a free row waits for blocks."""
        waiting_blocks = self.waiting_blocks(capacity)
        kv_wait = bool(capacity.free_rows and waiting_blocks and not self.admissible(capacity, waiting_blocks))
        return StepPlan(self.prefill_tokens(capacity.prefill_waiting, self.prefill_token_budget), kv_wait)

    def slot_order(self, states: list[RequestState], free: int) -> list[RequestState]:
        """The waiting requests to start now, in order (at most ``free``), under the batch
        budget and the tenant rules in this module's docstring."""
        if free <= 0:
            return []
        waiting = [s for s in states if not s.handle.paused and s.wants_slot()]
        if any(s.status is RequestStatus.WAITING for s in waiting) and self.streams_at_risk(states):
            for s in waiting:
                s.held = s.held or s.status is RequestStatus.WAITING
            waiting = [s for s in waiting if s.status is not RequestStatus.WAITING]  # a started one's next unit goes
        if waiting and self._first_audio_pending(states):
            now = self.clock()
            waiting = [s for s in waiting if not self._far_ahead(s, now)]
        if not waiting:
            return []
        in_slot = [s for s in states if s.holds_slot]
        batch_busy = sum(1 for s in in_slot if s.request.priority == Priority.BATCH)
        held = Counter(s.request.tenant for s in in_slot)
        # FIFO within a class: the list is in admission order, and a stable sort keeps it.
        waiting.sort(key=lambda s: s.request.priority != Priority.REALTIME)
        chosen: list[RequestState] = []
        while waiting and len(chosen) < free:
            pick = self._next_fair(waiting, held, free - len(chosen), batch_busy)
            if pick is None:
                break
            waiting.remove(pick)
            chosen.append(pick)
            held[pick.request.tenant] += 1
            batch_busy += pick.request.priority == Priority.BATCH
        return chosen

    def _next_fair(self, waiting: list[RequestState], held: Counter, free_left: int,
                   batch_busy: int) -> RequestState | None:
        """The next request to start: the first class with an eligible request, in it the
        least-served tenant's oldest. ``None`` when nothing may start now."""
        best: RequestState | None = None
        for s in waiting:
            request = s.request
            if request.priority == Priority.BATCH and batch_busy >= self.batch_slot_limit:
                continue
            tenant_holds = held[request.tenant] if request.tenant else 0
            if tenant_holds and free_left <= self.newcomer_slots:
                continue  # the last free slots wait for a tenant holding none
            if best is not None and best.request.priority != request.priority:
                break  # realtime before batch: a lower class waits while a higher one may start
            if best is None or tenant_holds < (held[best.request.tenant] if best.request.tenant else 0):
                best = s
        return best

    def streams_at_risk(self, states: list[RequestState], now: float | None = None) -> bool:
        """The device is past capacity for what runs on it (this module's docstring): steps over half
        real time for a while, and a realtime stream that is playing (its text complete, its
        listener not pausing it, its first chunk's worth of frames - the pipeline's first-chunk size
        - handed over) would run dry before its next chunk is made and delivered. A stream younger
        than that is not counted: its lead is short by design (a one-frame start) and grows with
        every step under real time; counting it held newcomers at loads the device carries (20
        req/s on the H100 table: p50 first audio +5-9 ms, p95 x2, benchmarks/RESULTS.md)."""
        if not self.past_capacity:
            return False
        now = self.clock() if now is None else now
        for s in states:
            if (s.status is not RequestStatus.RUNNING or s.first_audio_at is None
                    or s.frames_done < self.chunking.first_frames or s.handle.paused or s.handle.cancelled or s.request.priority != Priority.REALTIME
                    or s.text_arriving):
                continue
            to_make = max(0, self.flush_size(s, now) - sum(p.num_frames for p in s.pending))
            if self.playback_deadline(s) - now < (to_make + CHUNK_OVERHEAD_STEPS) * self.step_period:
                return True
        return False

    def first_audio_waiting(self) -> bool:
        """A realtime request in flight has not had its first audio delivered yet (generated,
        vocoded or not): word alignment, which holds the engine thread, waits for it."""
        return any(s.delivered == 0 and s.request.priority == Priority.REALTIME and not s.handle.cancelled
                   for s in self.requests.values())

    @staticmethod
    def _first_audio_pending(states: list[RequestState]) -> bool:
        """A realtime request is still generating its first chunk (once its frames exist it
        leads the vocoder's deadline order anyway, and generation need not wait)."""
        return any(s.frames_done == 0 and not s.pending and s.request.priority == Priority.REALTIME
                   and not s.handle.cancelled for s in states)

    def _far_ahead(self, state: RequestState, now: float) -> bool:
        """The request's listener holds more than ``ahead_seconds`` of audio not yet played."""
        return state.first_audio_at is not None and self.playback_deadline(state) - now > self.ahead_seconds

    @staticmethod
    def playback_deadline(state: RequestState) -> float:
        """When the request's listener runs out of audio: before first audio its submission
        time (it is already waiting), then first audio + the audio handed over so far."""
        if state.first_audio_at is None:
            return state.handle.submitted_at
        return state.first_audio_at + state.frames_done * FRAME_SECONDS

    def ready(self, state: RequestState) -> bool:
        """The request has gathered enough frames to vocode (all of them once the pipeline is done with it)."""
        if state.handle.paused or not state.pending:
            return False  # back-pressure: hold the (small) codes, not the PCM
        gathered = sum(p.num_frames for p in state.pending)
        return state.status is RequestStatus.VOCALIZING or gathered >= self.flush_size(state)

    def flush_frames(self, frames_emitted: int) -> int:
        """The pipeline's chunk after ``frames_emitted`` frames: its first-chunk size first, then as
        long as all the audio before it, up to its longest (``Chunking``). A chunk is made while the
        audio already handed over plays, which holds at any load under real time; a fixed long
        second chunk after a short first one would underrun far sooner."""
        if frames_emitted == 0:
            return self.chunking.first_frames
        return min(self.chunking.longest_frames, frames_emitted)

    def flush_size(self, state: RequestState, now: float | None = None) -> int:
        """Frames to gather before the request's next vocoder piece (this module's docstring):
        * the first audio: the request's own ``initial_codec_chunk_frames`` when it set one, else
          one frame (first audio one step after the prompt, at any load);
        * then, while the device has room (``room_to_grow``), the largest of ``LEAD_SCHEDULE`` that
          the stream's lead covers while the chunk is made and delivered, no longer than the
          pipeline's next chunk (``flush_need``: as long as all the audio before it; a live
          utterance's first-chunk size while its text arrives); on a loaded device the same up to
          the pipeline's first-chunk size while a stream ramps up, then that size for every stream
          alike."""
        flush_frames = self.flush_frames
        if state.frames_done == 0:
            first = state.request.initial_codec_chunk_frames
            if first is None and state.held and not self.room_to_grow:
                first = self.chunking.first_frames  # it starts on a device past capacity: a lead to ride out its jitter
            return first if first is not None else LEAD_SCHEDULE[0]
        largest = flush_need(state, flush_frames)
        if not self.room_to_grow:  # a loaded device: the pipeline's first-chunk size, once a stream has ramped up
            uniform = flush_frames(0)
            if state.frames_done >= RAMP_CHUNKS * uniform:
                return self._aligned(state, min(largest, uniform))
            largest = min(largest, uniform)  # its one-frame start grows to it by its lead
        lead = self.playback_deadline(state) - (self.clock() if now is None else now)
        size = LEAD_SCHEDULE[0]
        for n in LEAD_SCHEDULE[1:]:
            if n > largest or lead < (n + CHUNK_OVERHEAD_STEPS) * self.step_period:
                break
            size = n
        return self._aligned(state, size)

    def _aligned(self, state: RequestState, size: int) -> int:
        """``size`` grown to end on a multiple of ``align_frames`` when it is that long: a decoder on
        fixed windows then decodes no window twice."""
        if size >= self.align_frames > 1:
            size += -(state.frames_done + size) % self.align_frames
        return size

    def vocoder_piece(self, states: list[RequestState]) -> list[VocoderWork]:
        """This step's bounded vocoder piece: ready requests by earliest playback deadline (realtime
        before batch), each a prefix of its gathered frames, at most ``piece_frames`` in all.
        A request's prefix reaches at least its flush size; the piece's first one always goes."""
        ready = [s for s in states if self.ready(s)]
        if ready and self._first_audio_pending(states):
            now = self.clock()
            ready = [s for s in ready if not self._far_ahead(s, now)]
        ready.sort(key=lambda s: (s.request.priority != Priority.REALTIME, self.playback_deadline(s)))
        bound = self.piece_frames
        piece: list[VocoderWork] = []
        frames = 0
        for s in ready:
            need, take, n = self.flush_size(s), [], 0
            for p in s.pending:
                if n >= need and frames + n + p.num_frames > bound:
                    break
                take.append(p)
                n += p.num_frames
            if piece and frames + n > bound:
                continue  # a smaller one later in deadline order may still fit
            piece.append(VocoderWork(s, take))
            frames += n
        return piece


def live_text_arriving(state: RequestState) -> bool:
    feed = state.request.text_feed
    return feed is not None and not feed.finished


def flush_need(state: RequestState, flush_frames: Callable[[int], int]) -> int:
    """The pipeline's chunk for the request's next audio. A live utterance whose text is still
    arriving keeps the first-chunk size: its row often waits for text, and frames held back for a
    full chunk while it waits would be silence the listener hears. Once its text is complete its
    chunks grow as any other's (fewer, larger vocoder calls)."""
    return flush_frames(0 if live_text_arriving(state) else state.frames_done)
