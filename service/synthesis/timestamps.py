"""Word timestamps as clients see them: the engine's :class:`~engines.contract.Alignment` of a
piece (times from the start of the piece's audio) placed on the stream's clock, and written as
word lists, per-character arrays (ElevenLabs), seconds (Cartesia) and captions (SRT, WebVTT).

Character times: a unit's characters share its span evenly (the aligner times units, not
characters); a character between units (a space, punctuation) takes the gap between them,
or no time at all when there is none. Nothing is invented beyond the aligner's unit times.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from engines.contract import Alignment, WordTimestamp
from service.synthesis.schema import JsonError, Strict, parse_json

CAPTION_FORMATS = ("json", "srt", "vtt")
CAPTION_WORDS = 7  # words per caption cue at most
CAPTION_SECONDS = 3.5  # a cue's length at most
MAX_WORD_CHARS = 1024  # one timed unit of text (the aligner's words are far shorter)
MAX_STORED_WORDS = 1 << 20


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


def in_source(alignment: Alignment, source: str, start: int) -> Alignment:
    """An utterance's word times with their character spans in ``source``, the text the client
    sent, where the utterance's text starts at ``start`` (service/synthesis/plan.py: the same
    characters with only whitespace changed, e.g. a blank line become one space): the
    alignment's text is ``source``, and ``source[w.char_start:w.char_end]`` is each word."""
    text = alignment.text
    if source.startswith(text, start):  # as written: only moved
        return Alignment(source, alignment.language, alignment.duration_ms, tuple(
            WordTimestamp(w.text, w.start_ms, w.end_ms, w.char_start + start, w.char_end + start)
            for w in alignment.words))
    rank = [0] * (len(text) + 1)  # rank[j]: non-whitespace characters in text[:j]
    for j, ch in enumerate(text):
        rank[j + 1] = rank[j] + (not ch.isspace())
    positions = []  # where the utterance's k-th non-whitespace character is in source
    i = start
    while len(positions) < rank[-1] and i < len(source):
        if not source[i].isspace():
            positions.append(i)
        i += 1
    last = len(positions) - 1

    def at(k: int) -> int:
        return positions[min(k, last)] if positions else start

    words = []
    for w in alignment.words:
        first = at(rank[w.char_start])
        end = at(rank[w.char_end] - 1) + 1 if rank[w.char_end] else start
        words.append(WordTimestamp(w.text, w.start_ms, w.end_ms, first, max(first, end)))
    return Alignment(source, alignment.language, alignment.duration_ms, tuple(words))


class StoredWord(Strict):
    """One entry of :func:`words_json` as a job's captions keep it: what a store hands back is
    checked against this before it is served or copied (it may have been written by anyone)."""

    word: str = Field(max_length=MAX_WORD_CHARS)
    start_ms: float = Field(ge=0)
    end_ms: float = Field(ge=0)
    char_start: int = Field(ge=0)
    char_end: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> "StoredWord":
        if self.end_ms < self.start_ms or self.char_end < self.char_start:
            raise ValueError("ends before it starts")
        return self


_STORED_WORDS = TypeAdapter(list[StoredWord])


def parse_words(stored: str) -> list[dict]:
    """A job's stored word timestamps (the JSON of :func:`words_json`), checked; ValueError
    naming what is wrong when they are not that."""
    try:
        data = parse_json(stored)
        if not isinstance(data, list) or len(data) > MAX_STORED_WORDS:
            raise ValueError(f"not a list of at most {MAX_STORED_WORDS} words")
        return [w.model_dump() for w in _STORED_WORDS.validate_python(data)]
    except JsonError as exc:
        raise ValueError(f"words: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise ValueError(f"words[{where}]: {first.get('msg', 'invalid')}"[:200]) from None


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


__all__ = ["CAPTION_FORMATS", "StoredWord", "TimestampsField", "cartesia_words", "char_times", "cues", "in_source",
           "parse_words", "shift_words", "srt", "vtt", "words_json"]
