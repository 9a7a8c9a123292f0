"""The dedicated thread that owns the device: the engine core's loop.

One loop iteration (``step``), vLLM-style: schedule -> execute -> update from output:
  1. deliver the audio whose host copy has completed (core/outbox.py);
  2. take new requests from the thread-safe inbox and let the pipeline prepare them
     (DiT: text -> clauses -> encoder states -> durations -> chunk layout);
  3. drop cancelled requests (their slots are freed before the forward);
  4. fill free slots with what the scheduler picks (core/scheduler.py: realtime first,
     batch slot budget);
  5. one generation step of the pipeline (core/executor.py) -> code frames;
  6. one bounded vocoder piece, by earliest playback deadline -> PCM into the outbox (on a
     CPU, ``vocoder_thread``: the pieces decode on their own thread and cores while the next
     ticks run; this stage collects those done and hands over the next);
  7. with an aligner, one bounded batch of word alignments of requests whose audio is all
     delivered, only while no realtime request waits for its first audio (core/aligning.py).
Each request's status (core/scheduler.py ``RequestStatus``) moves with these stages; the
scheduler holds the requests. The thread sleeps on the inbox when nothing is active. Failures
are per request: an exception while preparing, starting or vocoding one request fails only it.

(~500 lines: the thread's lifecycle, the inbox and the per-request failure paths belong
together; policy and the requests, execution, delivery and alignment live in
scheduler/executor/outbox/aligning.)
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from engines.contract import (
    Deliver,
    EngineOverloaded,
    Priority,
    RequestHandle,
    SynthesisRequest,
    TickReport,
)
from engines.core.aligning import Aligning
from engines.core.executor import Executor, own_threads
from engines.core.host_memory import IdleTrim
from engines.core.outbox import Outbox, deliver_final, emit_audio
from engines.core.scheduler import (
    DEFAULT_PREFILL_TOKEN_BUDGET,
    RequestState,
    RequestStatus,
    Scheduler,
    VocoderWork,
)
from engines.hardware.cpu_features import ThreadPlan
from engines.pipelines.base import Pipeline, Prepared
from engines.pipelines.vocoder import WINDOW_FRAMES, VocalizeItem, Vocalizer

log = logging.getLogger("streamvox.worker")


FaultHook = Callable[[str, str], None]
"""``hook(request_id, stage)`` called at each per-request stage ("plan", "admit",
"vocalize", "align"); raising from it simulates a failure inside that request, sleeping in it
a slow stage (fault tests)."""


STAGES = ("deliver", "plan", "admit", "tick", "vocalize", "align")  # worker loop stages, in loop order
# Vocoder pieces handed to the vocoder thread and not yet collected, at most: the talker runs ahead
# of a slower decoder by this much, no more (the frames wait as codes, not PCM).
PIECES_IN_FLIGHT = 2


# A realtime stream's first chunks, delivered as soon as their PCM lands (worker ``_deliver``): its
# listener holds one frame of audio after the first, and little more until these have played.
EARLY_CHUNKS = 4


def first_chunk(entry) -> bool:
    """An outbox entry that is a realtime request's first audio (delivered first, worker ``_deliver``)."""
    active = entry[0]
    return active.delivered == 0 and active.request.priority == Priority.REALTIME


def early_chunk(entry) -> bool:
    """One of a realtime request's first ``EARLY_CHUNKS`` chunks: its lead is still short."""
    active = entry[0]
    return active.delivered < EARLY_CHUNKS and active.request.priority == Priority.REALTIME


@dataclass(frozen=True)
class WorkerConfig:
    """The worker's queue, slots and budgets (the engine fills it from its EngineConfig)."""

    max_slots: int
    max_queue: int = 64  # requests submitted and not yet started; more: EngineOverloaded
    batch_slot_share: float = 0.75  # the share of the slots batch work may hold (scheduler.py)
    batch_planning: bool = False  # prepare the requests taken in one iteration together (see __init__)
    vocoder_frames: int = 128  # frames one vocoder piece decodes at most
    vocoder_keep_up: float = 2.0  # scheduler.py ``keep_up``
    prefill_token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET  # prompt positions one step prefills in all
    stage_sync: bool = False  # synchronise the device at each stage's end (stage_seconds; slower)
    threads: ThreadPlan | None = None  # CPU: the talker's and the codec decoder's threads


