"""Live utterances in the talker: text that arrives while the row speaks.

The reference is the official ``generate()`` in streaming-text mode (``non_streaming_mode=False``)
on the whole text: the oracle fixtures' ``*_stream`` cases. Greedy codes must be identical
whatever the split of the text into deltas and however many steps the text arrives late; a
row that waits for text takes no step, and the other rows of the batch never wait for it.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from engines.contract import SynthesisRequest, TextFeed
from engines.pipelines.talker.live_text import LiveText
from engines.pipelines.talker.source import TalkerSource
from tests.oracle import talker_fixtures as fx

pytestmark = pytest.mark.parity


def _stream_cases(name: str) -> dict:
    return {k: c for k, c in fx.cases(name).items() if not c["non_streaming_mode"] and not c["instruct"]}


def _deltas(text: str, rng: random.Random, mode: str) -> list[str]:
    if mode == "whole":
        return [text]
    if mode == "chars":
        return list(text)
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        out.append(text[i:i + k])
        i += k
    return out


@pytest.mark.parametrize("mode", ["whole", "chars", "random"])
@pytest.mark.parametrize("name", fx.CHECKPOINTS)
def test_live_codes_equal_official_streaming_text_mode(name, mode):
    from engines.pipelines.talker.reference import TalkerBundle
    from testsupport.talker import step

    bundle = TalkerBundle.from_checkpoint(fx.checkpoint_dir(name))
    refs, cases = fx.references(name), _stream_cases(name)
    assert cases, "the fixtures hold streaming-text cases"
    rng = random.Random(zlib.crc32(f"{name}/{mode}".encode()))
    source = TalkerSource.from_bundle(bundle, max_slots=len(cases) + 1, max_seq_len=256)
    # A non-live utterance shares the batch: it must never wait for the live rows.
    other, oc = next((k, c) for k, c in fx.cases(name).items() if c["non_streaming_mode"] and not c["instruct"]
                     and c["max_new_tokens"] is None)
    source.admit(SynthesisRequest(greedy=True, id=other, text=oc["prompt"], voice=oc["speaker"], language=oc["language"]),
                 non_streaming_mode=True)
    feeds: dict[str, tuple[TextFeed, list[str]]] = {}
    waiting_admission: dict[str, tuple[SynthesisRequest, LiveText]] = {}
    for case, c in cases.items():
        feed = TextFeed()
        request = SynthesisRequest(greedy=True, id=case, text="", voice=c["speaker"], language=c["language"], text_feed=feed)
        feeds[case] = (feed, _deltas(c["prompt"], rng, mode))
        waiting_admission[case] = (request, LiveText(feed, bundle.prompt))
    got: dict[str, list] = {k: [] for k in [*cases, other]}
    other_frames_per_tick, waited = [], 0
    for _ in range(2000):
        # Text arrives at random: nothing, one delta, or the end, between ticks.
        for case, (feed, parts) in feeds.items():
            if parts and rng.random() < 0.3:
                feed.append(parts.pop(0))
            elif not parts and not feed.finished and rng.random() < 0.4:
                feed.finish()
        for case in list(waiting_admission):
            request, live = waiting_admission[case]
            live.pull()
            if live.ready:
                source.admit(request, live=live)
                del waiting_admission[case]
        if not source.active_slots and not waiting_admission:
            break
        before = source.active_slots
        frames = step(source)
        waited += before - source.last_batch_rows
        for f in frames:
            got[f.request_id].append(f.codes)
        if other in source.rows:
            other_frames_per_tick.append(sum(1 for f in frames if f.request_id == other))
    for case in cases:
        assert torch.equal(torch.cat(got[case]), refs[f"case/{case}/codes"]), (name, case, mode)
    assert torch.equal(torch.cat(got[other]), refs[f"case/{other}/codes"])
    # The non-live row advanced one frame on every tick it was active, live rows waiting or not.
    assert all(n == 1 for n in other_frames_per_tick[1:]), other_frames_per_tick



def test_long_live_utterance_waits_and_equals_the_whole_text():
    """A longer utterance (in-process bundle, no early EOS): the text arrives one character
    every third tick, so the row catches up and waits many times; its codes equal the
    reference loop on the whole text in streaming-text mode (that loop equals the official
    generate(): test_talker_parity.py), and a row beside it never waits."""
    from testsupport.talker import make_bundle, step

    bundle = make_bundle(seed=3, max_new_tokens=60, eos_gain=0.0)
    text = "Hello world, this is a small test of streaming speech."
    expected = bundle.generate_codes(text, "Ryan", greedy=True, non_streaming_mode=False)
    beside = bundle.generate_codes("the quick brown fox", "Vivian", greedy=True, non_streaming_mode=False)
    source = TalkerSource.from_bundle(bundle, max_slots=2, max_seq_len=256)
    source.admit(SynthesisRequest(greedy=True, id="beside", text="the quick brown fox", voice="Vivian"), non_streaming_mode=False)
    feed = TextFeed()
    live = LiveText(feed, bundle.prompt)
    request = SynthesisRequest(greedy=True, id="live", text="", voice="Ryan", text_feed=feed)
    got: dict[str, list] = {"live": [], "beside": []}
    trace = []  # (live row waited, frames of "beside") per tick
    parts, admitted = list(text), False
    for tick in range(1000):
        if tick % 3 == 0:
            feed.append(parts.pop(0)) if parts else feed.finish()
        if not admitted and (live.pull() or live.ready):
            source.admit(request, live=live)
            admitted = True
        if admitted and not source.active_slots:
            break
        before = source.rows
        frames = step(source)
        for f in frames:
            got[f.request_id].append(f.codes)
        if "live" in before and "beside" in before:
            trace.append((len(before) - source.last_batch_rows, sum(f.request_id == "beside" for f in frames)))
    assert torch.equal(torch.cat(got["live"]), expected)
    assert torch.equal(torch.cat(got["beside"]), beside)
    assert sum(w for w, _ in trace) > 10, trace  # the live row waited often
    assert all(n == 1 for w, n in trace[1:] if w), trace  # ... and "beside" stepped every time it did


def test_a_waiting_row_keeps_its_state_and_emits_nothing():
    """The sit-out: ticks while the row's next text id is missing change none of its state
    (hidden, position, token count, code-0 column, repetition-penalty set) and emit no frame;
    a row beside it keeps stepping."""
    from testsupport.talker import make_bundle, step

    bundle = make_bundle(seed=5, max_new_tokens=40, eos_gain=0.0)
    source = TalkerSource.from_bundle(bundle, max_slots=2, max_seq_len=128)
    source.admit(SynthesisRequest(greedy=True, id="beside", text="the quick brown fox", voice="Vivian"), non_streaming_mode=False)
    feed = TextFeed()
    live = LiveText(feed, bundle.prompt)
    feed.append("Hello world, this")  # "Hello" " world" "," committed; " this" held back
    live.pull()
    source.admit(SynthesisRequest(greedy=True, id="live", text="", voice="Ryan", text_feed=feed), live=live)
    row = source.rows.index("live")
    st = source.state

    def snapshot():
        return [t[row].clone() for t in (st.h, st.pos, st.ntok, st.seen, st.code0)]

    waits = 0
    for _ in range(40):
        before = snapshot()
        frames = step(source)
        if source.last_batch_rows == 1:  # the live row sat this tick out
            waits += 1
            assert all(torch.equal(a, b) for a, b in zip(before, snapshot()))
            assert not [f for f in frames if f.request_id == "live"]
            assert [f.request_id for f in frames] == ["beside"]
        if waits >= 3:
            break
    assert waits >= 3
