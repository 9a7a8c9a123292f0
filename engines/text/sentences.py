"""Sentence and clause splitting: the one text module both the engines and the service import.

* :func:`split_sentences` cuts an incrementally growing buffer into complete sentences (for
  streaming text input; :class:`SentenceSplitter` feeds it piece by piece);
* :func:`split_clauses` cuts a whole text into pieces no longer than a budget, at clause
  boundaries, never dropping text (the DiT's planner);
* :func:`pack_sentences` joins sentences into pieces of a budget (the service's utterances of
  long text).

Splitting is conservative: a missed boundary only makes an utterance longer, a wrong
one breaks prosody mid-sentence, so ambiguous cases are *not* split. Plain Python: no torch.
"""

from __future__ import annotations

import re
from typing import Callable

# --------------------------------------------------------------------------- sentences

_LATIN_TERMINATORS = ".!?…"
_CJK_TERMINATORS = "。！？"
_CLOSERS = "\"'”’)]}»"
_CJK_CLOSERS = "」』）”’"
# Words that end with a period without ending the sentence (compared lowercased).
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs e.g i.e cf fig approx dept est inc ltd co gen col lt sgt capt rev etc al"
    .split()
)
_WORD_BEFORE = re.compile(r"([A-Za-z]+(?:\.[A-Za-z]+)*)$")


def _is_abbreviation(text_before_period: str) -> bool:
    m = _WORD_BEFORE.search(text_before_period)
    if m is None:
        return False
    word = m.group(1)
    if word.lower() in _ABBREVIATIONS:
        return True
    if "." in word:  # "U.S", "a.m": dotted initials
        return True
    return len(word) == 1 and word.isupper()  # "J. Smith": an initial


def _boundary_end(buffer: str, i: int) -> int | None:
    """If a sentence provably ends at the terminator run starting at ``buffer[i]``,
    the index just past it (closers included); None when it does not or cannot be
    decided yet (the decision must not change when more text arrives).

    A Latin terminator is decided by the whitespace after it: ``"Hello there. "`` ends there
    (what comes next cannot undo it), ``"3.14"`` and ``"Dr. Smith"`` / ``"e.g. this"`` (a known
    abbreviation, an initial) never end. After an ellipsis or a closing quote or bracket the
    next word decides (``"Wait... and then"``, ``'"Really?" she asked'`` go on when it is
    lowercase), and a line break ends the sentence at once."""
    n = len(buffer)
    if buffer[i] in _CJK_TERMINATORS:
        j = i
        while j < n and buffer[j] in _CJK_TERMINATORS:
            j += 1
        # No whitespace is needed after CJK terminators: the sentence ends as soon as
        # the next visible character arrives (closing quotes stay with it), so that
        # "好。" + "」" + "X" splits exactly like "好。」X".
        while j < n and buffer[j] in _CJK_CLOSERS:
            j += 1
        return j if j < n else None
    j = i
    while j < n and buffer[j] in _LATIN_TERMINATORS:
        j += 1
    while j < n and buffer[j] in _CLOSERS:
        j += 1
    k = j
    while k < n and buffer[k].isspace():
        k += 1
    if k == j:
        return None  # no whitespace yet: "3." may become "3.5"
    if "\n" in buffer[j:k]:
        return j  # a line break after a terminator always ends the sentence
    run = buffer[i:j].rstrip(_CLOSERS)
    # (the word before the period is in the last few characters: never search the whole buffer)
    if run == "." and _is_abbreviation(buffer[max(0, i - 64):i]):
        return None  # "Dr. Smith", "e.g. this": never an end
    if ".." in run or "…" in run or run != buffer[i:j]:  # an ellipsis or a closer: the next word decides
        if k == n:
            return None
        if buffer[k].islower():
            return None  # "... and then", '"Really?" she asked': the sentence goes on
    return j


def split_sentences(buffer: str) -> tuple[list[str], str]:
    """Complete sentences at the front of ``buffer`` and the undecided rest.

    ``"Hello there. How are"`` -> ``(["Hello there."], " How are")``. Sentences are
    stripped of surrounding whitespace; the rest is returned verbatim so the caller
    can append the next piece of text to it. A blank line (``"\\n\\n"``) followed by
    text also ends a sentence. Feeding text piece by piece yields the same sentences
    as feeding it at once (:class:`SentenceSplitter` does that without re-reading the rest).
    """
    if not isinstance(buffer, str):
        raise TypeError(f"buffer must be str, got {type(buffer).__name__}")
    sentences, start, _ = _scan(buffer, 0)
    return sentences, buffer[start:]


def _reaches_end(buffer: str, i: int) -> bool:
    """Whether the terminators, closers and whitespace from ``buffer[i]`` run to its end: what
    decides them has not arrived yet."""
    n = len(buffer)
    while i < n and (buffer[i] in _LATIN_TERMINATORS or buffer[i] in _CJK_TERMINATORS or buffer[i] in _CLOSERS
                     or buffer[i] in _CJK_CLOSERS or buffer[i].isspace()):
        i += 1
    return i == n


