"""The bridge from the engine's worker thread to the event loop, one request at a time.

``ChunkStream`` submits a request, receives its chunks through
``loop.call_soon_threadsafe`` and buffers them. The buffer is bounded by back-pressure:
when ``high_water`` chunks wait unread, the engine is asked to pause the request (it
starts no new chunk), and it resumes once the reader has drained to ``low_water``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import replace
from typing import AsyncIterator

import numpy as np

from engines.contract import (
    SAMPLE_RATE,
    AudioChunk,
    RequestHandle,
    SynthesisEngine,
    SynthesisRequest,
)
from service.metrics import Metrics

LIVENESS_CHECK_SECONDS = 1.0  # how often a waiting reader checks that the worker still runs
# A listener that runs dry for less than this is not told: a gap that short is within any
# player's jitter buffer (the playground's worklet holds 50 ms), and reporting it would be noise.
BEHIND_TOLERANCE_S = 0.05


class PlaybackClock:
    """Where a listener who plays the audio the moment it exists would be: the stream is
    *behind* when a chunk becomes available after everything before it has been played.

    Times are when the engine's chunks reached the service (not when they were sent), so a
    client that reads slowly is never reported as the engine's lateness. The clock starts
    at the first audio; the wait for it is time to first audio, not an underrun."""

    def __init__(self, sample_rate: int, starts_at: float | None = None):
        self.sample_rate = sample_rate
        self.starts_at = starts_at  # earliest playback start (the session's previous audio still playing)
        self.runs_dry_at: float | None = None  # when the listener has played all audio so far
        self.behind_s = 0.0  # silence the listener heard inside this stream, in all
        self.underruns = 0

    def add(self, samples: int, available_at: float, count: bool = True) -> float:
        """``samples`` of audio became available at ``available_at``; returns the gap (s) the
        listener heard before them (0.0 when none, or below the tolerance). ``count=False``:
        the gap is not the server's (live text still arriving) - advance the clock only."""
        if samples <= 0:
            return 0.0
        gap = 0.0
        if self.runs_dry_at is None:
            start = max(available_at, self.starts_at or available_at)
        else:
            start = max(available_at, self.runs_dry_at)
            late = available_at - self.runs_dry_at
            if count and late > BEHIND_TOLERANCE_S:
                gap = late
                self.behind_s += late
                self.underruns += 1
        self.runs_dry_at = start + samples / self.sample_rate
        return gap


