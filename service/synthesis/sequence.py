"""A planned text's utterances (and pauses) played as one stream (service/synthesis/plan.py).

    stream = UtteranceSequence(engine, parts, metrics, high_water=8, stretch=None, plan=plan).start()
    chunk = await stream.next_chunk()       # as ChunkStream: in order, one final chunk at the end

It has :class:`~service.synthesis.chunks.ChunkStream`'s interface, so every reader (speech,
sockets, jobs) plays long text as it plays one utterance:

* utterance i + 1 is submitted once utterance i is audible (as a session prefetches its next
  sentence): it is generated while i plays, and its first audio waits for nothing;
* seams are continuous: the last ``SEAM_FADE_SAMPLES`` of an utterance fade to silence and the
  first of the next fade in from it (each utterance's codec decoder starts from its own state,
  so the waveforms would otherwise meet at an arbitrary step: a click); the audio held back for
  the fade-out is ~10 ms;
* a :class:`~service.synthesis.breaks.Pause` is that much silence, to the sample, in pieces of
  at most 1 s, each after a turn of the event loop (a long pause is never encoded and sent in
  one go while other clients wait); speech after a pause starts from silence, so it does not
  fade in;
* chunk indices, ``frames_done`` and word times (``alignment``, offset by the audio before each
  utterance, character spans in the plan's text: the characters the client sent) run across the
  whole text; an utterance the talker ended early carries ``truncated`` on the chunk that ends it.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np

from engines.contract import (
    SAMPLE_RATE,
    Alignment,
    AudioChunk,
    EngineError,
    EngineOverloaded,
    SynthesisEngine,
    SynthesisRequest,
    WordTimestamp,
)
from service.metrics import Metrics
from service.synthesis.chunks import ChunkStream, PlaybackClock
from service.synthesis.breaks import Pause
from service.synthesis.plan import RequestPlan
from service.synthesis.tempo import TempoStretch
from service.synthesis.timestamps import in_source

SEAM_FADE_SAMPLES = 240  # 10 ms at 24 kHz
PAUSE_CHUNK_SAMPLES = SAMPLE_RATE  # silence goes out in pieces of at most 1 s
RESUBMIT_MAX_WAIT_S = 0.5  # the engine queue was full: how long to wait before asking again, at most


def fade_in_after(previous: object | None) -> int:
    """Samples of a part's start to fade in when it follows ``previous`` (None: nothing): only
    after speech, whose decoder ended at an arbitrary step; after a pause it starts from silence."""
    return SEAM_FADE_SAMPLES if previous is not None and not isinstance(previous, Pause) else 0


class UtteranceSequence:
    def __init__(self, engine: SynthesisEngine, parts: list[SynthesisRequest | Pause], metrics: Metrics,
                 high_water: int = 8, stretch: float | None = None, after: object | None = None, *,
                 plan: RequestPlan):
        """``after``: the part these parts follow when a plan's earlier parts were played already
        (a job resumed): the first one's seam is the one it would have had after it. ``plan``: the
        plan the parts were made from, one for one: word times are placed in its text."""
        if not parts:
            raise ValueError("a sequence needs at least one part")
        self._engine = engine
        self.parts = list(parts)
        self._request_id = self.request.id if self.request is not None else "pause"  # its chunks' request_id
        self._metrics = metrics
        self._high_water = high_water
        self._stretch = stretch
        self._streams: dict[int, ChunkStream] = {}  # part index -> its submitted stream
        self.part = 0  # the part being played
        self.parts_done = 0  # parts whose audio has all been read
        self.finished = False  # the final chunk was read
        self._cancelled = False
        self.max_buffered = 0
        self.last_gap = 0.0
        self._clock: PlaybackClock | None = None
        self._count_gaps = lambda: True
        self._index = 0  # chunks handed out
        self._samples = 0  # samples handed out
        self._part_start = 0  # the sample the current part starts at (its word times are offset by it)
        self._frames = 0  # frames of the parts done
        self._held = np.zeros(0, np.float32)  # the current part's last samples, held for its fade-out
        self._fade_in = fade_in_after(after)  # samples of this part's start still to fade in
        self._pause_left: int | None = None  # samples of the current pause still to send
        self._plan = plan
        self._alignments: list[tuple[Alignment, float]] = []  # (alignment in the plan's text, offset ms)
        self._aligned_all = True
        # The chunk just returned ended a part (``parts_done`` counts it): that part's own word times
        # (from its start, its characters in the plan's text; None when it has none), for a reader
        # that keeps parts apart (a job).
        self.ended_part_alignment: Alignment | None = None
        # ... and that part's word times as the engine gave them (from its start, in its own text),
        # with where it starts on the stream's clock (ms), for a reader that reports each utterance's
        self.ended_part_words: tuple[Alignment, float] | None = None

    # -- ChunkStream's interface ---------------------------------------------------------
    @property
    def request(self) -> SynthesisRequest | None:
        """The first utterance's request; None when the text is only pauses."""
        return next((p for p in self.parts if isinstance(p, SynthesisRequest)), None)

    @property
    def handle(self):
        stream = self._streams.get(self.part)
        return stream.handle if stream is not None else None

    @property
    def clock(self) -> PlaybackClock | None:
        return self._clock

    @clock.setter
    def clock(self, clock: PlaybackClock | None) -> None:  # one listener's clock across every part
        self._clock = clock
        for stream in self._streams.values():
            stream.clock = clock

    @property
    def count_gaps(self):
        return self._count_gaps

    @count_gaps.setter
    def count_gaps(self, count) -> None:
        self._count_gaps = count
        for stream in self._streams.values():
            stream.count_gaps = count

    @property
    def paused(self) -> bool:
        return any(stream.paused for stream in self._streams.values())

    def start(self) -> "UtteranceSequence":
        """Submit the first utterance; raises the engine's refusal as ChunkStream.start does."""
        first = self._next_speech(0)
        if first is not None:
            self._submit(first)
        return self

    async def next_chunk(self) -> AudioChunk:
        """The next chunk; every part ends with a chunk of its own (possibly empty), so each
        chunk's audio belongs to one part: the one ``parts_done`` counts once it has ended."""
        self.ended_part_alignment = self.ended_part_words = None
        while True:
            part = self.parts[self.part]
            if self._cancelled and self.part not in self._streams:
                return self._end(error="cancelled")
            if isinstance(part, Pause):
                await asyncio.sleep(0)  # one piece of silence per turn of the loop: its reader encodes it
                return self._pause_chunk(part)
            stream = self._streams.get(self.part) or await self._submit_when_possible(self.part)
            if stream is None:  # the engine went away between parts
                return self._end(error="engine_failure")
            chunk = await stream.next_chunk()
            self.last_gap = stream.last_gap
            self.max_buffered = max(self.max_buffered, stream.max_buffered)
            if chunk.error:
                return self._end(error=chunk.error, frames=chunk.frames_done)
            if chunk.pcm.size:
                self._prefetch()
            pcm = self._shape(chunk.pcm, chunk.is_final)
            if not chunk.is_final:
                if pcm.size:
                    return self._out(chunk, pcm)
                continue
            # the part ends here
            self._streams.pop(self.part, None)
            self._frames += chunk.frames_done
            alignment = self._in_text(chunk.alignment)
            if alignment is not None:
                self._alignments.append((alignment, self._part_start * 1000.0 / SAMPLE_RATE))
            else:
                self._aligned_all = False
            self.ended_part_alignment = alignment
            if chunk.alignment is not None:
                self.ended_part_words = chunk.alignment, self._part_start * 1000.0 / SAMPLE_RATE
            return self._advance(chunk, pcm)

    def cancel(self) -> None:
        """Stop every part; the current one still ends with its final (cancelled) chunk."""
        if self.finished:
            return
        self._cancelled = True
        for index, stream in list(self._streams.items()):
            stream.cancel()
            if index != self.part:
                del self._streams[index]

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()

    # -- parts -----------------------------------------------------------------------------
    def _next_speech(self, start: int) -> int | None:
        return next((i for i in range(start, len(self.parts)) if isinstance(self.parts[i], SynthesisRequest)), None)

    def _submit(self, index: int) -> ChunkStream:
        stream = ChunkStream(self._engine, self.parts[index], self._metrics, high_water=self._high_water,
                             first_audio_metric=index == self._next_speech(0))
        stream.tempo = TempoStretch(self._stretch) if self._stretch is not None else None
        stream.clock, stream.count_gaps = self._clock, self._count_gaps
        stream.start()
        self._streams[index] = stream
        return stream

    def _prefetch(self) -> None:
        """The next utterance, submitted while this one is audible (the engine may refuse it now:
        it is asked again when it is needed)."""
        upcoming = self._next_speech(self.part + 1)
        if upcoming is None or upcoming in self._streams:
            return
        try:
            self._submit(upcoming)
        except EngineError:
            pass

    async def _submit_when_possible(self, index: int) -> ChunkStream | None:
        while not self._cancelled:
            try:
                return self._submit(index)
            except EngineOverloaded as exc:  # the queue is full now: this text is already being spoken
                await asyncio.sleep(min(RESUBMIT_MAX_WAIT_S, max(0.05, exc.retry_after_s)))
            except EngineError:
                return None
        return None

    def _shape(self, pcm: np.ndarray, part_ends: bool) -> np.ndarray:
        """The current part's audio with its seams faded: its first samples fade in (after an
        earlier part), its last ones are held until it ends and fade out (before a later part)."""
        pcm = np.asarray(pcm, dtype=np.float32)
        if self._fade_in and pcm.size:
            n = min(self._fade_in, pcm.size)
            done = SEAM_FADE_SAMPLES - self._fade_in
            pcm = pcm.copy()
            pcm[:n] *= np.arange(done + 1, done + n + 1, dtype=np.float32) / (SEAM_FADE_SAMPLES + 1)
            self._fade_in -= n
        audio = np.concatenate([self._held, pcm]) if self._held.size else pcm
        if not part_ends:
            keep = min(SEAM_FADE_SAMPLES, audio.size)
            self._held = audio[audio.size - keep:]
            return audio[: audio.size - keep]
        self._held = np.zeros(0, np.float32)
        if self.part + 1 < len(self.parts) and audio.size:  # a later part follows: fade to silence
            n = min(SEAM_FADE_SAMPLES, audio.size)
            audio = audio.copy()
            audio[audio.size - n:] *= np.arange(n, 0, -1, dtype=np.float32) / (n + 1)
        return audio

    def _advance(self, ended: AudioChunk, pcm: np.ndarray) -> AudioChunk:
        """The current part ended (its last audio ``pcm``): the next part starts; the chunk that
        says so (with ``truncated``), or the final one after the last part."""
        self.parts_done += 1
        self.part += 1
        self._fade_in = fade_in_after(self.parts[self.part - 1])
        self._part_start = self._samples + pcm.size
        if self.part >= len(self.parts):
            return self._end(pcm=pcm, truncated=ended.truncated, timing=ended.timing)
        return self._out(ended, pcm, truncated=ended.truncated)

    def _pause_chunk(self, pause: Pause) -> AudioChunk:
        left = self._pause_left
        if left is None:
            left = int(round(pause.seconds * SAMPLE_RATE))
        n = min(left, PAUSE_CHUNK_SAMPLES)
        left -= n
        self._pause_left = left if left > 0 else None
        if left > 0:
            return self._silence(n)
        self.parts_done += 1
        self.part += 1
        self._fade_in = fade_in_after(pause)
        self._part_start = self._samples + n
        if self.part >= len(self.parts):
            return self._end(pcm=np.zeros(n, np.float32))
        self._prefetch_after_pause()
        return self._silence(n)

    def _prefetch_after_pause(self) -> None:
        upcoming = self._next_speech(self.part)
        if upcoming is not None and upcoming not in self._streams:
            try:
                self._submit(upcoming)
            except EngineError:
                pass

    def _silence(self, n: int) -> AudioChunk:
        pcm = np.zeros(n, np.float32)
        if self._clock is not None:
            self._clock.add(n, asyncio.get_running_loop().time(), count=False)
        return self._chunk(pcm, is_final=False)

    # -- chunks out --------------------------------------------------------------------------
    def _chunk(self, pcm: np.ndarray, is_final: bool, **fields) -> AudioChunk:
        chunk = AudioChunk(request_id=self._request_id, index=self._index, pcm=pcm, sample_rate=SAMPLE_RATE,
                           frames_done=self._frames, frames_total=self._frames, is_final=is_final, **fields)
        self._index += 1
        self._samples += pcm.size
        return chunk

    def _out(self, chunk: AudioChunk, pcm: np.ndarray, truncated: str | None = None) -> AudioChunk:
        done = self._frames + (0 if chunk.is_final else chunk.frames_done)
        out = self._chunk(pcm, is_final=False, timing=chunk.timing, text=chunk.text, truncated=truncated)
        return replace(out, frames_done=done, frames_total=max(done, out.frames_total))

    def _end(self, pcm: np.ndarray | None = None, error: str | None = None, frames: int = 0,
             truncated: str | None = None, timing=None) -> AudioChunk:
        """The final chunk: the last audio, the whole text's word times, or the error that ended it."""
        for stream in self._streams.values():
            stream.cancel()
        self._streams.clear()
        self.finished = True
        self._frames += frames
        pcm = np.zeros(0, np.float32) if pcm is None else pcm
        alignment = self._merged_alignment(self._samples + pcm.size) if error is None else None
        return self._chunk(pcm, is_final=True, error=error, truncated=truncated, alignment=alignment, timing=timing)

    def _merged_alignment(self, samples: int) -> Alignment | None:
        """Every part's word times on the whole stream's clock (``samples`` long); None unless
        every part was aligned."""
        if not self._alignments or not self._aligned_all:
            return None
        first = self._alignments[0][0]
        words: list[WordTimestamp] = []
        for alignment, offset_ms in self._alignments:
            words += alignment.scaled(1.0, offset_ms).words
        return Alignment(first.text, first.language, samples * 1000.0 / SAMPLE_RATE, tuple(words))

    def _in_text(self, alignment: Alignment | None) -> Alignment | None:
        """The current part's word times with their character spans in the plan's text."""
        if alignment is None:
            return None
        return in_source(alignment, self._plan.text, self._plan.parts[self.part].start)


__all__ = ["SEAM_FADE_SAMPLES", "UtteranceSequence", "fade_in_after"]
