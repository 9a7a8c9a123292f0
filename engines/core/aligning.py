"""The aligning stage: word timestamps on the engine thread, behind audio.

A request that asks for word times has its audio kept (:class:`KeptAudio`, on its
``RequestState``) from its chunks as they are delivered, as 16-bit samples (what a client hears on
the wire; half the memory of float32), and only up to what the aligner accepts (``max_seconds``):
a longer one cannot be timed, so its audio is dropped the moment it grows past that, and its
request ends without word times. Once all its audio is delivered the request is ALIGNING
(core/scheduler.py); the worker runs one bounded batch of those per step, only while no
realtime request waits for its first audio (``Scheduler.first_audio_waiting``), and ends each
with its final chunk. The kept audio is freed when its request ends. The aligner
(engines/pipelines/aligner) gives unit times from the start of that audio; times past the
audio's end (an untrained or unsure model) are clamped to it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import numpy as np

from engines.contract import SAMPLE_RATE, Alignment, WordTimestamp

log = logging.getLogger("streamvox.worker")

BATCH_REQUESTS = 4  # requests aligned together at most
BATCH_SECONDS = 30.0  # audio seconds in one batch at most (a longer request goes alone)

_HANGUL = re.compile("[\uac00-\ud7af\u1100-\u11ff]")
_KANA = re.compile("[\u3040-\u30ff]")
_HAN = re.compile("[\u4e00-\u9fff\u3400-\u4dbf]")


def alignment_language(language: str, text: str, supported: tuple[str, ...]) -> str | None:
    """The aligner language for a request: its own when the aligner knows it, else (``Auto``,
    or a model without a language field) guessed from the script: Hangul Korean, kana
    Japanese, Han Chinese, anything else English (whose split - whitespace words - is the
    official one for every space-separated script). None when the aligner cannot time it."""
    lang = (language or "").strip().lower()
    if lang not in supported:
        if _HANGUL.search(text):
            lang = "korean"
        elif _KANA.search(text):
            lang = "japanese"
        elif _HAN.search(text):
            lang = "chinese"
        else:
            lang = "english"
    return lang if lang in supported else None


@dataclass
class KeptAudio:
    """A request's audio kept for its word times, and the text and language it is aligned with."""

    text: str
    language: str | None
    max_samples: int = int(180 * SAMPLE_RATE)  # the aligner's max_seconds
    audio: list[np.ndarray] = field(default_factory=list)  # int16 chunks
    samples: int = 0  # the request's audio so far, kept or not
    too_long: bool = False  # past max_samples: nothing kept, never aligned

    def keep(self, pcm: np.ndarray) -> None:
        """Keep a delivered chunk of float PCM (as int16), unless the audio outgrew the aligner."""
        self.samples += pcm.size
        if self.too_long:
            return
        if self.samples > self.max_samples:
            self.too_long = True
            self.audio.clear()
            return
        self.audio.append((np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16))

    def pcm(self) -> np.ndarray:
        """The kept audio as float32 for the aligner."""
        if not self.audio:
            return np.zeros(0, np.float32)
        return np.concatenate(self.audio).astype(np.float32) / 32767.0


class Aligning:
    """The stage: what it keeps of a request as its audio is delivered, the batches it takes of
    the ALIGNING requests (the scheduler's ``aligning``, oldest first), and their alignments."""

    def __init__(self, aligner):
        self.aligner = aligner
        self.languages = tuple(dict.fromkeys(aligner.capabilities().languages))
        self.max_seconds = aligner.capabilities().max_seconds
        self.audio_seconds = 0.0  # audio given to the aligner so far (benchmarks: its cost per second)

    def track(self, state) -> None:
        """Keep the audio of an admitted request (core.scheduler.RequestState) if it asked for word times."""
        request = state.request
        if request.timestamps:
            text = request.text if request.text_feed is None else ""  # a live one's: once complete
            state.kept_audio = KeptAudio(text, None, max_samples=int(self.max_seconds * SAMPLE_RATE))

    @staticmethod
    def keep(state, pcm: np.ndarray) -> bool:
        """A chunk of the request's audio was delivered: kept if it is tracked (True)."""
        kept = state.kept_audio
        if kept is None:
            return False
        kept.keep(pcm)
        return True

    def complete(self, state) -> None:
        """All its audio is delivered: the text it is aligned with (a live one's, now whole) and
        the language."""
        kept, request = state.kept_audio, state.request
        if request.text_feed is not None:
            kept.text = request.text_feed.read(0)[0]
        kept.language = alignment_language(request.language, kept.text, self.languages)

    @staticmethod
    def batch(waiting: list) -> list:
        """The oldest of ``waiting`` (ALIGNING requests) to align together, bounded in count and
        audio seconds (a longer one goes alone)."""
        batch, seconds = [], 0.0
        for state in waiting:
            length = state.kept_audio.samples / SAMPLE_RATE
            if batch and (len(batch) >= BATCH_REQUESTS or seconds + length > BATCH_SECONDS):
                break
            batch.append(state)
            seconds += length
        return batch

    def run(self, waiting: list, hook) -> list[tuple]:
        """One bounded batch of ``waiting`` (ALIGNING requests, oldest first): (request, its
        alignment) each; None for one that could not be aligned or whose ``hook(request_id,
        "align")`` raised (a fault test's injected failure)."""
        batch, live = self.batch(waiting), []
        for state in batch:
            try:
                hook(state.request_id, "align")
                live.append(state)
            except Exception as exc:
                log.warning("request %s: alignment failed: %s", state.request_id, exc)
        aligned = dict(zip(map(id, live), self.align(live) if live else []))
        return [(state, aligned.get(id(state))) for state in batch]

    def align(self, states: list) -> list[Alignment | None]:
        """Each request's alignment (None: it could not be aligned; logged, never invented)."""
        from engines.pipelines.aligner import AlignItem

        batch: list[KeptAudio] = [s.kept_audio for s in states]
        results: list[Alignment | None] = [None] * len(batch)
        runnable = [i for i, p in enumerate(batch) if p.language is not None and not p.too_long
                    and p.samples / SAMPLE_RATE <= self.max_seconds]
        self.audio_seconds += sum(batch[i].samples for i in runnable) / SAMPLE_RATE
        items = [AlignItem(batch[i].pcm(), batch[i].text, batch[i].language, SAMPLE_RATE) for i in runnable]
        try:
            words = self.aligner.align_batch(items)
        except Exception as exc:  # one bad item refuses the batch: align them one by one
            log.warning("aligning %d requests together failed (%s); one by one", len(items), exc)
            words = []
            for item in items:
                try:
                    words.extend(self.aligner.align_batch([item]))
                except Exception as one:
                    log.warning("a request could not be aligned: %s: %s", type(one).__name__, one)
                    words.append(None)
        for i, times in zip(runnable, words):
            if times is not None:
                results[i] = self._alignment(batch[i], times)
        return results

    @staticmethod
    def _alignment(kept: KeptAudio, times) -> Alignment:
        duration = kept.samples * 1000.0 / SAMPLE_RATE
        words, last = [], 0.0
        for t in times:  # the aligner's times are non-decreasing; keep them so after clamping
            start = min(max(float(t.start_ms), last), duration)
            end = min(max(float(t.end_ms), start), duration)
            words.append(WordTimestamp(t.text, start, end, t.char_start, t.char_end))
            last = end
        return Alignment(kept.text, kept.language or "", duration, tuple(words))