class ChunkStream:
    def __init__(self, engine: SynthesisEngine, request: SynthesisRequest, metrics: Metrics,
                 high_water: int = 8, first_audio_metric: bool = True):
        self.request = request
        self._engine = engine
        self._metrics = metrics
        self._loop = asyncio.get_running_loop()
        self._buffer: collections.deque[AudioChunk] = collections.deque()
        self._ready = asyncio.Event()
        self._high_water = max(1, high_water)
        self._low_water = self._high_water // 2
        self._paused_by_us = False
        # time to first audio is the listener's: a later utterance of a planned text has none
        self._first_audio_seen = not first_audio_metric
        self.handle: RequestHandle | None = None
        self.finished = False  # the final chunk was read
        self.max_buffered = 0  # largest backlog seen; tests check it stays bounded
        self.tempo = None  # the talker's speed (service/synthesis/tempo.py), applied as chunks are read
        self._arrivals: collections.deque[float] = collections.deque()  # loop time each buffered chunk came
        # Realtime streams keep a playback clock (set by their reader: the WebSocket session
        # starts it where its previous utterance stops playing); ``last_gap`` is the silence
        # before the chunk just read, for the reader to tell its client.
        self.clock: PlaybackClock | None = None
        self.last_gap = 0.0
        self.count_gaps = lambda: True  # live text: gaps while the text still arrives are the client's

    def start(self) -> "ChunkStream":
        """Submit; raises the engine's InvalidRequest / EngineOverloaded / EngineUnavailable."""
        self.handle = self._engine.submit(self.request, self._deliver_from_worker)
        return self

    # -- worker thread side -------------------------------------------------------
    def _deliver_from_worker(self, chunk: AudioChunk) -> None:
        try:
            self._loop.call_soon_threadsafe(self._on_chunk, chunk)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # -- loop side ------------------------------------------------------------------
    def _on_chunk(self, chunk: AudioChunk) -> None:
        self._buffer.append(chunk)
        self._arrivals.append(self._loop.time())
        self.max_buffered = max(self.max_buffered, len(self._buffer))
        if chunk.pcm.size and not self._first_audio_seen:
            self._first_audio_seen = True
            submitted = chunk.timing.submitted_at if chunk.timing else self.handle.submitted_at
            self._metrics.ttfa.observe(max(0.0, time.monotonic() - submitted))
        if chunk.pcm.size:
            self._metrics.audio_seconds.inc(chunk.pcm.size / chunk.sample_rate)
        if chunk.truncated:
            self._metrics.truncated.labels(chunk.truncated).inc()
        if len(self._buffer) >= self._high_water and not self._paused_by_us and not chunk.is_final:
            self._paused_by_us = True
            self.handle.pause()
            self._metrics.paused_streams.inc()
        self._ready.set()

    def _resume_if_drained(self) -> None:
        if self._paused_by_us and len(self._buffer) <= self._low_water:
            self._paused_by_us = False
            self.handle.resume()
            self._metrics.paused_streams.dec()

    @property
    def paused(self) -> bool:
        return self._paused_by_us

    async def next_chunk(self) -> AudioChunk:
        while not self._buffer:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout=LIVENESS_CHECK_SECONDS)
            except asyncio.TimeoutError:
                if not self._engine.stats().alive:  # a dead worker sends nothing more: end the request here
                    self._on_chunk(self._engine_failure_chunk())
        chunk = self._buffer.popleft()
        arrived = self._arrivals.popleft()
        if self.tempo is not None:
            chunk = self.tempo.apply(chunk)
            if chunk.alignment is not None:  # word times on the stretched audio's clock
                chunk = replace(chunk, alignment=chunk.alignment.scaled(1.0 / self.tempo.speed))
        if self.clock is not None:  # after the tempo: the listener hears the stretched audio
            self.last_gap = self.clock.add(chunk.pcm.size, arrived, self.count_gaps())
            if self.last_gap:
                self._metrics.behind.inc()
                self._metrics.behind_seconds.inc(self.last_gap)
        self._resume_if_drained()
        if chunk.is_final:
            self.finished = True
            self.close()
        return chunk

    def _engine_failure_chunk(self) -> AudioChunk:
        return AudioChunk(request_id=self.request.id, index=-1, pcm=np.zeros(0, dtype=np.float32),
                          sample_rate=SAMPLE_RATE, frames_done=0, frames_total=0, is_final=True,
                          error="engine_failure")

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        while not self.finished:
            yield await self.next_chunk()

    def cancel(self) -> None:
        if self.handle is not None and not self.finished:
            self.handle.cancel()
        self.close()

    def close(self) -> None:
        """Forget back-pressure bookkeeping (the request is over or abandoned)."""
        if self._paused_by_us:
            self._paused_by_us = False
            self._metrics.paused_streams.dec()
            if self.handle is not None:
                self.handle.resume()  # let a cancelled request reach its final chunk


TRUNCATED_WHY = {
    "budget": "it passed its frame budget from its text without ending",
    "max_new_tokens": "it reached max_new_tokens without ending",
    "max_seq_len": "it ran out of positions without ending",
    "loop": "its speech fell into a repeating loop",
}


def truncated_event(reason: str, **fields) -> dict:
    """``utterance.truncated``: the talker ended an utterance that did not end by itself (a
    runaway: engines/pipelines/talker/guard.py, budget.py); the same event on SSE and WebSocket."""
    return {"type": "utterance.truncated", **fields, "reason": reason,
            "message": f"the utterance was ended early: {TRUNCATED_WHY.get(reason, reason)}"}


def behind_event(gap_s: float, behind_s: float, **fields) -> dict:
    """``stream.behind``: the chunk that follows comes after the listener ran out of audio for
    ``gap_s`` (the engine is slower than real time here; ``behind_s``: the stream's silences so
    far, ChunkStream.last_gap and .clock.behind_s); the same event on SSE and WebSocket."""
    return {"type": "stream.behind", **fields, "gap_s": round(gap_s, 3), "behind_s": round(behind_s, 3),
            "message": "the audio is arriving slower than real time: the listener hears gaps; "
                       "use whole-file speech (stream: false) or a job on this server"}
