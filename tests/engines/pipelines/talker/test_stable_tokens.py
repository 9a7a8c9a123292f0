"""Stable incremental tokenization (engines/pipelines/talker/stable_tokens.py): any split of a
text into deltas commits exactly the official body ids of the whole text, ids once committed
never change, and ids are committed early (before the text ends).

Property tests over an alphabet chosen to hit every regex branch of both split regexes
(letters in both cases, digits, punctuation, apostrophe contractions, spaces, tabs, newlines,
CJK, combining marks that compose under NFC, emoji, added-token fragments).
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from engines.checkpoints.qwen3_text import FIXED_SPLIT, QWEN2_SPLIT, QwenTextTokenizer
from engines.pipelines.talker.stable_tokens import StableTokenizer, body_ids
from testsupport.talker import make_tokenizer

MERGING = ("  \n  \n", "  \n", "   ", "\n\n", " \t ", "e\u0334\u0301", "\u0334\u0301", "'s 'll", ". ..") * 20


def _tokenizer(regex: str) -> QwenTextTokenizer:
    from tokenizers import Regex, pre_tokenizers

    # Trained with whitespace runs and marks too, so BPE merges them ("  \n  \n" is ONE id):
    # a piece that changes then changes the ids, and the properties below can fail.
    tok = make_tokenizer(extra_corpus=MERGING)
    tok._tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return QwenTextTokenizer(tok._tok, regex)


TOKENIZERS = {"qwen2": _tokenizer(QWEN2_SPLIT), "fixed": _tokenizer(FIXED_SPLIT)}
ATOMS = list("aAbZeé xyHTTPs'.,!?-/0123456789 \t\n\r") + [
    "\u0301", "\u0323", "\u0334", "\u0308", "e\u0301", "你", "好", "。", "🙂", "'s", "'ll", "'D", "  ", "\n\n", " \n ",
    "<|im_end|>", "<|im_", "<|", "|>", "camelCase", "XMLHttp", "McDonald's", "\u1100", "\u1161", "\u11a8"]
texts = st.lists(st.sampled_from(ATOMS), min_size=0, max_size=24).map("".join)


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    edges = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(edges, edges[1:])]


def _stream(tok, deltas: list[str]) -> list[int]:
    stream, ids = StableTokenizer(tok), []
    for d in deltas:
        before = list(stream.committed)
        ids += stream.feed(d)
        assert stream.committed[: len(before)] == before  # committed ids never change
    return ids + stream.finish()


@settings(max_examples=300, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(0, 10_000), max_size=12), which=st.sampled_from(sorted(TOKENIZERS)))
def test_any_split_yields_the_ids_of_the_whole_text(text, cuts, which):
    tok = TOKENIZERS[which]
    assert _stream(tok, _split(text, cuts)) == body_ids(tok, text)


@settings(max_examples=100, deadline=None)
@given(text=texts, which=st.sampled_from(sorted(TOKENIZERS)))
# A whitespace run decided at the end ("  \n  " + "\n" merges back); a combining mark that
# composes with a starter two pieces back ("e" "\u0334" + "\u0301" -> "é\u0334").
@example(text="a  \n  \nb", which="qwen2")
@example(text="e\u0334\u0301x", which="qwen2")
def test_one_character_per_delta(text, which):
    tok = TOKENIZERS[which]
    assert _stream(tok, list(text)) == body_ids(tok, text)


def test_body_ids_are_the_prompt_builders():
    from engines.pipelines.talker.prompt import PromptBuilder  # noqa: F401  (same wrapping as prompt.py)

    tok = TOKENIZERS["qwen2"]
    text = "Hello world, this is a test."
    wrapped = tok.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
    assert body_ids(tok, text) == wrapped[3:-5]


def test_ids_commit_before_the_text_ends():
    """Everything but the trailing piece is committed: one word of latency."""
    tok = TOKENIZERS["qwen2"]
    stream = StableTokenizer(tok)
    text = "Hello world, this is a small test"
    got = []
    for ch in text:
        got += stream.feed(ch)
    whole = body_ids(tok, text)
    last_piece = body_ids(tok, " test")
    assert got == whole[: len(whole) - len(last_piece)]
    assert got + stream.finish() == whole


def test_text_after_finish_is_refused():
    stream = StableTokenizer(TOKENIZERS["qwen2"])
    stream.feed("Hi.")
    stream.finish()
    import pytest

    with pytest.raises(ValueError):
        stream.feed("more")
