"""The dedicated thread that owns the device and runs the tick loop.

One loop iteration ("tick"):
  1. take new requests from the thread-safe inbox and let the source prepare them
     (DiT: text -> clauses -> encoder states -> durations -> chunk layout);
  2. drop cancelled requests (their slots are freed before the forward);
  3. fill free slots with the next unit of work of each waiting request, realtime first;
  4. one ``source.tick()`` (DiT: one batched forward; talker: one talker step);
  5. finished frames -> one batched ``Vocalizer.vocalize`` -> ``deliver``.
The thread sleeps on the inbox when nothing is active. Failures are per request:
an exception while preparing, starting or vocalizing one request fails only it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict, defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from engines.contract import (
    SAMPLE_RATE,
    AudioChunk,
    ChunkTiming,
    Deliver,
    EngineOverloaded,
    Priority,
    RequestHandle,
    SynthesisRequest,
    TickReport,
)
from engines.pipelines.base import Pipeline, Produced
from engines.pipelines.vocoder import VocalizeItem, Vocalizer

log = logging.getLogger("streamvox.worker")


FaultHook = Callable[[str, str], None]
"""``hook(request_id, stage)`` called at each per-request stage ("plan", "admit",
"vocalize"); raising from it simulates a failure inside that request (fault tests)."""


STAGES = ("deliver", "plan", "admit", "tick", "vocalize")  # worker loop stages, in loop order
MAX_IN_FLIGHT = 2  # vocalized batches whose PCM may still be on its way to the host


@dataclass
class _Outbox:
    """One vocalize batch's PCM on its way to the host: on CUDA an asynchronous copy into
    pinned memory plus an event (no host sync when it is issued); on CPU already there."""

    pcm: torch.Tensor  # host tensor (pinned on CUDA), all entries back to back
    event: "torch.cuda.Event | None"
    entries: list  # (active, samples, is_final, text, frames_done) in delivery order

    @staticmethod
    def start(pcm: torch.Tensor, entries: list) -> "_Outbox":
        if pcm.device.type != "cuda":
            return _Outbox(pcm, None, entries)
        try:
            host = torch.empty(pcm.shape, dtype=pcm.dtype, pin_memory=True)
        except RuntimeError:  # no page-locked memory to be had: a synchronous copy still works
            return _Outbox(pcm.cpu(), None, entries)
        host.copy_(pcm, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Outbox(host, event, entries)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.pcm.numpy()


@dataclass
class _Active:
    handle: RequestHandle
    deliver: Deliver
    frames_total: int = 0
    frames_done: int = 0  # frames delivered as audio
    delivered: int = 0  # chunks delivered
    started_at: float | None = None
    finished_source: bool = False  # the source produced its last frames
    pending: list[Produced] = field(default_factory=list)  # produced, not yet vocalized

    @property
    def request(self) -> SynthesisRequest:
        return self.handle.request


class Worker:
    """Owns the models and the device; everything here runs on one thread."""

    def __init__(
        self,
        source: Pipeline,
        vocalizer: Vocalizer,
        voice_index: Callable[[str], int],
        max_slots: int,
        max_queue: int = 64,
        batch_slot_share: float = 0.75,
        fault_hook: FaultHook | None = None,
        name: str = "streamvox-worker",
        batch_planning: bool = False,
    ):
        self.source = source
        self.vocalizer = vocalizer
        self.voice_index = voice_index
        self.max_queue = max_queue
        # Batch work may hold at most this share of the slots, so realtime arrivals
        # always find one within a chunk's lifetime.
        self.batch_slot_limit = max(1, int(max_slots * batch_slot_share))
        self.fault_hook = fault_hook
        self._inbox: queue.Queue[tuple[RequestHandle, Deliver]] = queue.Queue()
        self._active: OrderedDict[str, _Active] = OrderedDict()
        self._listeners: list[Callable[[TickReport], None]] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._pending = 0  # requests submitted but not yet started (queue depth)
        self._pending_lock = threading.Lock()
        self._admitting: list[tuple[RequestHandle, Deliver]] = []  # taken from the inbox, not yet active
        # Plan all requests taken from the inbox in one loop iteration together (one encoder
        # forward), when the source can: a win where per-request launch overhead dominates
        # (CUDA). Results then depend on the batch at the fp32 rounding level, hence a switch.
        self.batch_planning = batch_planning and hasattr(source, "prepare_many")
        self._outbox: deque[_Outbox] = deque()  # vocalized audio not yet delivered, oldest first
        self.ticks = 0
        self.error: str | None = None
        # Wall seconds spent per loop stage (plan, admit, tick, vocalize), for benchmarks and
        # profiling. STREAMVOX_STAGE_SYNC=1 synchronises the device at each stage's end so
        # asynchronous GPU work is charged to the stage that issued it (slows the loop).
        self.stage_seconds: defaultdict[str, float] = defaultdict(float)
        for stage in STAGES:  # every key exists up front: readers on other threads copy the dict
            self.stage_seconds[stage] = 0.0
        self._stage_sync = os.environ.get("STREAMVOX_STAGE_SYNC") == "1" and torch.cuda.is_available()

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

    def submit(self, request: SynthesisRequest, deliver: Deliver) -> RequestHandle:
        with self._pending_lock:
            if self._pending >= self.max_queue:
                raise EngineOverloaded(f"admission queue is full ({self.max_queue} waiting)", retry_after_s=1.0)
            self._pending += 1
        handle = RequestHandle(request)
        self._inbox.put((handle, deliver))
        self._wake.set()
        return handle

    @property
    def queue_depth(self) -> int:
        return self._pending

    @property
    def active_requests(self) -> int:
        return len(self._active)

    # ------------------------------------------------------------- worker thread
    def _run(self) -> None:
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
                with self._stage("deliver"):
                    self._flush_outbox(wait=self.source.active_slots == 0)
                with self._stage("plan"):
                    self._admit_new()
                self._drop_cancelled()
                with self._stage("admit"):
                    self._fill_slots()
                if self.source.active_slots == 0:
                    if self._outbox:
                        continue  # deliver before sleeping
                    self._wake.wait(0.05 if self._active else 0.5)
                    self._wake.clear()
                    continue
                try:
                    self._tick()
                except Exception as exc:  # e.g. CUDA out of memory in the batched forward
                    self._fail_tick(exc)
        except BaseException as exc:  # the worker itself died: report, fail everyone
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("worker thread died")
            for handle, deliver in self._admitting:  # taken from the inbox, not yet active
                self._release_pending()
                self._deliver_final(handle, deliver, 0, 0, 0, "engine_failure")
            self._admitting = []
            for active in list(self._active.values()):
                self._finish(active, error="engine_failure")
            raise
        finally:
            try:
                self._flush_outbox(wait=True)  # audio already made is not lost on stop
            except Exception:
                log.exception("delivering the last audio failed")
            for active in list(self._active.values()):
                self._finish(active, error="engine_stopped")
            self._fail_inbox("engine_stopped")

    def _fail_tick(self, exc: Exception) -> None:
        """A batched step failed: the requests whose work was in it fail, the server lives on.

        A batched forward cannot say which row caused it, so every request holding a slot
        in that tick ends with an error (their slots are freed, so the source's state is
        consistent again); requests still waiting for a slot are untouched."""
        log.error("tick failed (%s: %s); failing the requests in it", type(exc).__name__, exc)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give an out-of-memory the best chance on the next tick
        for active in list(self._active.values()):
            rid = active.handle.request_id
            in_slot = active.started_at is not None and not active.finished_source and not self.source.wants_slot(rid)
            if in_slot:
                self._finish(active, error=f"engine_failure: {type(exc).__name__}: {exc}")

    def _fail_inbox(self, reason: str) -> None:
        while True:
            try:
                handle, deliver = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._release_pending()
            self._deliver_final(handle, deliver, 0, 0, 0, reason)

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
        """Plan every request in ``_admitting`` with one ``source.prepare_many``; each failure
        fails its request alone. If the batched call itself fails, the requests stay in
        ``_admitting`` and are planned one by one (which isolates the culprit). A request
        leaves ``_admitting`` the moment it is active or finalised (the worker-death path
        fails whatever is still there)."""
        ready = []
        for handle, deliver in list(self._admitting):
            if handle.cancelled:
                continue  # left for _admit_one, which reports it
            try:
                self._hook(handle.request_id, "plan")
                ready.append((handle, deliver, self.voice_index(handle.request.voice)))
            except Exception as exc:
                self._admitting.remove((handle, deliver))
                self._planning_failed(handle, deliver, exc)
        if not ready:
            return
        try:
            results = self.source.prepare_many([(h.request, v) for h, _, v in ready])
        except Exception as exc:
            log.warning("planning %d requests together failed (%s: %s); planning them one by one",
                        len(ready), type(exc).__name__, exc)
            return
        for (handle, deliver, _), result in zip(ready, results):
            self._admitting.remove((handle, deliver))
            if isinstance(result, Exception):
                self.source.drop(handle.request_id)
                self._planning_failed(handle, deliver, result)
            else:
                self._active[handle.request_id] = _Active(handle=handle, deliver=deliver, frames_total=result)

    def _admit_one(self, handle: RequestHandle, deliver: Deliver) -> None:
        """Plan one request taken from the inbox; a planning error fails it alone."""
        if handle.cancelled:
            self._release_pending()
            self._deliver_final(handle, deliver, 0, 0, 0, "cancelled")
            return
        active = _Active(handle=handle, deliver=deliver)
        try:
            self._hook(handle.request_id, "plan")
            active.frames_total = self.source.prepare(handle.request, self.voice_index(handle.request.voice))
        except Exception as exc:
            self.source.drop(handle.request_id)
            self._planning_failed(handle, deliver, exc)
            return
        self._active[handle.request_id] = active

    def _planning_failed(self, handle: RequestHandle, deliver: Deliver, exc: Exception) -> None:
        log.warning("request %s failed while planning: %s", handle.request_id, exc)
        self._release_pending()
        self._deliver_final(handle, deliver, 0, 0, 0, f"planning failed: {exc}")

    def _drop_cancelled(self) -> None:
        for active in list(self._active.values()):
            if active.handle.cancelled:
                self._finish(active, error="cancelled")

    def _fill_slots(self) -> None:
        free = self.source.free_slots()
        if free <= 0:
            return
        waiting = [a for a in self._active.values()
                   if not a.handle.paused and self.source.wants_slot(a.handle.request_id)]
        # Realtime first; FIFO (dict order) within a class.
        waiting.sort(key=lambda a: a.request.priority != Priority.REALTIME)
        batch_busy = sum(1 for a in self._active.values()
                         if a.request.priority == Priority.BATCH and a.started_at is not None
                         and not a.finished_source and not self.source.wants_slot(a.handle.request_id))
        for active in waiting:
            if free <= 0:
                break
            if active.request.priority == Priority.BATCH and batch_busy >= self.batch_slot_limit:
                continue
            try:
                self._hook(active.handle.request_id, "admit")
                self.source.start(active.handle.request_id)
            except Exception as exc:
                log.warning("request %s failed at slot admission: %s", active.handle.request_id, exc)
                self._finish(active, error=f"admission failed: {exc}")
                continue
            if active.started_at is None:
                active.started_at = time.monotonic()
                self._release_pending()
            free -= 1
            batch_busy += active.request.priority == Priority.BATCH

    def _tick(self) -> None:
        t0 = time.perf_counter()
        with self._stage("tick"):
            produced = self.source.tick()
        self.ticks += 1  # counted before delivery, so a reader woken by a chunk sees this tick
        rows = self.source.last_batch_rows
        slots = self.source.active_slots + sum(1 for p in produced if p.is_last)
        frames = 0
        for p in produced:
            active = self._active.get(p.request_id)
            if active is None:
                continue  # finished or cancelled meanwhile
            active.pending.append(p)
            active.finished_source |= p.is_last
            frames += p.num_frames
        with self._stage("vocalize"):
            self._vocalize_ready()
        report = TickReport(batch_rows=rows, active_slots=slots, seconds=time.perf_counter() - t0,
                            frames_finished=frames)
        for listener in self._listeners:
            try:
                listener(report)
            except Exception:  # metrics must never break the loop
                log.exception("tick listener failed")

    def _vocalize_ready(self) -> None:
        """Vocalize, in one batch, every request whose gathered frames reached its flush size."""
        work: list[tuple[_Active, VocalizeItem, str | None]] = []
        for active in list(self._active.values()):
            if active.handle.paused:
                continue  # back-pressure: hold the (small) latents / codes, not the PCM
            gathered = sum(p.num_frames for p in active.pending)
            if not active.pending or (not active.finished_source
                                      and gathered < self.source.flush_frames(active.frames_done)):
                continue
            pieces, active.pending = active.pending, []
            req = active.request
            try:
                self._hook(req.id, "vocalize")
            except Exception as exc:
                self._finish(active, error=f"vocalizer failed: {exc}")
                continue
            item = VocalizeItem(stream_id=req.id, codes=torch.cat([p.codes for p in pieces]),
                                frame_offset=pieces[0].frame_start, is_last=active.finished_source)
            work.append((active, item, next((p.text for p in pieces if p.text), None)))
        if not work:
            return
        try:
            results: list = self.vocalizer.vocalize([w[1] for w in work])
        except Exception:
            # Isolate the culprit: results do not depend on batch composition, so
            # re-running item by item gives the others exactly the same audio.
            results = []
            for _, item, _ in work:
                try:
                    results.extend(self.vocalizer.vocalize([item]))
                except Exception as exc:
                    log.warning("request %s failed in the vocalizer: %s", item.stream_id, exc)
                    results.append(exc)
        entries, pieces = [], []
        for (active, item, text), result in zip(work, results):
            if isinstance(result, Exception):
                self._finish(active, error=f"vocalizer failed: {result}")
                continue
            active.frames_done += item.num_frames
            if item.is_last:
                active.frames_total = active.frames_done  # exact now (the talker's was an upper bound)
            pieces.append(result.pcm.detach().reshape(-1).float())
            entries.append((active, pieces[-1].numel(), item.is_last, text, active.frames_done))
        if entries:
            self._outbox.append(_Outbox.start(torch.cat(pieces), entries))

    def _flush_outbox(self, wait: bool = False) -> None:
        """Deliver, in order, the PCM whose device-to-host copy has completed; ``wait``: all of it.

        While the copy of tick k's audio is in flight the loop already queues tick k+1, so the
        host never waits on the device in steady state; at most MAX_IN_FLIGHT batches are
        outstanding (then the oldest is waited for), which bounds how far the loop runs ahead."""
        while self._outbox and (wait or len(self._outbox) > MAX_IN_FLIGHT or self._outbox[0].ready()):
            box = self._outbox.popleft()
            pcm = box.wait()
            offset = 0
            for active, size, final, text, frames_done in box.entries:
                piece, offset = pcm[offset:offset + size], offset + size
                if self._active.get(active.handle.request_id) is not active:
                    continue  # cancelled or failed while its audio was on the way
                self._emit(active, piece, final, text, frames_done)
                if final:
                    self._finish(active, error=None, delivered_final=True)

    def _emit(self, active: _Active, pcm: np.ndarray, final: bool, text: str | None, frames_done: int) -> None:
        timing = ChunkTiming(active.handle.submitted_at, active.started_at, time.monotonic())
        chunk = AudioChunk(request_id=active.handle.request_id, index=active.delivered, pcm=pcm,
                           sample_rate=SAMPLE_RATE, frames_done=frames_done,
                           frames_total=active.frames_total, is_final=final, timing=timing, text=text)
        active.delivered += 1
        self._safe_deliver(active.deliver, chunk)

    def _finish(self, active: _Active, error: str | None, delivered_final: bool = False) -> None:
        rid = active.handle.request_id
        if self._active.pop(rid, None) is None:
            return
        self.source.drop(rid)
        if active.started_at is None:
            self._release_pending()
        self.vocalizer.close(rid)
        if not delivered_final:
            self._deliver_final(active.handle, active.deliver, active.delivered, active.frames_done,
                                active.frames_total, error, active.started_at)
        active.handle.mark_done()

    def _deliver_final(self, handle: RequestHandle, deliver: Deliver, index: int, frames_done: int,
                       frames_total: int, error: str | None, started_at: float | None = None) -> None:
        chunk = AudioChunk(request_id=handle.request_id, index=index, pcm=np.zeros(0, np.float32),
                           sample_rate=SAMPLE_RATE, frames_done=frames_done, frames_total=frames_total,
                           is_final=True, error=error,
                           timing=ChunkTiming(handle.submitted_at, started_at, time.monotonic()))
        self._safe_deliver(deliver, chunk)
        handle.mark_done()

    @staticmethod
    def _safe_deliver(deliver: Deliver, chunk: AudioChunk) -> None:
        try:
            deliver(chunk)
        except Exception:  # a broken consumer must not kill the worker
            log.exception("deliver callback failed for request %s", chunk.request_id)

    def _hook(self, request_id: str, stage: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(request_id, stage)
