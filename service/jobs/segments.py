"""A job's segments: the utterances and pauses its text is spoken in (service/synthesis/plan.py),
each kept in the store as it finishes, so that a job interrupted by a restart or a replica's death
resumes at the next one instead of starting over, and its captions span the whole text.

    key = plan_key(parts)                                   # the plan, as the store knows it
    kept = await store.start_plan(job.id, token, key, len(parts))
    log = SegmentLog(store, job.id, token, parts, kept, quota)
    await log.replay(write)                                 # the kept segments' audio, in order
    log.add(pcm) ... await log.end_segment(alignment, frames, progress)   # as the rest is spoken
    words = log.captions()                                  # the whole job's word times

A segment keeps its audio as played (its seams already faded: service/synthesis/sequence.py) as
the int16 samples the job's file holds (a job's audio is 16-bit at 24 kHz), quantized as that
file's encoder quantizes (:data:`FORMAT_ENCODINGS`): the float32 a replay hands the encoder gives
back exactly those samples, so a resumed job's file holds the audio an uninterrupted run would
have made, at half the space float32 took. Segments count against
``--jobs-disk-quota-mb`` as they are kept (service/jobs/quota.py). A plan that changed between
attempts (another ``--utterance-max-frames``, another release) starts over.
"""

from __future__ import annotations

import hashlib
import json
from typing import Awaitable, Callable

import numpy as np

from engines.contract import SAMPLE_RATE, Alignment
from service.jobs.quota import DiskQuota
from service.jobs.store.base import SEGMENT_F32, JobStore, Progress, Segment
from service.synthesis.audio import to_pcm16
from service.synthesis.plan import Part, Pause
from service.synthesis.timestamps import shift_words, words_json


# int16 per unit of float32 audio, by segment encoding: the WAV encoder's (to_pcm16: by 32767,
# clipped to +-1) and libsndfile's FLAC (by 32768, clipped to int16). int16 / scale maps back to
# the same int16 through the same encoder.
SEGMENT_SCALES = {"s16": 32767.0, "s16-flac": 32768.0}
FORMAT_ENCODINGS = {"wav": "s16", "flac": "s16-flac"}  # a job's response format -> its segments'


def segment_bytes(pcm: np.ndarray, encoding: str) -> bytes:
    """``pcm`` (float32) as a segment of ``encoding`` keeps it: the int16 its file holds."""
    if encoding == "s16":
        return to_pcm16(pcm)
    scaled = np.round(np.asarray(pcm, dtype=np.float32) * np.float32(SEGMENT_SCALES[encoding]))
    return np.clip(scaled, -32768, 32767).astype("<i2").tobytes()


def segment_pcm(data: bytes, encoding: str) -> np.ndarray:
    """A kept segment's audio as float32, from how it was stored."""
    if encoding in SEGMENT_SCALES:
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / np.float32(SEGMENT_SCALES[encoding])
    if encoding == SEGMENT_F32:  # kept before segments were int16
        return np.frombuffer(data, dtype="<f4")
    raise RuntimeError(f"kept segment in an unknown encoding {encoding[:16]!r}")


def plan_key(parts: tuple[Part, ...]) -> str:
    """A digest of a plan: its utterances' texts and where they start in the job's text, and its
    pauses, in order."""
    spelled = [{"pause": p.seconds} if isinstance(p, Pause) else [p.text, p.start] for p in parts]
    return hashlib.sha256(json.dumps(spelled, ensure_ascii=False).encode()).hexdigest()


class SegmentLog:
    """One attempt's record of its job's segments: those kept before it and those it finishes."""

    def __init__(self, store: JobStore, job_id: str, token: str, parts: list[Part], kept: list[Segment],
                 quota: DiskQuota | None = None, response_format: str = "wav"):
        self.store, self.job_id, self.token = store, job_id, token
        self.encoding = FORMAT_ENCODINGS[response_format]
        self.quota = quota or DiskQuota(store, 0)
        self.texts = [None if isinstance(p, Pause) else p.text for p in parts]
        self.kept = kept
        self.samples = [s.samples for s in kept]  # per finished segment
        self.words: list[list[dict] | None] = [json.loads(s.words) if s.words else None for s in kept]
        self._audio: list[np.ndarray] = []  # the segment being spoken

    @property
    def done(self) -> int:
        return len(self.samples)

    async def replay(self, write: Callable[[np.ndarray], Awaitable[None]]) -> None:
        """Hand each kept segment's audio to ``write``, in order (RuntimeError when one is gone)."""
        for segment in self.kept:
            stored = await self.store.read_segment(self.job_id, segment.index)
            if stored is None:
                raise RuntimeError(f"job {self.job_id}: kept segment {segment.index} is gone")
            await write(segment_pcm(*stored))

    def add(self, pcm: np.ndarray) -> None:
        if pcm.size:
            self._audio.append(np.asarray(pcm, dtype=np.float32))

    async def end_segment(self, alignment: Alignment | None, frames: int = 0, progress: Progress | None = None) -> bool:
        """The segment being spoken ended (its word times from its start, its characters in the
        job's text; the codec frames it took; the job's progress with it): kept in the store,
        within the quota (QuotaExceeded);
        False when this attempt no longer holds the job. Safe to call again after a failure."""
        pcm = np.concatenate(self._audio) if self._audio else np.zeros(0, np.float32)
        words = words_json(alignment) if alignment is not None else None
        data = segment_bytes(pcm, self.encoding)
        words_text = json.dumps(words) if words else None
        if not await self.quota.admit(len(data) + len(words_text or ""), lambda: self.store.put_segment(
                self.job_id, self.token, self.done, int(pcm.size), frames, data, words_text, self.encoding, progress)):
            return False
        self.samples.append(int(pcm.size))
        self.words.append(words)
        self._audio = []
        return True

    def captions(self) -> list[dict] | None:
        """Every spoken segment's word times on the job's clock (their character spans are in the
        job's text already: service/synthesis/sequence.py); None unless every spoken segment was timed."""
        out: list[dict] = []
        start = 0
        for text, samples, words in zip(self.texts, self.samples, self.words):
            if text is not None:
                if words is None:
                    return None
                out += shift_words(words, start * 1000.0 / SAMPLE_RATE, 0)
            start += samples
        return out or None


__all__ = ["FORMAT_ENCODINGS", "SegmentLog", "plan_key", "segment_bytes", "segment_pcm"]
