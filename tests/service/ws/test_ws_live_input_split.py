"""Live text (service/ws/live_input.py) reads each delta once: utterance boundaries are the same
as re-splitting the whole utterance on every delta (the naive reference below), at a cost per
delta proportional to the delta."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from engines.text.sentences import split_sentences
from service.ws.live_input import HARD_FACTOR, LiveInput

ALPHABET = "ab AB3.,!?…。！？」\"')\n"


class NaiveLiveInput:
    """The boundary rule done the slow way: the whole utterance re-split on every delta."""

    def __init__(self, boundary_chars: int):
        self.boundary_chars = boundary_chars
        self.open: list[str] | None = None  # [text fed, held whitespace]
        self.utterances: list[str] = []

    def add(self, delta: str) -> None:
        while delta:
            if self.open is None:
                delta = delta.lstrip()
                if not delta:
                    return
                self.open = ["", ""]
                self.utterances.append("")
            text, held = self.open
            seen = text + held
            cut = self._boundary(seen + delta)
            if cut is None or cut < len(text):
                self._feed(delta)
                return
            take = max(0, cut - len(seen))
            self._feed(delta[:take])
            delta = delta[take:]
            self.open = None

    def _feed(self, delta: str) -> None:
        body = self.open[1] + delta
        stripped = body.rstrip()
        self.open[1] = body[len(stripped):]
        self.open[0] += stripped
        self.utterances[-1] += stripped

    def _boundary(self, text: str) -> int | None:
        if len(text) < self.boundary_chars:
            return None
        sentences, rest = split_sentences(text)
        cut = len(text) - len(rest)
        if sentences and cut >= self.boundary_chars:
            return cut
        hard = HARD_FACTOR * self.boundary_chars  # no sentence end: the first space past it
        return next((i for i in range(hard, len(text)) if text[i].isspace()), None)


@given(text=st.text(alphabet=ALPHABET, max_size=120),
       cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=30),
       boundary=st.integers(min_value=1, max_value=40))
@settings(max_examples=400, deadline=None)
def test_live_utterances_match_re_splitting_everything(text, cuts, boundary):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    live, naive = LiveInput(boundary), NaiveLiveInput(boundary)
    opened = []
    for a, b in zip(bounds, bounds[1:]):
        started, _ = live.add(text[a:b])
        opened.extend(started)
        naive.add(text[a:b])
    assert [u.text for u in opened] == naive.utterances
    assert [text[u.text_start:].startswith(u.text) for u in opened] == [True] * len(opened)


def test_text_with_no_sentence_end_is_cut_at_a_space_past_the_hard_bound():
    live, opened = LiveInput(10), []
    for word in ("word " * 30).split(" "):
        opened += live.add(word + " ")[0]
    assert len(opened) > 1 and all(40 <= len(u.text) <= 45 for u in opened[:-1])
    assert " ".join(u.text for u in opened) == ("word " * 30).strip()


def test_a_delta_costs_its_own_length_not_the_utterances():
    """20,000 one-character deltas on an utterance past the boundary with no sentence end: each
    is read once (re-splitting the utterance each time was ~200 M character steps)."""
    live = LiveInput(200)
    started = time.process_time()
    for _ in range(20_000):
        live.add("x")
    spent = time.process_time() - started
    assert len(live.open.text) == 20_000
    assert spent < 2.0, f"{spent:.2f} s of CPU"
