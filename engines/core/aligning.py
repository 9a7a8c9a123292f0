"""Word timestamps on the engine thread: finished pieces wait here and are aligned in bounded
batches behind audio (the worker runs one batch per step, only while no realtime request
waits for its first audio - core/scheduler.py ``first_audio_pending``).

A piece is a request's text with all its audio, kept from its chunks as they are delivered,
as 16-bit samples (what a client hears on the wire; half the memory of float32), and only up to
what the aligner accepts (``max_seconds``): a longer piece cannot be timed, so its audio is
dropped the moment it grows past that, and its request ends without word times. A piece's
memory is freed when its request ends. The aligner (engines/pipelines/aligner) gives unit times
from the start of that audio; times past the audio's end (an untrained or unsure model) are
clamped to it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import numpy as np

from engines.contract import SAMPLE_RATE, Alignment, WordTimestamp

log = logging.getLogger("streamvox.worker")

BATCH_PIECES = 4  # pieces aligned together at most
BATCH_SECONDS = 30.0  # audio seconds in one batch at most (a longer piece goes alone)

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
class Piece:
    """A request's audio kept for its word times (it waits in the queue once finished)."""

    state: object  # core.scheduler.RequestState (its final chunk is delivered after alignment)
    text: str
    language: str | None
    max_samples: int = int(180 * SAMPLE_RATE)  # the aligner's max_seconds
    audio: list[np.ndarray] = field(default_factory=list)  # int16 chunks
    samples: int = 0  # the request's audio so far, kept or not
    too_long: bool = False  # past max_samples: nothing kept, never aligned

    def keep(self, pcm: np.ndarray) -> None:
        """Keep a delivered chunk of float PCM (as int16), unless the piece outgrew the aligner."""
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


class AlignQueue:
    """Pieces in arrival order; :meth:`run_batch` aligns the oldest ones (bounded)."""

    def __init__(self, aligner):
        self.aligner = aligner
        self.languages = tuple(dict.fromkeys(aligner.capabilities().languages))
        self.max_seconds = aligner.capabilities().max_seconds
        self.pieces: list[Piece] = []
        self.audio_seconds = 0.0  # audio given to the aligner so far (benchmarks: its cost per second)

    def __len__(self) -> int:
        return len(self.pieces)

    def add(self, piece: Piece) -> None:
        self.pieces.append(piece)

    def take_batch(self) -> list[Piece]:
        batch, seconds = [], 0.0
        for piece in self.pieces:
            length = piece.samples / SAMPLE_RATE
            if batch and (len(batch) >= BATCH_PIECES or seconds + length > BATCH_SECONDS):
                break
            batch.append(piece)
            seconds += length
        del self.pieces[:len(batch)]
        return batch

    def align(self, batch: list[Piece]) -> list[Alignment | None]:
        """Each piece's alignment (None: it could not be aligned; logged, never invented)."""
        from engines.pipelines.aligner import AlignItem

        results: list[Alignment | None] = [None] * len(batch)
        runnable = [i for i, p in enumerate(batch) if p.language is not None and not p.too_long
                    and p.samples / SAMPLE_RATE <= self.max_seconds]
        self.audio_seconds += sum(batch[i].samples for i in runnable) / SAMPLE_RATE
        items = [AlignItem(batch[i].pcm(), batch[i].text, batch[i].language, SAMPLE_RATE) for i in runnable]
        try:
            words = self.aligner.align_batch(items)
        except Exception as exc:  # one bad item refuses the batch: align them one by one
            log.warning("aligning %d pieces together failed (%s); one by one", len(items), exc)
            words = []
            for item in items:
                try:
                    words.extend(self.aligner.align_batch([item]))
                except Exception as one:
                    log.warning("a piece could not be aligned: %s: %s", type(one).__name__, one)
                    words.append(None)
        for i, times in zip(runnable, words):
            if times is not None:
                results[i] = self._alignment(batch[i], times)
        return results

    @staticmethod
    def _alignment(piece: Piece, times) -> Alignment:
        duration = piece.samples * 1000.0 / SAMPLE_RATE
        words, last = [], 0.0
        for t in times:  # the aligner's times are non-decreasing; keep them so after clamping
            start = min(max(float(t.start_ms), last), duration)
            end = min(max(float(t.end_ms), start), duration)
            words.append(WordTimestamp(t.text, start, end, t.char_start, t.char_end))
            last = end
        return Alignment(piece.text, piece.language or "", duration, tuple(words))
