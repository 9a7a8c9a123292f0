"""Long text planned as utterances, on every surface (speech, jobs, every socket).

    parts = plan_text(engine, text, params, settings)    # -> [Utterance("First sentences.", ids), Pause(0.5), ...]

A talker speaks one utterance per engine request, each with a frame budget from its own text
(engines/pipelines/talker/budget.py). Text whose budget is over ``--utterance-max-frames`` (or
the per-utterance work limit, if lower) is cut at sentence ends into utterances that fit
(engines/sentences.py ``pack_sentences``: consecutive sentences joined while they fit, a
sentence too long alone cut at clauses, then words), spoken in order with the same voice
settings and seed (service/synthesis/sequence.py plays them as one stream). Text that fits is
left exactly as sent: the same request as before, the same audio. Long utterances drift in
voice and prosody, and one that never ends can only waste its own budget.

The DiT plans its own clauses from the whole text, so its text stays one part.

``<break time="500ms"/>`` (ElevenLabs' and Cartesia's pause tag, read by service/synthesis/breaks.py)
is a :class:`Pause`: that much silence between the utterances around it, on every pipeline.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Union

from engines.contract import PlannedWork, SynthesisEngine
from engines.sentences import pack_sentences
from service.errors import ApiError
from service.synthesis.breaks import BreakTags, Pause, break_tag, split_breaks  # noqa: F401 (re-exported)
from service.synthesis.params import SynthesisParams, plan_request, planned_work
from service.synthesis.schema import FieldError, require_unicode


UNCAPPED = 2**31 - 1  # max_new_tokens when a piece's budget is measured: its text's alone


@dataclass(frozen=True)
class Utterance:
    """One utterance of a planned text, with its text ids when they were counted (the engine's
    ``with_prompt_ids``): it is served with them, not tokenized again."""

    text: str
    prompt_ids: tuple[int, ...] | None = None


Part = Union[Utterance, Pause]


def utterance_limit(engine: SynthesisEngine, params: SynthesisParams, settings) -> int:
    """The text budget one planned utterance may have: ``--utterance-max-frames``, and not over the
    per-utterance work limit (``--max-work-talker-steps``, 0 = none) unless ``max_new_tokens`` (the
    request's, else the model's) already caps every utterance under it."""
    steps = settings.max_work_talker_steps
    max_new = params.max_new_tokens or engine.capabilities.max_new_tokens
    if not steps or (max_new is not None and max_new - 1 <= steps):
        return settings.utterance_max_frames
    return min(settings.utterance_max_frames, steps)


def plan_text(engine: SynthesisEngine, text: str, params: SynthesisParams, settings) -> list[Part]:
    """``text`` as the parts it is spoken in, in order (see the module docstring): its break tags
    are pauses, and on a talker the text between them is cut into utterances that fit."""
    pieces = split_breaks(text)
    if not any(isinstance(piece, Pause) for piece in pieces):
        return plan_utterances(engine, text, params, settings)
    parts: list[Part] = []
    for piece in pieces:
        if isinstance(piece, Pause):
            parts.append(piece)
        elif piece.strip():
            parts += plan_utterances(engine, piece.strip(), params, settings)
    return parts


def plan_utterances(engine: SynthesisEngine, text: str, params: SynthesisParams, settings) -> list[Utterance]:
    """``text`` (no breaks) as the utterances it is spoken in: as it is, or on a talker cut at
    sentence ends when its frame budget is over the utterance limit."""
    if engine.capabilities.pipeline != "talker":
        return [Utterance(text)]
    limit = utterance_limit(engine, params, settings)
    counted: dict[str, tuple[int, ...] | None] = {}  # each piece measured is tokenized once
    # the text's own budget, whatever max_new_tokens caps each utterance at
    template = replace(plan_request(engine, "", params), max_new_tokens=UNCAPPED)

    def frames(piece: str) -> int:
        if piece not in counted:
            counted[piece] = engine.with_prompt_ids(replace(template, text=piece)).prompt_ids
        return engine.planned_work(replace(template, text=piece, prompt_ids=counted[piece])).model_steps

    pieces = [text] if frames(text) <= limit else pack_sentences(text, limit, frames) or [text]
    return [Utterance(piece, counted.get(piece)) for piece in pieces]


def speech_parts(parts: list[Part]) -> list[Utterance]:
    return [part for part in parts if isinstance(part, Utterance)]


INLINE_CHARS = 4096  # longer text (a long job) is planned and prepared on a thread: the loop never waits


async def off_loop(text: str, call, *args, **kwargs):
    """``call(*args, **kwargs)`` for ``text``: inline when it is short, else on a thread."""
    if len(text) <= INLINE_CHARS:
        return call(*args, **kwargs)
    return await asyncio.to_thread(call, *args, **kwargs)


def check_work(engine: SynthesisEngine, text: str, params: SynthesisParams, settings) -> list[Part]:
    """The parts ``text`` is spoken in (:func:`plan_text`), each checked before any engine time:
    ApiError(413, ``too_much_work``) naming the limit and its flag when one plans more vocoder
    frames than ``max_work_audio_frames`` or more model steps than ``max_work_frame_steps`` (DiT)
    / ``max_work_talker_steps`` (talker: per utterance); 0 = no limit. Text that is not valid
    Unicode never reaches the engine (every route validated it already; this is the last gate, a
    400 whatever the route)."""
    try:
        require_unicode("text", text)
    except FieldError as exc:
        raise ApiError(400, exc.code, str(exc)) from None
    parts = plan_text(engine, text, params, settings)
    for part in speech_parts(parts):
        check_limits(planned_work(engine, part.text, params, part.prompt_ids), settings)
    return parts


def check_limits(work: PlannedWork, settings) -> None:
    talker = work.step_unit == "talker steps"
    frames_limit = settings.max_work_audio_frames
    steps_limit = settings.max_work_talker_steps if talker else settings.max_work_frame_steps
    if frames_limit and work.audio_frames > frames_limit:
        how = "shorten the text or lower max_new_tokens" if talker else "shorten the input or raise speed"
        raise ApiError(413, "too_much_work",
                       f"this request plans {work.audio_frames} audio frames (12.5 per second of audio); the limit "
                       f"is {frames_limit} (--max-work-audio-frames): {how}")
    if steps_limit and work.model_steps > steps_limit:
        if talker:
            raise ApiError(413, "too_much_work",
                           f"this utterance may run {work.model_steps} talker steps (its text's frame budget, at "
                           f"most max_new_tokens - 1); the limit is {steps_limit} (--max-work-talker-steps): "
                           "shorten the text or lower max_new_tokens")
        raise ApiError(413, "too_much_work",
                       f"this request plans {work.model_steps} DiT frame-steps (frames x steps); the limit is "
                       f"{steps_limit} (--max-work-frame-steps): shorten the input, raise speed or lower steps")


__all__ = ["BreakTags", "Part", "Pause", "Utterance", "break_tag", "check_work", "off_loop", "plan_text",
           "speech_parts", "split_breaks", "utterance_limit"]
