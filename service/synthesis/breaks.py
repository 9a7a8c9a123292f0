"""The ``<break>`` pause tag (the SSML subset docs/API.md states), read by a scanner whose work is
linear in the text by construction.

    split_breaks('Hi. <break time="500ms"/> There.')   # -> ["Hi. ", Pause(0.5), " There."]
    split_breaks('Hi <break time="abc"/>')              # -> ApiError(400, "invalid_field", "text: ...")

A break tag is ``<break`` (ASCII, any case) followed by whitespace, ``/`` or ``>``, closed by its
``>`` within ``MAX_TAG_CHARS`` characters. Its attributes (whitespace before each) are ``time`` (a number of ``s`` or ``ms``: ``"500ms"``, ``"1.5s"``, ``".5s"``;
quoted or not) and ``strength`` (SSML's ``none`` .. ``x-strong``; with ``time`` too, ``time``
decides, as SSML says); neither is SSML's default break, ``medium``. ``<break .../>``,
``<break ...>`` and ``<break ...></break>`` are the same pause. Every tag is at most
``MAX_BREAK_SECONDS`` of silence whatever its unit; one over it, with another attribute, a
value that is not a duration or strength, no closing ``>``, or a
``</break>`` that does not close a ``<break>`` right before it is a 400 naming the tag and its
offset. Any other tag (``<emphasis>``, ``<breakfast>``) is text, read as written (as ElevenLabs
and Cartesia do).

Why a scanner and not a pattern: a backtracking regex over optional whitespace runs (the old
``<break\\s+time\\s*=\\s*...``) is cubic on ``<break time=1s`` followed by spaces that never
reach ``>``: 1,600 spaces took 2.9 s of the event loop. Here every ``<`` costs O(1) unless it
opens a break tag, whose reading stops at ``MAX_TAG_CHARS``: each character is looked at a
bounded number of times.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from service.errors import ApiError

MAX_BREAK_SECONDS = 10.0  # one tag's silence at most, in any unit (ElevenLabs allows 3 s)
MAX_TAG_CHARS = 128  # a break tag is closed by its ">" within this many characters
# SSML's strengths, at the durations Azure's speech service documents (x-weak 250 ms ... x-strong 1250 ms)
STRENGTHS = {"none": 0.0, "x-weak": 0.25, "weak": 0.5, "medium": 0.75, "strong": 1.0, "x-strong": 1.25}
DEFAULT_STRENGTH = "medium"  # a bare <break/>
UNITS = {"ms": 1000.0, "s": 1.0}
OPEN, CLOSE = "<break", "</break"
SPACES = " \t\r\n\f\v"  # ASCII whitespace (XML's four and \f \v; not Unicode's other spaces)
_SPACE = frozenset(SPACES)
_DELIMITERS = _SPACE | frozenset("/>")  # what may follow "<break"
_NAME_ENDS = _SPACE | frozenset("=/><\"'")
_VALUE_ENDS = _SPACE | frozenset("/><")


@dataclass(frozen=True)
class Pause:
    """Silence between utterances (``<break time="500ms"/>``), in seconds."""

    seconds: float


def split_breaks(text: str) -> list[str | Pause]:
    """``text`` cut at its break tags, each a :class:`Pause`; the text between them as it is
    (empty pieces dropped). ApiError(400) for a malformed or out-of-range tag."""
    return _Scanner(text).pieces()


def break_tag(pause: Pause) -> str:
    """The tag that asks for ``pause`` (read back as exactly the same seconds)."""
    return f'<break time="{Decimal(repr(pause.seconds)):f}s"/>'


class BreakTags:
    """:func:`split_breaks` for text arriving in pieces (live text): a break tag cut between
    pieces is held back until it is complete, and a ``</break>`` may arrive after its tag.
    :meth:`feed` raises ApiError(400) for a malformed tag (what it held is dropped with it)."""

    def __init__(self) -> None:
        self.held = ""  # the start of a tag, waiting for its end
        self._after_open = False  # the text so far ended in "<break ...>" (and whitespace)

    def feed(self, text: str) -> list[str | Pause]:
        text, self.held = self.held + text, ""
        cut = _unfinished_tag(text)
        scanner = _Scanner(text, after_open=self._after_open, end=cut)
        try:
            pieces = scanner.pieces()
        except ApiError:
            self._after_open = False
            raise
        self.held, self._after_open = text[cut:], scanner.ends_open
        return pieces

    def take_rest(self) -> list[str | Pause]:
        """The text ended: what was held, read as complete text (the start of a break tag that
        never ended: ApiError(400); anything else is text)."""
        rest, self.held = self.held, ""
        after_open, self._after_open = self._after_open, False
        return _Scanner(rest, after_open=after_open).pieces()

    def drop(self) -> None:
        """Forget what was held (a cancel)."""
        self.held, self._after_open = "", False


def _tag_start(text: str, i: int) -> str | None:
    """OPEN or CLOSE when a break tag starts at ``text[i]`` (a "<"), else None: "<break" (ASCII,
    any case) must be followed by whitespace, "/", ">" or the end of the text ("<breakfast>" is text)."""
    for name in (OPEN, CLOSE):
        end = i + len(name)
        if text[i:end].lower() == name and text[i:end].isascii() and (end == len(text) or text[end] in _DELIMITERS):
            return name
    return None


def _unfinished_tag(text: str) -> int:
    """Where a break tag that more text may still complete starts (``len(text)`` if none): the
    last "<" of the last MAX_TAG_CHARS characters, when no ">" follows it and what follows could
    begin a break tag."""
    i = text.rfind("<", max(0, len(text) - MAX_TAG_CHARS))
    if i < 0 or ">" in text[i:]:
        return len(text)
    tail = text[i:].lower()
    if _tag_start(text, i) is not None or OPEN.startswith(tail) or CLOSE.startswith(tail):
        return i
    return len(text)


def _blank(text: str) -> bool:
    return not text.strip(SPACES)


class _Scanner:
    """One pass over ``text[:end]`` (what follows ``end``, an unfinished tag, only tells whether a
    "<break" just before it is followed by a delimiter); ``after_open``: it continues text that
    ended in "<break ...>"."""

    def __init__(self, text: str, after_open: bool = False, end: int | None = None):
        self.text = text
        self.end = len(text) if end is None else end
        self._open_end: int | None = 0 if after_open else None  # where the last open "<break ...>" ended
        self.ends_open = after_open  # (once read) the text ends in an open "<break ...>" and whitespace

    def _follows_open(self, i: int) -> bool:
        """Only whitespace separates ``text[i]`` from an open "<break ...>" before it."""
        end = self._open_end
        return end is not None and _blank(self.text[end:i])

    def pieces(self) -> list[str | Pause]:
        text, end, out, start, i = self.text, self.end, [], 0, 0
        while (i := text.find("<", i, end)) >= 0:
            name = _tag_start(text, i)
            if name is None:
                i += 1
                continue
            out.append(text[start:i])
            tag = _Tag(text, i)
            if name == CLOSE:
                if not self._follows_open(i):
                    raise tag.error("a </break> must follow its <break ...> (a break holds no text)")
                i, self._open_end = i + tag.read_close(), None
            else:
                pause, length, self_closed = tag.read_open()
                out.append(pause)
                i += length
                self._open_end = None if self_closed else i
            start = i
        out.append(text[start:end])
        self.ends_open = self._follows_open(end)
        return [piece for piece in out if isinstance(piece, Pause) or piece]


class _Tag:
    """One break tag, read from its "<" within MAX_TAG_CHARS characters (its ``window``)."""

    def __init__(self, text: str, at: int):
        self.at = at
        self.window = text[at:at + MAX_TAG_CHARS]
        self.cut = len(text) > at + MAX_TAG_CHARS  # the text goes on past the window

    def _skip_space(self, j: int) -> int:
        window = self.window
        while j < len(window) and window[j] in _SPACE:
            j += 1
        return j

    def _run(self, j: int, ends: frozenset) -> int:
        """The end of the run of characters from ``j`` not in ``ends``."""
        window = self.window
        while j < len(window) and window[j] not in ends:
            j += 1
        return j

    def read_close(self) -> int:
        """The length of this "</break>"."""
        j = self._skip_space(len(CLOSE))
        if j < len(self.window) and self.window[j] == ">":
            return j + 1
        raise self.error("</break> is not closed by >")

    def read_open(self) -> tuple[Pause, int, bool]:
        """This "<break ...>": its pause, its length and whether it closed itself ("/>")."""
        window = self.window
        attributes: dict[str, str] = {}
        j = len(OPEN)
        while True:
            before, j = j, self._skip_space(j)
            if j >= len(window):
                raise self.error(f"no closing > within {MAX_TAG_CHARS} characters" if self.cut else "no closing >")
            if window[j] == ">":
                return self._pause(attributes), j + 1, False
            if window.startswith("/>", j):
                return self._pause(attributes), j + 2, True
            name_end = self._run(j, _NAME_ENDS)
            if name_end == j:
                raise self.error(f"unexpected {window[j]!r}")
            if j == before:
                raise self.error("attributes are separated by whitespace")
            name = window[j:name_end].lower()
            if name not in ("time", "strength") or not window[j:name_end].isascii():
                raise self.error(f"unknown attribute {window[j:name_end]!r} (a break takes time or strength)")
            if name in attributes:
                raise self.error(f"{name} is given twice")
            j = self._skip_space(name_end)
            if j >= len(window) or window[j] != "=":
                raise self.error(f'{name} has no value ({name}="...")')
            attributes[name], j = self._value(self._skip_space(j + 1))

    def _value(self, j: int) -> tuple[str, int]:
        window = self.window
        if j < len(window) and window[j] in "\"'":
            end = window.find(window[j], j + 1)
            if end < 0:
                raise self.error(f"the quote {window[j]} of a value is not closed")
            return window[j + 1:end].strip(SPACES), end + 1
        end = self._run(j, _VALUE_ENDS)
        return window[j:end], end

    def _pause(self, attributes: dict[str, str]) -> Pause:
        """SSML: ``time`` decides the length when both are given (``strength`` must still be one)."""
        strength = self._strength(attributes.get("strength", DEFAULT_STRENGTH))
        return Pause(self._seconds(attributes["time"]) if "time" in attributes else strength)

    def _strength(self, value: str) -> float:
        seconds = STRENGTHS.get(value.lower()) if value.isascii() else None
        if seconds is None:
            raise self.error(f"strength {value!r} is not one of {', '.join(STRENGTHS)}")
        return seconds

    def _seconds(self, value: str) -> float:
        lowered = value.lower()
        unit = "ms" if lowered.endswith("ms") else "s" if lowered.endswith("s") else None
        number = value[: len(value) - len(unit)] if unit else value
        whole, dot, fraction = number.partition(".")
        digits = whole + fraction
        if unit is None or not digits.isascii() or not digits.isdigit() or (dot and not fraction):
            raise self.error(f'time {value!r} is not a duration such as "500ms" or "1.5s" (s or ms, no sign)')
        seconds = float(number) / UNITS[unit]
        if seconds > MAX_BREAK_SECONDS:
            raise self.error(f"time {value!r} is over the {MAX_BREAK_SECONDS:g} s a break may pause")
        return seconds

    def error(self, problem: str) -> ApiError:
        shown = self.window[:40] + ("..." if len(self.window) > 40 or self.cut else "")
        return ApiError(400, "invalid_field", f"text: the break tag at offset {self.at} ({shown!r}): {problem}; "
                                              f'write <break time="500ms"/> (s or ms, at most '
                                              f'{MAX_BREAK_SECONDS:g} s) or <break strength="medium"/>')


__all__ = ["BreakTags", "MAX_BREAK_SECONDS", "MAX_TAG_CHARS", "Pause", "STRENGTHS", "break_tag", "split_breaks"]
