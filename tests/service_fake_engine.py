"""A throwaway stand-in engine for developing the service while the real one lands.

Only used when STREAMVOX_TEST_FAKE_ENGINE=1; the tests run against the real
``build_engine(preset="tiny", device="cpu")`` otherwise. It honours the contract: one
worker thread, chunks delivered in order ending with one final chunk, cancel, pause.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np

from engines.contract import (SAMPLE_RATE, SAMPLES_PER_FRAME, AudioChunk, ChunkTiming, EngineInfo, EngineOverloaded,
                              EngineStats, InvalidRequest, Priority, RequestHandle, TickReport)

VOICES = ("default", "aria", "blaze")
ALIASES = {"alloy": "aria", "echo": "blaze"}


class FakeEngine:
    def __init__(self, max_queue: int = 64, max_slots: int = 16, frames_per_chunk: int = 4, tick_s: float = 0.01):
        self.info = EngineInfo(model="streamvox", preset="fake", source="fake", device="cpu", dtype="float32",
                               sample_rate=SAMPLE_RATE, voices=VOICES, voice_aliases=ALIASES,
                               random_components=("everything",), max_queue=max_queue)
        self._queue: queue.Queue = queue.Queue()
        self._max_queue, self._max_slots, self._fpc, self._tick_s = max_queue, max_slots, frames_per_chunk, tick_s
        self._active: list = []
        self._listeners = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ticks = 0
        self._ready = False

    def start(self):
        self._thread.start()
        self._ready = True

    def stop(self, timeout: float = 10.0):
        self._stop.set()
        self._thread.join(timeout)

    def resolve_voice(self, name):
        name = ALIASES.get(name, name)
        if name not in VOICES:
            raise InvalidRequest("voice", f"unknown voice {name}")
        return name

    def add_tick_listener(self, listener):
        self._listeners.append(listener)

    def stats(self):
        return EngineStats(alive=self._thread.is_alive(), ready=self._ready, queue_depth=self._queue.qsize(),
                           active_requests=len(self._active) + self._queue.qsize(), active_slots=len(self._active),
                           ticks=self._ticks)

    def submit(self, request, deliver):
        if not self._thread.is_alive():
            from engines.contract import EngineUnavailable
            raise EngineUnavailable("not running")
        if not request.text.strip():
            raise InvalidRequest("text", "empty")
        self.resolve_voice(request.voice)
        if self._queue.qsize() >= self._max_queue:
            raise EngineOverloaded()
        handle = RequestHandle(request)
        total = max(4, int(len(request.text) * 0.9 / request.speed))
        self._queue.put([handle, deliver, total, 0, 0, None])
        return handle

    def _run(self):
        while not self._stop.is_set():
            while len(self._active) < self._max_slots:
                try:
                    self._active.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._active.sort(key=lambda s: s[0].request.priority != Priority.REALTIME)
            t0 = time.monotonic()
            rows = 0
            for slot in list(self._active):
                handle, deliver, total, done, index, started = slot
                if handle.cancelled:
                    self._finish(slot, "cancelled")
                    continue
                if handle.paused:
                    continue
                rows += 2
                slot[5] = started or t0
                n = min(self._fpc, total - done)
                t = np.arange(done * SAMPLES_PER_FRAME, (done + n) * SAMPLES_PER_FRAME) / SAMPLE_RATE
                pcm = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
                slot[3] = done + n
                final = slot[3] >= total
                deliver(AudioChunk(handle.request_id, index, pcm, SAMPLE_RATE, slot[3], total, final,
                                   timing=ChunkTiming(handle.submitted_at, slot[5], time.monotonic())))
                slot[4] = index + 1
                if final:
                    self._active.remove(slot)
                    handle.mark_done()
            self._ticks += 1
            for listener in self._listeners:
                listener(TickReport(rows, len(self._active), time.monotonic() - t0, rows // 2 * self._fpc))
            time.sleep(self._tick_s)
        for slot in list(self._active):
            self._finish(slot, "cancelled")

    def _finish(self, slot, error):
        handle, deliver, total, done, index, started = slot
        self._active.remove(slot)
        deliver(AudioChunk(handle.request_id, index, np.zeros(0, np.float32), SAMPLE_RATE, done, total, True, error=error))
        handle.mark_done()
