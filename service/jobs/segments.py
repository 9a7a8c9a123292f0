"""A job's segments: the utterances and pauses its text is spoken in (service/synthesis/plan.py),
each kept in the store as it finishes, so that a job interrupted by a restart or a replica's death
resumes at the next one instead of starting over, and its captions span the whole text.

    key = plan_key(parts)                                   # the plan, as the store knows it
    kept = await store.start_plan(job.id, token, key, len(parts))
    log = SegmentLog(store, job.id, token, parts, kept)
    await log.replay(write)                                 # the kept segments' audio, in order
    log.add(pcm) ... await log.end_segment(alignment)       # as the rest is spoken
    words = log.captions()                                  # the whole job's word times

A segment keeps its audio as played (its seams already faded: service/synthesis/sequence.py) in
float32, so a resumed job's audio is the audio an uninterrupted run would have made. A plan that
changed between attempts (another ``--utterance-max-frames``, another release) starts over.
"""

from __future__ import annotations

import hashlib
import json
from typing import Awaitable, Callable

import numpy as np

from engines.contract import SAMPLE_RATE, Alignment
from service.jobs.store.base import JobStore, Segment
from service.synthesis.plan import Part, Pause
from service.synthesis.timestamps import shift_words, words_json


def plan_key(parts: tuple[Part, ...]) -> str:
    """A digest of a plan: its utterances' texts and where they start in the job's text, and its
    pauses, in order."""
    spelled = [{"pause": p.seconds} if isinstance(p, Pause) else [p.text, p.start] for p in parts]
    return hashlib.sha256(json.dumps(spelled, ensure_ascii=False).encode()).hexdigest()


class SegmentLog:
    """One attempt's record of its job's segments: those kept before it and those it finishes."""

    def __init__(self, store: JobStore, job_id: str, token: str, parts: list[Part], kept: list[Segment]):
        self.store, self.job_id, self.token = store, job_id, token
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
            data = await self.store.read_segment(self.job_id, segment.index)
            if data is None:
                raise RuntimeError(f"job {self.job_id}: kept segment {segment.index} is gone")
            await write(np.frombuffer(data, dtype="<f4"))

    def add(self, pcm: np.ndarray) -> None:
        if pcm.size:
            self._audio.append(np.asarray(pcm, dtype=np.float32))

    async def end_segment(self, alignment: Alignment | None) -> bool:
        """The segment being spoken ended (its word times from its start, its characters in the
        job's text): kept in the store;
        False when this attempt no longer holds the job. Safe to call again after a failure."""
        pcm = np.concatenate(self._audio) if self._audio else np.zeros(0, np.float32)
        words = words_json(alignment) if alignment is not None else None
        if not await self.store.put_segment(self.job_id, self.token, self.done, int(pcm.size),
                                            pcm.astype("<f4").tobytes(), json.dumps(words) if words else None):
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


__all__ = ["SegmentLog", "plan_key"]
