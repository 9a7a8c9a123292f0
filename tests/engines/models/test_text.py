"""Text: the DiT's byte tokenizer (engines/models/text.py), streaming sentence splitting and
clause splitting (engines/text/sentences.py)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.models.text import BOS_ID, EOS_ID, ByteTokenizer, Tokenizer
from engines.text.sentences import SentenceSplitter, split_clauses, split_sentences


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


# --------------------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    ids = tok.encode("Grüße, 世界!")
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert ids[1:-1] == list("Grüße, 世界!".encode("utf-8"))
    assert tok.decode(ids) == "Grüße, 世界!"
    assert tok.vocab_size == 259 and tok.pad_id == 256


@given(st.text(max_size=50))
@settings(max_examples=60, deadline=None)
def test_byte_tokenizer_round_trip_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_byte_tokenizer_bad_input():
    tok = ByteTokenizer()
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tok.decode([1, 999])


# --------------------------------------------------------------------------- sentences


@pytest.mark.parametrize(
    "buffer, sentences, rest",
    [
        ("Hello there. How are", ["Hello there."], " How are"),
        ("Hello there.", [], "Hello there."),  # a final period alone is undecided
        ("Pi is 3.", [], "Pi is 3."),
        ("Pi is 3.5 today. Next", ["Pi is 3.5 today."], " Next"),
        ("Dr. Smith is in. He said", ["Dr. Smith is in."], " He said"),
        ("Use tools, e.g. hammers. Or", ["Use tools, e.g. hammers."], " Or"),
        ("Wait... what? No! Yes", ["Wait... what?", "No!"], " Yes"),
        ("Wait... Then it", ["Wait..."], " Then it"),
        ("Hmm… Right", ["Hmm…"], " Right"),
        ('He said "hi." Then', ['He said "hi."'], " Then"),
        ("你好。世界！再", ["你好。", "世界！"], "再"),
        ("真的？", [], "真的？"),  # decided when the next character arrives
        ("「好。」他说", ["「好。」"], "他说"),
        ("J. R. R. Tolkien wrote. It", ["J. R. R. Tolkien wrote."], " It"),
        ("The U.S. Army is big. Yes", ["The U.S. Army is big."], " Yes"),
        ("Title\n\nBody text", ["Title"], "\n\nBody text"),
        ("End.\nNext", ["End."], "\nNext"),
        ("Really?! Yes", ["Really?!"], " Yes"),
        ("", [], ""),
        # decided by the whitespace after the terminator: spoken before more text arrives
        ("Hello there. ", ["Hello there."], " "),
        ("Hello there.\n", ["Hello there."], "\n"),
        ("Done! Now? ", ["Done!", "Now?"], " "),
        ("Pi is 3. ", ["Pi is 3."], " "),
        ("Pi is 3.14 ", [], "Pi is 3.14 "),
        ("I met Dr. ", [], "I met Dr. "),  # an abbreviation never ends one
        ("Use tools, e.g. ", [], "Use tools, e.g. "),
        ("Books etc. are here. ", ["Books etc. are here."], " "),
        ("Plan B. ", [], "Plan B. "),  # (an initial: a missed end only makes an utterance longer)
        ("Wait... ", [], "Wait... "),  # after an ellipsis or a closer the next word decides
        ("Wait... and then. ", ["Wait... and then."], " "),
        ('He said "hi." ', [], 'He said "hi." '),
        ('"Really?" she asked. ', ['"Really?" she asked.'], " "),
    ],
)
def test_split_sentences_examples(buffer, sentences, rest):
    assert split_sentences(buffer) == (sentences, rest)


def test_split_clauses_keeps_the_unterminated_rest():
    assert split_clauses("One. Two", 100) == ["One.", "Two"]
    assert split_clauses("  ", 100) == []


_ALPHABET = "ab AB3.,!?;:…。！？」\"')\n"


@given(
    text=st.text(alphabet=_ALPHABET, max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=6),
)
@settings(max_examples=300, deadline=None)
def test_incremental_equals_one_shot(text, cuts):
    # Feeding the text in arbitrary pieces must give the same sentences and rest.
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    got: list[str] = []
    buffer = ""
    for a, b in zip(bounds, bounds[1:]):
        buffer += text[a:b]
        done, buffer = split_sentences(buffer)
        got.extend(done)
    assert (got, buffer) == split_sentences(text)


@given(
    text=st.text(alphabet=_ALPHABET + "Mr.e.g\u201d\u300f\uff09\u00bb ", max_size=80),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=40),
)
@settings(max_examples=500, deadline=None)
def test_sentence_splitter_equals_one_shot(text, cuts):
    # The splitter reads only what is new (and an undecided tail): same sentences, same rest.
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    splitter = SentenceSplitter()
    got: list[str] = []
    for a, b in zip(bounds, bounds[1:]):
        got.extend(splitter.feed(text[a:b]))
        got.extend(splitter.feed(""))
    assert (got, splitter.rest) == split_sentences(text)
    assert splitter.take_rest() == split_sentences(text)[1] and splitter.rest == ""


@given(st.text(alphabet=_ALPHABET + "xyz", max_size=80))
@settings(max_examples=200, deadline=None)
def test_split_sentences_loses_nothing(text):
    sentences, rest = split_sentences(text)
    assert all(s and s == s.strip() for s in sentences)
    assert _squash("".join(sentences) + rest) == _squash(text)
    assert text.endswith(rest)
    # The rest holds no further decided sentence.
    assert split_sentences(rest)[0] == [] or _squash(rest) == ""


def test_split_sentences_bad_input():
    with pytest.raises(TypeError):
        split_sentences(None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- clauses


def test_split_clauses_prefers_clause_boundaries():
    text = "This one is long, with several clauses; and more: yes — indeed. Short."
    pieces = split_clauses(text, 30)
    assert pieces == ["This one is long,", "with several clauses;", "and more: yes — indeed.", "Short."]


def test_split_clauses_keeps_numbers_whole_and_short_text_alone():
    assert split_clauses("It costs 1,000 dollars.", 15) == ["It costs 1,000", "dollars."]
    assert split_clauses("Hi. Ok.", 100) == ["Hi.", "Ok."]


def test_split_clauses_joins_cjk_clauses_without_spaces():
    assert split_clauses("我们今天去公园，然后回家吃饭，好吗？", 14) == ["我们今天去公园，", "然后回家吃饭，好吗？"]


def test_split_clauses_bytes_budget():
    text = "世界和平，" * 10
    pieces = split_clauses(text, 24, measure=lambda s: len(s.encode("utf-8")))
    assert all(len(p.encode("utf-8")) <= 24 for p in pieces)
    assert _squash("".join(pieces)) == _squash(text)


@given(st.text(alphabet="abc de,;:—.!? \n。，" , max_size=200), st.integers(min_value=1, max_value=40))
@settings(max_examples=200, deadline=None)
def test_split_clauses_never_truncates_and_respects_budget(text, max_chars):
    pieces = split_clauses(text, max_chars)
    assert all(p and p == p.strip() for p in pieces)
    assert all(len(p) <= max_chars for p in pieces)
    assert _squash("".join(pieces)) == _squash(text)


def _grown_a_character_at_a_time(word: str, max_len: int, measure) -> list[str]:
    """The reference for a word cut by characters: a piece grows until the next character would not fit."""
    out, cur = [], ""
    for ch in word:
        if cur and measure(cur + ch) > max_len:
            out.append(cur)
            cur = ""
        cur += ch
    return out + [cur] if cur else out


@given(st.text(alphabet="ab世😀", min_size=1, max_size=300), st.integers(min_value=1, max_value=40))
@settings(max_examples=200, deadline=None)
def test_a_word_too_long_is_cut_as_growing_it_would_in_few_measures(word, max_len):
    """Bisection cuts a word where growing it a character at a time does (for any measure that
    never shrinks as text grows: characters, UTF-8 bytes), and measures each piece a logarithmic
    number of times, not once per character (4,096 emoji were 4,096 measures of growing text)."""
    from engines.text.sentences import _hard_split

    calls = []

    def utf8(text: str) -> int:
        calls.append(len(text))
        return len(text.encode("utf-8"))

    pieces = _hard_split(word, max_len, utf8)
    assert pieces == _grown_a_character_at_a_time(word, max_len, lambda t: len(t.encode("utf-8")))
    assert len(calls) <= len(pieces) * (len(word).bit_length() + 2)


def test_split_clauses_bad_input():
    with pytest.raises(ValueError, match="max_chars"):
        split_clauses("abc", 0)
