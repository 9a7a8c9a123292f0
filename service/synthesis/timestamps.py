"""Word timestamps as clients see them: the engine's :class:`~engines.contract.Alignment` of a
piece (times from the start of the piece's audio) placed on the stream's clock, and written as
word lists, per-character arrays (ElevenLabs), seconds (Cartesia) and captions (SRT, WebVTT).

Character times: a unit's characters share its span evenly (the aligner times units, not
characters); a character between units (a space, punctuation) takes the gap between them,
or no time at all when there is none. Nothing is invented beyond the aligner's unit times.
"""

from __future__ import annotations

from typing import ClassVar

from engines.contract import Alignment
from service.synthesis.schema import Strict

CAPTION_FORMATS = ("json", "srt", "vtt")
CAPTION_WORDS = 7  # words per caption cue at most
CAPTION_SECONDS = 3.5  # a cue's length at most


class TimestampsField(Strict):
    """``timestamps``: true asks for word timestamps (WebSocket ``session.config``, speech SSE)."""

    timestamps: bool | None = None

    MESSAGES: ClassVar[dict[str, str]] = {"timestamps": "must be true or false"}


def words_json(alignment: Alignment, offset_ms: float = 0.0) -> list[dict]:
    """``[{"word", "start_ms", "end_ms", "char_start", "char_end"}]`` on the stream's clock."""
    return [{"word": w.text, "start_ms": round(w.start_ms + offset_ms, 1), "end_ms": round(w.end_ms + offset_ms, 1),
             "char_start": w.char_start, "char_end": w.char_end} for w in alignment.words]


def shift_words(words: list[dict], offset_ms: float, char_offset: int) -> list[dict]:
    """A piece's :func:`words_json` placed later in a longer text: times by ``offset_ms``,
    character spans by ``char_offset`` (a job's segments, service/jobs/segments.py)."""
    return [{**w, "start_ms": round(w["start_ms"] + offset_ms, 1), "end_ms": round(w["end_ms"] + offset_ms, 1),
             "char_start": w["char_start"] + char_offset, "char_end": w["char_end"] + char_offset} for w in words]


def char_times(alignment: Alignment, offset_ms: float = 0.0) -> dict:
    """ElevenLabs' ``{chars, charStartTimesMs, charDurationsMs}`` for the piece's whole text."""
    text = alignment.text
    starts = [0.0] * len(text)
    durations = [0.0] * len(text)
    words = alignment.words
    previous_end = words[0].start_ms if words else 0.0
    cursor = 0
    for w in words:
        if cursor < w.char_start:  # between units (spaces, punctuation): the gap before this one
            gap = max(0.0, w.start_ms - previous_end) / (w.char_start - cursor)
            for k, i in enumerate(range(cursor, w.char_start)):
                starts[i], durations[i] = previous_end + k * gap, gap
        span = max(1, w.char_end - w.char_start)
        step = (w.end_ms - w.start_ms) / span
        for k, i in enumerate(range(w.char_start, w.char_end)):
            starts[i], durations[i] = w.start_ms + k * step, step
        previous_end, cursor = w.end_ms, w.char_end
    if cursor < len(text):  # after the last unit (punctuation, trailing silence): the rest of the audio
        tail = max(0.0, alignment.duration_ms - previous_end) / (len(text) - cursor)
        for k, i in enumerate(range(cursor, len(text))):
            starts[i], durations[i] = previous_end + k * tail, tail
    return {"chars": list(text), "charStartTimesMs": [round(s + offset_ms) for s in starts],
            "charDurationsMs": [round(d) for d in durations]}


def cartesia_words(alignment: Alignment, offset_ms: float = 0.0) -> dict:
    """Cartesia's ``word_timestamps``: ``{words, start, end}`` in seconds."""
    return {"words": [w.text for w in alignment.words],
            "start": [round((w.start_ms + offset_ms) / 1000, 3) for w in alignment.words],
            "end": [round((w.end_ms + offset_ms) / 1000, 3) for w in alignment.words]}


def cues(words: list[dict]) -> list[tuple[float, float, str]]:
    """Caption cues (start ms, end ms, text) of a word list: at most CAPTION_WORDS words and
    CAPTION_SECONDS each; a cue ends where its last word ends."""
    out, current = [], []
    for w in words:
        if current and (len(current) >= CAPTION_WORDS or w["end_ms"] - current[0]["start_ms"] > CAPTION_SECONDS * 1000):
            out.append(current)
            current = []
        current.append(w)
    if current:
        out.append(current)
    return [(c[0]["start_ms"], max(c[-1]["end_ms"], c[0]["start_ms"]), " ".join(w["word"] for w in c)) for c in out]


def _clock(ms: float, separator: str) -> str:
    total = max(0, int(round(ms)))
    hours, rest = divmod(total, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds, millis = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{separator}{millis:03d}"


def srt(words: list[dict]) -> str:
    return "".join(f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{text}\n\n"
                   for i, (a, b, text) in enumerate(cues(words), 1))


def vtt(words: list[dict]) -> str:
    return "WEBVTT\n\n" + "".join(f"{_clock(a, '.')} --> {_clock(b, '.')}\n{text}\n\n" for a, b, text in cues(words))


__all__ = ["CAPTION_FORMATS", "TimestampsField", "cartesia_words", "char_times", "cues", "shift_words", "srt", "vtt",
           "words_json"]
