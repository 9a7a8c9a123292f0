"""The request plan (service/synthesis/plan.py) on the real tiny DiT engine: immutable, its
frames the sum of its utterances' (after speed) and its pauses', and every utterance located in
the text it was cut from, so that a word of an utterance maps back onto the same word of the
text as sent (service/synthesis/timestamps.py ``in_source``), whatever the whitespace, breaks
and cuts."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings, strategies as st

from engines.contract import Alignment, WordTimestamp
from service.settings import Settings
from service.synthesis.params import SynthesisParams
from service.synthesis.plan import Pause, Utterance, plan_text
from service.synthesis.timestamps import in_source

TIGHT = Settings(preset="tiny", device="cpu", max_work_audio_frames=40)  # a DiT request of ~44 bytes at most
PIECES = ["Hello", "there,", "my", "friend.", "How", "are", "you?", "3.14", "Dr.", "\U0001F600", "你好。",
          '<break time="200ms"/>', "<break time=1s>", "<b>"]
SPACES = [" ", "  ", "\n", "\n\n", "\t", " \n  "]


UNITS = re.compile(r"[\u3000-\u9fff]|[^\s\u3000-\u9fff]+")  # as the aligner's: CJK characters one by one


def words_of(utterance: Utterance) -> Alignment:
    """An alignment of the utterance's units: whitespace-separated words, CJK characters."""
    words = tuple(WordTimestamp(m.group(), 0.0, 0.0, m.start(), m.end()) for m in UNITS.finditer(utterance.text))
    return Alignment(utterance.text, "english", 0.0, words)


@given(st.lists(st.tuples(st.sampled_from(PIECES), st.sampled_from(SPACES)), min_size=1, max_size=40),
       st.sampled_from(SPACES + [""]))
@settings(max_examples=150, deadline=None)
def test_every_word_of_every_utterance_maps_onto_the_text_as_sent(engine, pieces, lead):
    text = lead + "".join(word + space for word, space in pieces)
    plan = plan_text(engine, text, SynthesisParams(), TIGHT)
    spoken = []
    for u in plan.utterances:
        assert text[u.start] == u.text[0]
        mapped = in_source(words_of(u), text, u.start)
        assert mapped.text == text
        for w in mapped.words:
            assert text[w.char_start:w.char_end] == w.text
            spoken.append(w.char_start)
    assert spoken == sorted(spoken) and len(set(spoken)) == len(spoken)  # in order, none twice


def test_the_plan_counts_its_utterances_after_speed_and_its_pauses(engine):
    text = "One two three. " * 8 + '<break time="2s"/>' + "Four five."
    plan = plan_text(engine, text, SynthesisParams(speed=0.5, steps=1), TIGHT)
    assert len(plan.utterances) > 2 and sum(isinstance(p, Pause) for p in plan.parts) == 1
    assert plan.pause_frames == 25
    assert plan.speech_frames == sum(u.frames for u in plan.utterances)  # the DiT honours speed itself
    assert all(u.frames <= 40 for u in plan.utterances)
    assert plan.audio_frames == plan.speech_frames + 25
    assert plan.after(2).parts == plan.parts[2:] and plan.after(2).text == text
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.parts = ()  # type: ignore[misc]
    # text that fits one request is one utterance, exactly as sent
    whole = plan_text(engine, "  Short\n\n text.  ", SynthesisParams(), TIGHT)
    spoken = whole.utterances[0]
    assert whole.parts == (Utterance("  Short\n\n text.  ", spoken.request, 0, spoken.frames, spoken.model_steps),)
    assert spoken.request.text == "  Short\n\n text.  "  # its engine request, as the engine planned it


async def test_a_request_as_long_as_the_speech_routes_take_is_planned_while_the_loop_turns(engine):
    """The costliest text one speech request may carry (4,096 emoji at speed 0.25: ~59,000 frames
    to plan, then refused) is planned off the event loop: the loop keeps turning meanwhile. Planned
    on the loop, it held every other request for ~100 ms."""
    import asyncio

    from service.errors import ApiError
    from service.synthesis.plan import check_work, off_loop

    turns = 0
    planning = True

    async def ticker():
        nonlocal turns
        while planning:
            turns += 1
            await asyncio.sleep(0)

    text = "\U0001F600" * 4096
    settings = Settings(preset="tiny", device="cpu")
    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = turns
    try:
        with pytest.raises(ApiError) as refused:
            await off_loop(text, check_work, engine, text, SynthesisParams(speed=0.25, steps=1), settings)
    finally:
        planning = False
        await task
    assert refused.value.status == 413
    assert turns - before > 1  # inline, the loop could not turn at all until the plan was done