class Worker:
    """Owns the models and the device; everything here runs on one thread."""

    def __init__(self, pipeline: Pipeline, vocalizer: Vocalizer, config: WorkerConfig, aligner=None,
                 fault_hook: FaultHook | None = None, host_copy_event: Callable[[], object] | None = None,
                 trace: list | None = None, name: str = "streamvox-worker"):
        """``config``: the queue, slots and budgets (:class:`WorkerConfig`). ``aligner``: word
        timestamps (an engines.pipelines.aligner.Aligner). ``fault_hook``: tests inject failures.
        ``host_copy_event``: a virtual device's event for PCM on the host. ``trace``: executor spans."""
        self.pipeline = pipeline
        self.vocalizer = vocalizer
        self.max_queue = config.max_queue
        self.scheduler = Scheduler(config.max_slots, config.batch_slot_share, config.vocoder_frames,
                                   config.vocoder_keep_up, prefill_token_budget=config.prefill_token_budget,
                                   chunking=pipeline.chunking,
                                   align_frames=WINDOW_FRAMES if getattr(vocalizer, "windowed", False) else 1)  # (test fakes: none)
        threads = config.threads
        # CPU (``threads``): the codec decoder on a thread and cores of its own beside the talker
        # (executor.py); the worker thread keeps the talker's threads (set when it starts, _run)
        self._talker_threads, vocoder_threads = (threads.talker, threads.codec) if threads is not None else (0, 0)
        self.executor = Executor(pipeline, vocalizer, trace, vocoder_threads=vocoder_threads,
                                 on_vocoded=lambda: self._wake.set())
        self.fault_hook = fault_hook
        self._inbox: queue.Queue[tuple[RequestHandle, Deliver]] = queue.Queue()
        self._listeners: list[Callable[[TickReport], None]] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._pending = 0  # requests submitted but not yet started (queue depth)
        self._pending_lock = threading.Lock()
        self._admitting: list[tuple[RequestHandle, Deliver]] = []  # taken from the inbox, not yet prepared
        # Plan all requests taken from the inbox in one loop iteration together (one encoder
        # forward), when the pipeline can: a win where per-request launch overhead dominates
        # (CUDA). Results then depend on the batch at the fp32 rounding level, hence a switch.
        self.batch_planning = config.batch_planning
        # vocoded audio not yet delivered, oldest first; ``host_copy_event``: a virtual device's
        # event for PCM already on the host (engines/virtual/), else CUDA events or none
        self._outbox = Outbox(host_copy_event=host_copy_event)
        # Word timestamps (an engines.pipelines.aligner.Aligner): the stage that keeps the audio
        # of requests that asked for them and aligns them once it is all delivered.
        self.aligning = Aligning(aligner) if aligner is not None else None
        self.ticks = 0
        self.error: str | None = None
        # Wall seconds spent per loop stage (plan, admit, tick, vocalize), for benchmarks and
        # profiling. ``stage_sync`` synchronises the device at each stage's end so
        # asynchronous GPU work is charged to the stage that issued it (slows the loop).
        # ``decode`` (stage_seconds()) is the decoder's own time, on whichever thread it ran: with
        # a vocoder thread the vocalize stage is only the worker's wait for it.
        self.stage_seconds: defaultdict[str, float] = defaultdict(float)
        for stage in STAGES:  # every key exists up front: readers on other threads copy the dict
            self.stage_seconds[stage] = 0.0
        self._stage_sync = config.stage_sync and torch.cuda.is_available()
        self.trim = IdleTrim()  # free heap pages back to the kernel once idle after work

    # ----------------------------------------------------------------- any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None  # a dying thread is not alive

    def add_tick_listener(self, listener: Callable[[TickReport], None]) -> None:
        self._listeners.append(listener)

    def wake(self) -> None:
        """Any thread: something changed for an active request (live text arrived)."""
        self._wake.set()

    def enqueue(self, request: SynthesisRequest, deliver: Deliver) -> RequestHandle:
        with self._pending_lock:
            if self._pending >= self.max_queue:
                raise EngineOverloaded(f"admission queue is full ({self.max_queue} waiting)", retry_after_s=1.0)
            self._pending += 1
        handle = RequestHandle(request)
        self._inbox.put((handle, deliver))
        self._wake.set()
        return handle

    @property
    def idle(self) -> bool:
        """Nothing in flight: no request queued, being prepared, in flight or aligning."""
        return not (self.scheduler.requests or self.scheduler.aligning or self._admitting or self._inbox.qsize()
                    or self.executor.vocoding)

    def stage_seconds_now(self) -> dict[str, float]:
        """Any thread: a copy of the loop stages' seconds, with the decoder's own (``decode``)."""
        return {**self.stage_seconds, "decode": self.executor.decode_seconds}

    @property
    def queue_depth(self) -> int:
        return self._pending

    @property
    def active_requests(self) -> int:
        return len(self.scheduler.requests)

    # ------------------------------------------------------------- worker thread
    def _run(self) -> None:
        if self._talker_threads:
            own_threads(self._talker_threads)  # the vocoder thread has the other cores
        with torch.no_grad():  # grad mode is per thread
            self._loop()

    @contextmanager
    def _stage(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._stage_sync:
                torch.cuda.synchronize()
            self.stage_seconds[name] += time.perf_counter() - t0

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self.step():
                    self.trim.worked()
                else:
                    if self.idle:
                        self.trim.idle()
                    self._wake.wait(0.05 if self.scheduler.requests else 0.5)
                    self._wake.clear()
        except BaseException as exc:  # the worker itself died: report, fail everyone
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("worker thread died")
            self.executor.shutdown()  # its piece is dropped: every request in flight fails below
            for handle, deliver in self._admitting:  # taken from the inbox, not yet active
                self._release_pending()
                deliver_final(handle, deliver, 0, 0, 0, "engine_failure")
            self._admitting = []
            for active in self.scheduler.in_flight():
                self._finish(active, error="engine_failure")
            raise
        finally:
            try:
                self._deliver(wait=True)  # audio already made is not lost on stop
            except Exception:
                log.exception("delivering the last audio failed")
            self.executor.shutdown()
            for active in self.scheduler.in_flight():
                self._finish(active, error="engine_stopped")
            for state in list(self.scheduler.aligning):  # their audio is complete: they end without word times
                self._end_aligning(state, None)
            self._fail_inbox("engine_stopped")

    def step(self) -> bool:
        """One loop iteration; False when there was nothing to do (the loop then sleeps)."""
        generating = self.pipeline.active_slots > 0
        with self._stage("deliver"):  # with room, a first chunk is waited for before this turn's launches
            self._deliver(wait=not generating and not self._vocoder_ready(),
                          urgent=first_chunk if self.scheduler.room_to_grow else None)
        self._drop_cancelled()  # before admission: a cancelled request leaves its slot and decoder first
        with self._stage("plan"):
            self._admit_new()
        self._drop_cancelled()
        with self._stage("admit"):
            self._fill_slots()
        t0 = time.perf_counter()
        rows = frames = None
        if self.pipeline.active_slots > 0:
            try:
                rows, frames = self._generate()
            except Exception as exc:  # e.g. CUDA out of memory in the batched forward
                self._fail_tick(exc)
            with self._stage("deliver"):  # and a stream's early chunks here, while the step just queued runs
                self._deliver(urgent=early_chunk)
        else:
            self.scheduler.no_step()
        with self._stage("vocalize"):
            vocoded = self._vocode()
        with self._stage("align"):
            aligned = self._align()
        if rows is not None:
            self._report(TickReport(batch_rows=rows, seconds=time.perf_counter() - t0))
        # rows == 0 with no frames: every utterance waits for live text; sleep until woken
        stepped = rows is not None and (rows > 0 or bool(frames))
        return stepped or vocoded or aligned or len(self._outbox) > 0

    def _fail_tick(self, exc: Exception) -> None:
        """A batched step failed: the requests whose work was in it fail, the server lives on.

        A batched forward cannot say which row caused it, so every request holding a slot
        in that tick ends with an error (their slots are freed, so the pipeline's state is
        consistent again); requests still waiting for a slot are untouched."""
        log.error("tick failed (%s: %s); failing the requests in it", type(exc).__name__, exc)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give an out-of-memory the best chance on the next tick
        for active in self.scheduler.in_flight():
            if active.holds_slot:
                self._finish(active, error=f"engine_failure: {type(exc).__name__}: {exc}")

    def _fail_inbox(self, reason: str) -> None:
        while True:
            try:
                handle, deliver = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._release_pending()
            deliver_final(handle, deliver, 0, 0, 0, reason)

    def _release_pending(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    def _admit_new(self) -> None:
        while True:
            try:
                self._admitting.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if not self._admitting:
            return
        if self.batch_planning and len(self._admitting) > 1:
            self._admit_batch()
        while self._admitting:
            handle, deliver = self._admitting[0]
            self._admit_one(handle, deliver)
            self._admitting.pop(0)

    def _admit_batch(self) -> None:
        """Plan every request in ``_admitting`` with one ``pipeline.prepare_many``; each failure
        fails its request alone. If the batched call itself fails, the requests stay in
        ``_admitting`` and are planned one by one (which isolates the culprit). A request
        leaves ``_admitting`` the moment it is WAITING or finalised (the worker-death path
        fails whatever is still there)."""
        ready = []
        for handle, deliver in list(self._admitting):
            if handle.cancelled or any(h.request_id == handle.request_id for h, _ in ready):
                continue  # left for _admit_one, which reports it (or refuses the second of one id)
            if not self._id_free(handle, deliver):
                self._admitting.remove((handle, deliver))
                continue
            try:
                self._hook(handle.request_id, "plan")
                ready.append((handle, deliver))
            except Exception as exc:
                self._admitting.remove((handle, deliver))
                self._planning_failed(handle, deliver, exc)
        if not ready:
            return
        try:
            results = self.pipeline.prepare_many([h.request for h, _ in ready])
        except Exception as exc:
            log.warning("planning %d requests together failed (%s: %s); planning them one by one",
                        len(ready), type(exc).__name__, exc)
            return
        for (handle, deliver), result in zip(ready, results):
            self._admitting.remove((handle, deliver))
            if isinstance(result, Exception):
                self.pipeline.drop(handle.request_id)
                self._planning_failed(handle, deliver, result)
            else:
                self._admitted(RequestState(handle=handle, deliver=deliver), result)

    def _admit_one(self, handle: RequestHandle, deliver: Deliver) -> None:
        """Plan one request taken from the inbox; a planning error fails it alone."""
        if handle.cancelled:
            self._release_pending()
            deliver_final(handle, deliver, 0, 0, 0, "cancelled")
            return
        if not self._id_free(handle, deliver):
            return
        try:
            self._hook(handle.request_id, "plan")
            prepared = self.pipeline.prepare(handle.request)
        except Exception as exc:
            self.pipeline.drop(handle.request_id)
            self._planning_failed(handle, deliver, exc)
            return
        self._admitted(RequestState(handle=handle, deliver=deliver), prepared)

    def _admitted(self, state: RequestState, prepared: Prepared) -> None:
        """Prepared: WAITING for a slot (its audio kept for word times if it asked for them)."""
        self.scheduler.add(state, prepared)
        if self.aligning is not None:
            self.aligning.track(state)

    def _id_free(self, handle: RequestHandle, deliver: Deliver) -> bool:
        """Whether ``handle``'s id may be planned: the pipeline's and the vocoder's state are
        keyed by request id, so an earlier request of that id that is still in flight must leave
        first. A cancelled one is finished now (its slot and decoder state freed); a live one
        keeps its id and the newcomer is refused, never mixed into its state."""
        earlier = self.scheduler.requests.get(handle.request_id)
        if earlier is None:
            return True
        if earlier.handle.cancelled:
            self._finish(earlier, error="cancelled")
            return True
        log.warning("request %s refused: a request with this id is in flight", handle.request_id)
        self._release_pending()
        deliver_final(handle, deliver, 0, 0, 0, "duplicate request id: a request with this id is in flight")
        return False

    def _planning_failed(self, handle: RequestHandle, deliver: Deliver, exc: Exception) -> None:
        log.warning("request %s failed while planning: %s", handle.request_id, exc)
        self._release_pending()
        deliver_final(handle, deliver, 0, 0, 0, f"planning failed: {exc}")

    def _drop_cancelled(self) -> None:
        for active in self.scheduler.in_flight():
            if active.handle.cancelled:
                self._finish(active, error="cancelled")
        for state in [s for s in self.scheduler.aligning if s.handle.cancelled]:
            self._end_aligning(state, None, error="cancelled")

    def _fill_slots(self) -> None:
        for active in self.scheduler.slot_order(self.scheduler.in_flight(),
                                                self.scheduler.free_slots(self.pipeline.capacity())):
            self._collect_vocoded(wait=True)  # starting may prime the stream's decoder (in-context cloning)
            try:
                self._hook(active.request_id, "admit")
                self.pipeline.start(active.request_id, active.prepared)
            except Exception as exc:
                log.warning("request %s failed at slot admission: %s", active.request_id, exc)
                self._finish(active, error=f"admission failed: {exc}")
                continue
            if self.scheduler.started(active):
                self._release_pending()  # it left the queue

    def _generate(self) -> tuple[int, int]:
        """One generation step; its code frames join their requests' pending work."""
        with self._stage("tick"):
            produced = self.executor.generate(self.scheduler.step_plan(self.pipeline.capacity()))
        self.ticks += 1  # counted before delivery, so a reader woken by a chunk sees this tick
        rows = self.pipeline.last_batch_rows
        frames = 0
        for p in produced:
            active = self.scheduler.requests.get(p.request_id)
            if active is None:
                continue  # finished or cancelled meanwhile
            if p.error is not None:  # this request failed in the pipeline; the others carry on
                self._finish(active, error=p.error)
                continue
            self.scheduler.produced(active, p)
            frames += p.num_frames
        self.scheduler.observe(frames)
        return rows, frames

    def _report(self, report: TickReport) -> None:
        for listener in self._listeners:
            try:
                listener(report)
            except Exception:  # metrics must never break the loop
                log.exception("tick listener failed")

    def _vocoder_ready(self) -> bool:
        return any(self.scheduler.ready(a) for a in self.scheduler.requests.values())

    def _vocode(self) -> bool:
        """One bounded vocoder piece (the scheduler picks it); its PCM goes into the outbox. With a
        vocoder thread the pieces it finished are collected first (all of them, waiting, when no
        tick runs beside them), then the next one is handed over, to decode beside the next ticks."""
        collected = self._collect_vocoded(wait=self.pipeline.active_slots == 0)
        work = self._vocoder_work()
        if not work:
            return collected
        items = [item for _, item, _ in work]
        if self.executor.overlapped:
            while self.executor.vocoding >= PIECES_IN_FLIGHT:
                self._vocoded(*self.executor.vocoded(wait=True))
            self.executor.submit_vocode(items, work)
        else:
            self._vocoded(work, self.executor.vocode(items))
        return True

    def _vocoder_work(self) -> list[tuple[VocoderWork, VocalizeItem, int]]:
        """The scheduler's next piece as vocalizer items, each with its request's frames handed
        over once it is (the scheduler sizes the next chunks by them, wherever this one decodes);
        a request whose fault hook fails, fails."""
        work: list[tuple[VocoderWork, VocalizeItem]] = []
        for w in self.scheduler.vocoder_piece(self.scheduler.in_flight()):
            active = w.state
            active.pending = active.pending[len(w.frames):]
            try:
                self._hook(active.request_id, "vocalize")
            except Exception as exc:
                self._finish(active, error=f"vocalizer failed: {exc}")
                continue
            item = VocalizeItem(stream_id=active.request_id, codes=torch.cat([p.codes for p in w.frames]),
                                frame_offset=w.frames[0].frame_start,
                                is_last=active.status is RequestStatus.VOCALIZING and not active.pending)
            work.append((w, item))
        handed = []
        for w, item in work:
            active = w.state
            active.frames_done += item.num_frames
            if item.is_last:
                active.frames_total = active.frames_done  # exact now (the talker's was an upper bound)
            handed.append((w, item, active.frames_done))
        return handed

    def _collect_vocoded(self, wait: bool) -> bool:
        """Collect, in order, the pieces the vocoder thread has finished (``wait``: every piece in
        flight, waiting for them: the worker touches the vocalizer itself only after that).
        -> whether there was one."""
        collected = False
        while (done := self.executor.vocoded(wait=wait)) is not None:
            self._vocoded(*done)
            collected = True
        return collected

    def _vocoded(self, work: list[tuple[VocoderWork, VocalizeItem, int]], results: list) -> None:
        """A decoded piece: its PCM into the outbox, then its failed requests end (ending one
        collects the later pieces, whose PCM must follow this one's)."""
        entries, pcm, failed = [], [], []
        now = self.scheduler.clock()
        for (w, item, frames_done), result in zip(work, results):
            active = w.state
            if self.scheduler.requests.get(active.request_id) is not active:
                continue  # ended while its piece was on the vocoder thread
            if isinstance(result, Exception):
                failed.append((active, result))
                continue
            if active.first_audio_at is None:
                active.first_audio_at = now
            text = next((p.text for p in w.frames if p.text), None)
            pcm.append(result.pcm)
            entries.append((active, item.is_last, text, frames_done))
        self._outbox.put(pcm, entries)
        for active, exc in failed:
            self._finish(active, error=f"vocalizer failed: {exc}")

    def _deliver(self, wait: bool = False, urgent: Callable[[tuple], bool] | None = None) -> None:
        """Deliver, in order, the PCM whose device-to-host copy has completed; ``wait``: all of it.

        While the copy of step k's audio is in flight the loop already queues step k+1, so the
        host never waits on the device in steady state. ``urgent`` (an entry test): also wait for
        the pieces up to the last one holding such an entry (a stream's first or early chunks) -
        delivered when its copy lands, not after the next step. Where (measured on the virtual device, H100 table, benchmarks/
        RESULTS.md): at the top of a turn, before its launches, the device idles while the host
        admits and launches, but new arrivals then prefill on an idle device (first audio p50
        102-106 ms at 20 req/s, against 124-135 right after the next step is queued and 144-146
        for neither); under load those gaps cost throughput, so there the wait comes after the
        step is queued (``step``)."""
        if wait:
            self._collect_vocoded(wait=True)
        for (active, final, text, frames_done), pcm in self._outbox.take(wait, urgent):
            if self.scheduler.requests.get(active.request_id) is not active:
                continue  # cancelled or failed while its audio was on the way
            if self.aligning is not None and self.aligning.keep(active, pcm) and final:
                # the last audio goes now; the final chunk follows with the word times
                emit_audio(active, pcm, False, text, frames_done)
                self._await_alignment(active)
                continue
            emit_audio(active, pcm, final, text, frames_done)
            if final:
                self._finish(active, error=None, delivered_final=True)

    # ------------------------------------------------------------ word timestamps
    def _await_alignment(self, active: RequestState) -> None:
        """All its audio is delivered: the request leaves the slots and waits for alignment."""
        self.scheduler.align(active)
        self._release(active.request_id)
        self.aligning.complete(active)

    def _align(self) -> bool:
        """One bounded alignment batch, only while no realtime request waits for its first audio."""
        if not self.scheduler.aligning or self.scheduler.first_audio_waiting():
            return False
        for state, alignment in self.aligning.run(self.scheduler.aligning, self._hook):
            self._end_aligning(state, alignment)
        return True

    def _end_aligning(self, state: RequestState, alignment, error: str | None = None) -> None:
        """Its final chunk, with its word times (None: it could not be aligned)."""
        if self.scheduler.end(state, error) is None:
            return
        deliver_final(state.handle, state.deliver, state.delivered, state.frames_done, state.frames_total,
                      error, alignment=alignment, truncated=state.truncated)

    def _finish(self, active: RequestState, error: str | None, delivered_final: bool = False) -> None:
        was = self.scheduler.end(active, error)
        if was is None:  # ended already
            return
        self._release(active.request_id)
        if was is RequestStatus.WAITING:
            self._release_pending()  # it leaves the queue without a slot
        if not delivered_final:
            deliver_final(active.handle, active.deliver, active.delivered, active.frames_done,
                          active.frames_total, error, truncated=active.truncated)
        active.handle.mark_done()

    def _release(self, request_id: str) -> None:
        """Free a request's slot and decoder state, once no piece is on the vocoder thread."""
        self._collect_vocoded(wait=True)
        self.executor.release(request_id)

    def _hook(self, request_id: str, stage: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(request_id, stage)