def _scan(buffer: str, i: int) -> tuple[list[str], int, int]:
    """Sentences of ``buffer`` read from ``i`` (the text before it holds no sentence end and
    nothing undecided) -> (sentences, start of the rest, where the next read must begin: the
    first position whose decision waits for more text)."""
    sentences: list[str] = []
    start = 0
    n = len(buffer)
    resume: int | None = None
    while i < n:
        c = buffer[i]
        end: int | None = None
        if c in _LATIN_TERMINATORS or c in _CJK_TERMINATORS:
            end = _boundary_end(buffer, i)
            if end is None:  # skip the whole terminator run
                if resume is None and _reaches_end(buffer, i):
                    resume = i  # "3." may become "3.5" or end a sentence: read it again with more text
                while i < n and (buffer[i] in _LATIN_TERMINATORS or buffer[i] in _CJK_TERMINATORS):
                    i += 1
                continue
        elif c == "\n" and buffer.startswith("\n\n", i):
            k = i
            while k < n and buffer[k].isspace():
                k += 1
            if k == n:
                resume = i if resume is None else resume
                break  # undecided: the next text may still follow
            end = i
        if end is None:
            i += 1
            continue
        sentence = buffer[start:end].strip()
        if sentence:
            sentences.append(sentence)
        start = end
        resume = None  # everything before the new start is decided
        i = max(end, i + 1)
    if resume is None:
        resume = n - 1 if buffer.endswith("\n") else n  # a line break may become a blank line
    return sentences, start, max(resume, start)


class SentenceSplitter:
    """:func:`split_sentences` for text arriving in pieces: each piece costs its own length
    (plus an undecided tail, such as a terminator and the whitespace after it), never the
    whole text waiting for a sentence end.

        splitter = SentenceSplitter()
        splitter.feed("Hello there. How")   # -> ["Hello there."]; splitter.rest == " How"
        splitter.take_rest()                # -> " How" (input.done: the rest is spoken as it is)
    """

    def __init__(self) -> None:
        self.rest = ""
        self._resume = 0  # rest[:_resume] holds no sentence end and nothing undecided

    def feed(self, text: str) -> list[str]:
        if not text:
            return []
        self.rest += text
        sentences, start, resume = _scan(self.rest, self._resume)
        if start:
            self.rest = self.rest[start:]
        self._resume = resume - start
        return sentences

    def take_rest(self) -> str:
        rest, self.rest, self._resume = self.rest, "", 0
        return rest


# --------------------------------------------------------------------------- clauses

# After , ; : followed by a space ("1,000" stays whole), after CJK commas, and after a
# spaced dash ("yes — indeed").
_CLAUSE_BREAK = re.compile(r"(?<=[,;:])\s+|(?<=[，、；：])\s*|(?<=\s[—–])\s+")


def _is_cjk(ch: str) -> bool:
    return "\u3000" <= ch <= "\u9fff" or "\uf900" <= ch <= "\ufaff" or "\uff00" <= ch <= "\uffef"


def _join(a: str, b: str) -> str:
    """Join two pieces with a space, except between CJK characters (no spaces there)."""
    return a + b if _is_cjk(a[-1]) and _is_cjk(b[0]) else a + " " + b


def _pack(pieces: list[str], max_len: int, measure: Callable[[str], int]) -> list[str]:
    """Greedily join consecutive pieces while the result fits ``max_len``."""
    out: list[str] = []
    for p in pieces:
        if out and measure(_join(out[-1], p)) <= max_len:
            out[-1] = _join(out[-1], p)
        else:
            out.append(p)
    return out


def _hard_split(word: str, max_len: int, measure: Callable[[str], int]) -> list[str]:
    """Split one over-long word by characters (last resort; keeps every character): each piece
    the longest prefix of the rest that fits (one character at least), found by bisection, since
    a longer prefix never measures less: log(n) measures a piece, where growing it a character
    at a time took n (4,096 emoji planned as one word took ~100 ms of the GIL)."""
    out, rest = [], word
    while rest and measure(rest) > max_len:
        fits, over = 1, len(rest)  # rest[:fits] is a piece (it fits, or is one character); rest[:over] does not fit
        while over - fits > 1:
            mid = (fits + over) // 2
            if measure(rest[:mid]) <= max_len:
                fits = mid
            else:
                over = mid
        out.append(rest[:fits])
        rest = rest[fits:]
    if rest:
        out.append(rest)
    return out


def _split_long(sentence: str, max_len: int, measure: Callable[[str], int]) -> list[str]:
    if measure(sentence) <= max_len:
        return [sentence]
    clauses = [c.strip() for c in _CLAUSE_BREAK.split(sentence) if c and c.strip()]
    out: list[str] = []
    for clause in clauses:
        if measure(clause) <= max_len:
            out.append(clause)
            continue
        words: list[str] = []
        for w in clause.split():
            words.extend([w] if measure(w) <= max_len else _hard_split(w, max_len, measure))
        out.extend(_pack(words, max_len, measure))
    # Re-join neighbouring clauses that still fit together, so pieces are not tiny.
    return _pack(out, max_len, measure)


def split_clauses(text: str, max_chars: int, measure: Callable[[str], int] = len) -> list[str]:
    """Sentences of ``text``, long ones cut at clause boundaries (``, ; : —`` ...)
    so that ``measure(piece) <= max_chars`` for every piece.

    Nothing is truncated: the pieces joined by spaces equal the text up to
    whitespace. Falls back to word boundaries, then to characters, when a clause
    alone is too long. ``measure`` lets a caller budget in bytes or tokens.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    sentences, rest = split_sentences(text)  # a finished text: the stripped rest is a sentence too
    if rest.strip():
        sentences.append(rest.strip())
    out: list[str] = []
    for sentence in sentences:
        out.extend(_split_long(sentence, max_chars, measure))
    return out


def pack_sentences(text: str, max_len: int, measure: Callable[[str], int] = len) -> list[str]:
    """``text`` as few pieces as fit ``measure(piece) <= max_len``: consecutive sentences joined,
    a sentence too long alone cut at clause, then word, then character boundaries
    (:func:`split_clauses`). Nothing is dropped: the pieces joined by spaces equal the text up
    to whitespace. Long text planned as utterances (service/synthesis/plan.py) is cut here."""
    return _pack(split_clauses(text, max_len, measure), max_len, measure)
