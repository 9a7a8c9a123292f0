"""Text -> the units the forced aligner times, split the way the official processor does.

    units = split_units("Hello, wörld! 你好", "English")   # [Unit('Hello', 0, 5), Unit('wörld', 7, 12),
                                                            #  Unit('你', 14, 15), Unit('好', 15, 16)]

``qwen_asr``'s ``Qwen3ForceAlignProcessor.encode_timestamp``:

* every language but Japanese and Korean: split on whitespace, keep letters, digits and
  ``'`` of each piece, and cut CJK ideographs out as one unit each;
* Japanese: the ``nagisa`` tokenizer's words (a neural tokenizer, an optional dependency:
  ``pip install nagisa==0.2.11``; without it Japanese is refused, see :func:`language_support`);
* Korean: soynlp's ``LTokenizer`` over the Korean word list the official package ships
  (reimplemented here: per whitespace piece longer than two characters, the longest
  dictionary prefix of two or more characters and the rest; no such prefix: the piece whole).

Each unit also carries where it came from in the text (``start``/``end`` character offsets,
end exclusive), so a caller can map unit times back onto the text it was given.
"""

from __future__ import annotations

import functools
import gzip
import unicodedata
from dataclasses import dataclass
from pathlib import Path

KOREAN_WORDS = Path(__file__).with_name("korean_words.txt.gz")  # the first column of qwen_asr's korean_dict_jieba.dict


@dataclass(frozen=True)
class Unit:
    text: str  # what the aligner sees (punctuation removed)
    start: int  # [start, end): the characters of the input text it spans
    end: int


@dataclass(frozen=True)
class LanguageSupport:
    supported: bool
    splitter: str  # "spaces+cjk", "nagisa" or "soynlp-ltokenizer"
    needs: str | None = None  # the package to install when not supported


def is_kept_char(ch: str) -> bool:
    return ch == "'" or unicodedata.category(ch)[0] in ("L", "N")


def clean_token(token: str) -> str:
    return "".join(ch for ch in token if is_kept_char(ch))


def is_cjk_char(ch: str) -> bool:
    code = ord(ch)
    return (0x4E00 <= code <= 0x9FFF or 0x3400 <= code <= 0x4DBF or 0x20000 <= code <= 0x2A6DF
            or 0x2A700 <= code <= 0x2B73F or 0x2B740 <= code <= 0x2B81F or 0x2B820 <= code <= 0x2CEAF
            or 0xF900 <= code <= 0xFAFF)


def _split_cjk(token: str) -> list[str]:
    """Ideographs one by one, the runs between them whole."""
    out, run = [], ""
    for ch in token:
        if is_cjk_char(ch):
            if run:
                out.append(run)
                run = ""
            out.append(ch)
        else:
            run += ch
    return out + ([run] if run else [])


def _space_words(text: str) -> list[str]:
    words = []
    for piece in text.split():
        cleaned = clean_token(piece)
        if cleaned:
            words.extend(_split_cjk(cleaned))
    return words


@functools.cache
def _korean_words() -> frozenset[str]:
    return frozenset(gzip.decompress(KOREAN_WORDS.read_bytes()).decode("utf-8").split())


def _korean_words_of(text: str) -> list[str]:
    known = _korean_words()
    out = []
    for piece in text.split():
        cut = len(piece)  # no known prefix: the piece whole
        if len(piece) > 2:
            cut = next((e for e in range(len(piece), 1, -1) if piece[:e] in known), cut)
        for part in (piece[:cut], piece[cut:]):
            cleaned = clean_token(part)
            if cleaned:
                out.append(cleaned)
    return out


def _japanese_words_of(text: str) -> list[str]:
    import nagisa  # optional: see language_support

    return [c for c in (clean_token(w) for w in nagisa.tagging(text).words) if c]


@functools.cache
def _has_nagisa() -> bool:
    try:
        import nagisa  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or its DyNet build does not load here
        return False
    return True


def language_support(language: str) -> LanguageSupport:
    lang = language.strip().lower()
    if lang == "japanese":
        ok = _has_nagisa()
        return LanguageSupport(ok, "nagisa", None if ok else "nagisa==0.2.11")
    if lang == "korean":
        return LanguageSupport(True, "soynlp-ltokenizer")
    return LanguageSupport(True, "spaces+cjk")


class UnsupportedLanguage(ValueError):
    """The language needs a tokenizer package that is not installed."""


def split_words(text: str, language: str) -> list[str]:
    """The official ``encode_timestamp`` word list for ``text`` in ``language`` (any case)."""
    lang = language.strip().lower()
    if lang == "japanese":
        if not _has_nagisa():
            raise UnsupportedLanguage("Japanese alignment needs the nagisa tokenizer: pip install nagisa==0.2.11")
        return _japanese_words_of(text)
    if lang == "korean":
        return _korean_words_of(text)
    return _space_words(text)


def locate(text: str, words: list[str]) -> list[Unit]:
    """Each word's span in ``text``: its characters matched in order, skipping what
    cleaning removed (punctuation inside a word, e.g. ``U.S.`` -> ``US``)."""
    units, pos = [], 0
    for word in words:
        start = text.find(word[0], pos)
        if start < 0:  # cannot happen for words split from ``text``; keep going, never raise
            units.append(Unit(word, pos, pos))
            continue
        i, j = start, 0
        while j < len(word) and i < len(text):
            if text[i] == word[j]:
                j += 1
            elif is_kept_char(text[i]):
                break
            i += 1
        units.append(Unit(word, start, i))
        pos = i
    return units


def split_units(text: str, language: str) -> list[Unit]:
    return locate(text, split_words(text, language))


def aligner_text(words: list[str]) -> str:
    """The official aligner prompt after the audio: each word followed by two ``<timestamp>``."""
    return "".join(w + "<timestamp><timestamp>" for w in words)


__all__ = ["LanguageSupport", "Unit", "UnsupportedLanguage", "aligner_text", "clean_token", "is_cjk_char",
           "language_support", "locate", "split_units", "split_words"]
