"""The dedicated thread that owns the device and runs the tick loop.

One loop iteration ("tick"):
  1. take new requests from the thread-safe inbox and plan them (admission: text ->
     clauses -> encoder states -> durations -> chunk layout);
  2. drop cancelled requests (their slots are freed before the forward);
  3. fill free slots with the next chunk of each waiting request, realtime first;
  4. one ``StreamScheduler.tick()`` (one batched DiT forward);
  5. finished chunks -> one batched ``Vocalizer.vocalize`` -> ``deliver``.
The thread sleeps on the inbox when nothing is active. Failures are per request:
an exception while planning, admitting or vocalizing one request fails only it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from .contract import (
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
from .stream import ChunkJob, FinishedChunk, StreamScheduler
from .vocalizer import VocalizeItem, Vocalizer

log = logging.getLogger("streamvox.worker")


class Planner(Protocol):
    """Admission-time planning (engines/planner.py's UtterancePlanner)."""

    def plan(self, text: str, voice_index: int, speed: float) -> list: ...


FaultHook = Callable[[str, str], None]
"""``hook(request_id, stage)`` called at each per-request stage ("plan", "admit",
"vocalize"); raising from it simulates a failure inside that request (fault tests)."""


@dataclass
class _Chunk:
    enc: torch.Tensor
    enc_null: torch.Tensor
    frame_start: int
    num_frames: int
    text: str | None  # clause text, on the first chunk of each clause


@dataclass
class _Active:
    handle: RequestHandle
    deliver: Deliver
    voice_index: int
    chunks: list[_Chunk] = field(default_factory=list)
    frames_total: int = 0
    next_chunk: int = 0
    in_flight: tuple[str, int] | None = None
    context: torch.Tensor | None = None  # clean tail of the last finished chunk [Tc, D]
    frames_done: int = 0
    delivered: int = 0
    started_at: float | None = None

    @property
    def request(self) -> SynthesisRequest:
        return self.handle.request

    @property
    def finished_all(self) -> bool:
        return self.next_chunk >= len(self.chunks) and self.in_flight is None


class Worker:
    """Owns the models and the device; everything here runs on one thread."""

    def __init__(
        self,
        planner: Planner,
        scheduler: StreamScheduler,
        vocalizer: Vocalizer,
        voice_index: Callable[[str], int],
        context_frames: int,
        max_queue: int = 64,
        batch_slot_share: float = 0.75,
        fault_hook: FaultHook | None = None,
        name: str = "streamvox-worker",
    ):
        self.planner = planner
        self.scheduler = scheduler
        self.vocalizer = vocalizer
        self.voice_index = voice_index
        self.context_frames = context_frames
        self.max_queue = max_queue
        # Batch work may hold at most this share of the slots, so realtime arrivals
        # always find one within a chunk's lifetime.
        self.batch_slot_limit = max(1, int(scheduler.cfg.max_slots * batch_slot_share))
        self.fault_hook = fault_hook
        self._inbox: queue.Queue[tuple[RequestHandle, Deliver]] = queue.Queue()
        self._active: OrderedDict[str, _Active] = OrderedDict()
        self._listeners: list[Callable[[TickReport], None]] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._pending = 0  # requests submitted but not yet started (queue depth)
        self._pending_lock = threading.Lock()
        self._admitting: tuple[RequestHandle, Deliver] | None = None  # in hand between inbox and _active
        self.ticks = 0
        self.error: str | None = None

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

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._admit_new()
                self._drop_cancelled()
                self._fill_slots()
                if self.scheduler.active_slots == 0:
                    self._wake.wait(0.05 if self._active else 0.5)
                    self._wake.clear()
                    continue
                self._tick()
        except BaseException as exc:  # the worker itself died: report, fail everyone
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("worker thread died")
            if self._admitting is not None:  # taken from the inbox, not yet active
                handle, deliver = self._admitting
                self._release_pending()
                self._deliver_final(handle, deliver, 0, 0, 0, "engine_failure")
            for active in list(self._active.values()):
                self._finish(active, error="engine_failure")
            raise
        finally:
            for active in list(self._active.values()):
                self._finish(active, error="engine_stopped")
            self._fail_inbox("engine_stopped")

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
                handle, deliver = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._admitting = (handle, deliver)
            self._admit_one(handle, deliver)
            self._admitting = None

    def _admit_one(self, handle: RequestHandle, deliver: Deliver) -> None:
        """Plan one request taken from the inbox; a planning error fails it alone."""
        if handle.cancelled:
            self._release_pending()
            self._deliver_final(handle, deliver, 0, 0, 0, "cancelled")
            return
        active = _Active(handle=handle, deliver=deliver, voice_index=0)
        try:
            self._hook(handle.request_id, "plan")
            req = handle.request
            active.voice_index = self.voice_index(req.voice)
            for clause in self.planner.plan(req.text, active.voice_index, req.speed):
                for i, (start, n) in enumerate(clause.chunks):
                    active.chunks.append(_Chunk(clause.enc, clause.enc_null, start, n,
                                                clause.text if i == 0 else None))
            active.frames_total = sum(c.num_frames for c in active.chunks)
        except Exception as exc:
            log.warning("request %s failed while planning: %s", handle.request_id, exc)
            self._release_pending()
            self._deliver_final(handle, deliver, 0, 0, 0, f"planning failed: {exc}")
            return
        self._active[handle.request_id] = active

    def _drop_cancelled(self) -> None:
        for active in list(self._active.values()):
            if active.handle.cancelled:
                self._finish(active, error="cancelled")

    def _fill_slots(self) -> None:
        free = self.scheduler.free_slots()
        if free <= 0:
            return
        waiting = [a for a in self._active.values()
                   if a.in_flight is None and a.next_chunk < len(a.chunks) and not a.handle.paused]
        # Realtime first; FIFO (dict order) within a class.
        waiting.sort(key=lambda a: a.request.priority != Priority.REALTIME)
        batch_busy = sum(1 for a in self._active.values()
                         if a.in_flight is not None and a.request.priority == Priority.BATCH)
        for active in waiting:
            if free <= 0:
                break
            if active.request.priority == Priority.BATCH and batch_busy >= self.batch_slot_limit:
                continue
            try:
                self._admit_chunk(active)
            except Exception as exc:
                log.warning("request %s failed at chunk admission: %s", active.handle.request_id, exc)
                self._finish(active, error=f"chunk admission failed: {exc}")
                continue
            free -= 1
            batch_busy += active.request.priority == Priority.BATCH

    def _admit_chunk(self, active: _Active) -> None:
        self._hook(active.handle.request_id, "admit")
        req = active.request
        chunk = active.chunks[active.next_chunk]
        key = (req.id, active.next_chunk)
        context = active.context
        if context is None:
            context = chunk.enc.new_zeros((0, self.scheduler.dit.cfg.latent_dim))
        guided = req.guidance_scale > 1.0 and self.scheduler.cfg.guidance != "none"
        self.scheduler.admit(ChunkJob(
            key=key, enc=chunk.enc, enc_null=chunk.enc_null if guided else None, context=context,
            frame_start=chunk.frame_start, num_frames=chunk.num_frames, seed=req.seed,
            steps=req.steps, guidance_scale=req.guidance_scale))
        if active.started_at is None:
            active.started_at = time.monotonic()
            self._release_pending()
        active.in_flight = key
        active.next_chunk += 1

    def _tick(self) -> None:
        t0 = time.perf_counter()
        finished = self.scheduler.tick()
        self.ticks += 1  # counted before delivery, so a reader woken by a chunk sees this tick
        rows, slots = self.scheduler.last_batch_rows, self.scheduler.active_slots + len(finished)
        if finished:
            self._vocalize(finished)
        report = TickReport(batch_rows=rows, active_slots=slots, seconds=time.perf_counter() - t0,
                            frames_finished=sum(f.latents.shape[0] for f in finished))
        for listener in self._listeners:
            try:
                listener(report)
            except Exception:  # metrics must never break the loop
                log.exception("tick listener failed")

    def _vocalize(self, finished: list[FinishedChunk]) -> None:
        work: list[tuple[_Active, _Chunk, VocalizeItem]] = []
        for fc in finished:
            active = self._active.get(fc.key[0])
            if active is None or active.in_flight != fc.key:
                continue  # cancelled meanwhile
            active.in_flight = None
            chunk = active.chunks[fc.key[1]]
            tail = fc.latents[-self.context_frames:] if self.context_frames > 0 else fc.latents[:0]
            active.context = tail
            req = active.request
            item = VocalizeItem(stream_id=req.id, latents=fc.latents, frame_offset=chunk.frame_start,
                                seed=req.seed, greedy=req.greedy, temperature=req.temperature,
                                top_k=req.top_k, top_p=req.top_p,
                                is_last=active.next_chunk >= len(active.chunks))
            try:
                self._hook(req.id, "vocalize")
            except Exception as exc:
                self._finish(active, error=f"vocalizer failed: {exc}")
                continue
            work.append((active, chunk, item))
        if not work:
            return
        try:
            results = self.vocalizer.vocalize([w[2] for w in work])
        except Exception:
            # Isolate the culprit: results do not depend on batch composition, so
            # re-running item by item gives the others exactly the same audio.
            results = []
            for active, _, item in work:
                try:
                    results.extend(self.vocalizer.vocalize([item]))
                except Exception as exc:
                    log.warning("request %s failed in the vocalizer: %s", item.stream_id, exc)
                    results.append(exc)
        for (active, chunk, item), result in zip(work, results):
            if isinstance(result, Exception):
                self._finish(active, error=f"vocalizer failed: {result}")
                continue
            pcm = result.pcm.detach().float().cpu().numpy()
            active.frames_done += chunk.num_frames
            final = active.finished_all
            self._emit(active, pcm, final, chunk.text)
            if final:
                self._finish(active, error=None, delivered_final=True)

    def _emit(self, active: _Active, pcm: np.ndarray, final: bool, text: str | None) -> None:
        timing = ChunkTiming(active.handle.submitted_at, active.started_at, time.monotonic())
        chunk = AudioChunk(request_id=active.handle.request_id, index=active.delivered, pcm=pcm,
                           sample_rate=SAMPLE_RATE, frames_done=active.frames_done,
                           frames_total=active.frames_total, is_final=final, timing=timing, text=text)
        active.delivered += 1
        self._safe_deliver(active.deliver, chunk)

    def _finish(self, active: _Active, error: str | None, delivered_final: bool = False) -> None:
        rid = active.handle.request_id
        if self._active.pop(rid, None) is None:
            return
        if active.in_flight is not None:
            self.scheduler.cancel(active.in_flight)
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
