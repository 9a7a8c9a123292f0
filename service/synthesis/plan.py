"""A request planned once, before any engine time, on every surface (speech, jobs, every socket).

    plan = check_work(engine, text, params, settings, clone=clone)   # a RequestPlan, checked against the limits
    plan.parts          # (Utterance("First sentences.", request, start=0, frames=310), Pause(0.5), ...)
    plan.audio_frames   # what the whole request plans: its utterances (after speed) and its pauses

Each utterance carries its engine request as the engine planned it (``engine.plan``: its text's
ids, its frame budget) with what every utterance of the request shares (``params`` with the voice
as resolved, sampling, the voice prompt ``clone``, a live ``text_feed``): it is submitted as it is
(service/synthesis/submit.py), and the engine checks it once, at submit, and plans nothing again.

A talker speaks one utterance per engine request, each with a frame budget from its own text
(engines/pipelines/talker/budget.py). Text whose budget is over ``--utterance-max-frames`` (or
the per-utterance work limit, if lower) is cut at sentence ends into utterances that fit
(engines/text/sentences.py ``pack_sentences``: consecutive sentences joined while they fit, a
sentence too long alone cut at clauses, then words), spoken in order with the same voice
settings and seed (service/synthesis/sequence.py plays them as one stream). Text that fits is
left exactly as sent: the same request as before, the same audio. Long utterances drift in
voice and prosody, and one that never ends can only waste its own budget.

A model that plans its own frames (the DiT: no frame budget) plans its clauses from the whole
text, so its text stays one utterance unless one
engine request could not take it (over the per-request work limits: a long job), when it is cut
the same way into utterances that each fit.

``<break time="500ms"/>`` (ElevenLabs' and Cartesia's pause tag, read by service/synthesis/breaks.py)
is a :class:`Pause`: that much silence between the utterances around it, on every pipeline.

``sentences``: one utterance per sentence at least (engines/text/sentences.py ``split_sentences``), as
the voice-agent vendors' sockets speak text; their HTTP calls plan it so too.

The limits hold for the whole plan (:func:`check_limits`): its text's frames and its pauses',
after speed, under ``--max-work-audio-frames`` (a job: ``--max-job-audio-frames``), however the
text is cut. Each utterance knows where its text starts in the request's text (``start``): its
text is that text with only whitespace changed (stripped; runs joined by one space where long
text was cut), so its word times map back onto the characters the client sent
(service/synthesis/timestamps.py ``in_source``).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace
from typing import Union

from engines.contract import (
    SAMPLE_RATE,
    SAMPLES_PER_FRAME,
    PlannedWork,
    SynthesisEngine,
    SynthesisRequest,
    TextFeed,
    VoiceClone,
)
from engines.text.sentences import pack_sentences, split_sentences
from service.errors import ApiError
from service.synthesis.breaks import BreakTags, Pause, break_tag, split_breaks  # noqa: F401 (re-exported)
from service.synthesis.params import SynthesisParams, engine_params, engine_request
from service.synthesis.schema import FieldError, require_unicode


WAV_MAX_DATA_BYTES = 2**32 - 1 - 36  # a RIFF file's sizes are 32-bit: what its data chunk can hold


@dataclass(frozen=True)
class Utterance:
    """One utterance of a planned text and its engine request, planned (see the module docstring;
    its id is given when it is submitted). ``start``: where its text starts in the request's text;
    ``frames`` / ``model_steps``: the work its request plans (the engine's count, before a
    service-side speed stretch)."""

    text: str
    request: SynthesisRequest
    start: int = 0
    frames: int = 0
    model_steps: int = 0


Part = Union[Utterance, Pause]


@dataclass(frozen=True)
class RequestPlan:
    """A request's text as the parts it is spoken in, with what each costs: built once
    (:func:`plan_text`), checked once (:func:`check_limits`), then what the rest of the path
    reads (service/synthesis/submit.py makes the engine requests from it, sequence.py plays
    them and places their word times in ``text``, a job keeps its parts as segments)."""

    text: str  # as the client sent it
    params: SynthesisParams  # as validated, the voice resolved
    parts: tuple[Part, ...]
    step_unit: str = ""  # the unit of ``model_steps`` ("talker steps", "DiT frame-steps"); "" with no utterance
    stretch: float | None = None  # the speed the service stretches the audio by (None: the model honours it)
    # the model decodes each utterance until it samples an end, capped by max_new_tokens (a talker):
    # its step limit is per utterance (--max-work-talker-steps), not over the whole plan
    ends_itself: bool = False

    @property
    def utterances(self) -> tuple[Utterance, ...]:
        return tuple(part for part in self.parts if isinstance(part, Utterance))

    @property
    def as_sent(self) -> bool:
        """The text is spoken as one utterance, exactly as sent (no pause, nothing trimmed or cut)."""
        return len(self.parts) == 1 and isinstance(self.parts[0], Utterance) and self.parts[0].text == self.text

    @property
    def speech_frames(self) -> int:
        """The utterances' audio frames, after the service's stretch."""
        frames = sum(u.frames for u in self.utterances)
        return math.ceil(frames / self.stretch) if self.stretch else frames

    @property
    def pause_frames(self) -> int:
        samples = sum(round(p.seconds * SAMPLE_RATE) for p in self.parts if isinstance(p, Pause))
        return math.ceil(samples / SAMPLES_PER_FRAME)

    @property
    def audio_frames(self) -> int:
        """Every frame of audio the request may make (12.5 a second): speech and silence."""
        return self.speech_frames + self.pause_frames

    @property
    def model_steps(self) -> int:
        return sum(u.model_steps for u in self.utterances)

    def after(self, done: int) -> "RequestPlan":
        """The plan without its first ``done`` parts (a job resumed after the segments it kept)."""
        return replace(self, parts=self.parts[done:])


def utterance_fits(request: SynthesisRequest, work: PlannedWork, settings) -> bool:
    """Whether text planned as ``request`` (its ``work``) is spoken as one utterance. A model that
    decodes until it samples an end (a talker: it plans a frame budget) drifts over long
    utterances: its text's own budget (whatever ``max_new_tokens`` caps) keeps to
    ``--utterance-max-frames``, and the frames it may run to the per-utterance work limit
    (``--max-work-talker-steps``, 0 = none). Any other model's keep to what one engine request may
    cost (the per-request work limits)."""
    budget = request.budget
    if budget is not None:
        steps = settings.max_work_talker_steps
        own = budget.frames if budget.text_frames is None else budget.text_frames
        return own <= settings.utterance_max_frames and (not steps or budget.frames <= steps)
    frames, steps = settings.max_work_audio_frames, settings.max_work_frame_steps
    return (not frames or work.audio_frames <= frames) and (not steps or work.model_steps <= steps)


def plan_text(engine: SynthesisEngine, text: str, params: SynthesisParams, settings, *,
              clone: VoiceClone | None = None, text_feed: TextFeed | None = None,
              sentences: bool = False) -> RequestPlan:
    """``text`` as the parts it is spoken in, in order (see the module docstring): its break tags
    are pauses, and the text between them is cut into utterances that fit (``sentences``: at every
    sentence end too). ``params``: validated, the voice resolved (service/voices/clones.py)."""
    planner = _UtterancePlanner(engine, engine_request(engine, params, clone=clone, text_feed=text_feed), settings)
    pieces = split_breaks(text)
    if not any(isinstance(piece, Pause) for piece in pieces) and not sentences:
        parts: list[Part] = list(planner.utterances(text, 0))
    else:
        parts = []
        for piece, at in zip(pieces, _piece_starts(text, pieces)):
            if isinstance(piece, Pause):
                parts.append(piece)
                continue
            spoken = _sentences(piece) if sentences else [piece.strip()] if piece.strip() else []
            for sentence, start in zip(spoken, _starts(piece, spoken)):
                parts += planner.utterances(sentence, at + start)
    return RequestPlan(text, params, tuple(parts), planner.step_unit, engine_params(engine, params)[1],
                       ends_itself=engine.capabilities.max_new_tokens is not None)


class _UtterancePlanner:
    """Text (no breaks) as the utterances it is spoken in: as it is, or cut at sentence ends when
    it does not fit one (:func:`utterance_fits`); each piece measured is planned once by the engine
    (its ids, its frame budget), and a piece kept is submitted as it was planned."""

    def __init__(self, engine: SynthesisEngine, template: SynthesisRequest, settings):
        self.engine, self.template, self.settings = engine, template, settings
        self.planned: dict[str, tuple[SynthesisRequest, PlannedWork]] = {}
        self.step_unit = ""

    def _planned(self, piece: str) -> tuple[SynthesisRequest, PlannedWork]:
        if piece not in self.planned:
            request = self.engine.plan(replace(self.template, text=piece))
            self.planned[piece] = request, self.engine.planned_work(request)
        return self.planned[piece]

    def _fits(self, piece: str) -> bool:
        return utterance_fits(*self._planned(piece), self.settings)

    def utterances(self, text: str, start: int) -> list[Utterance]:
        """``text``, which starts at ``start`` of the request's text, as utterances."""
        if self._fits(text):
            pieces = [text]
        else:  # (pack_sentences on a yes/no measure: 1 fits, 2 does not)
            pieces = pack_sentences(text, 1, lambda piece: 1 if self._fits(piece) else 2) or [text]
        out = []
        for piece, at in zip(pieces, _starts(text, pieces)):
            request, work = self._planned(piece)
            self.step_unit = work.step_unit
            out.append(Utterance(piece, request, start + at, work.audio_frames, work.model_steps))
        return out


def _sentences(text: str) -> list[str]:
    """``text``'s sentences, stripped, the undecided rest last (as a socket's round ends)."""
    found, rest = split_sentences(text)
    return found + ([rest.strip()] if rest.strip() else [])


def _starts(text: str, pieces: list[str]) -> list[int]:
    """Where each piece starts in ``text``: the pieces hold text's characters in order with only
    whitespace changed (engines/text/sentences.py cuts, strips and joins with one space)."""
    out, i, n = [], 0, len(text)
    for piece in pieces:
        if text.startswith(piece, i):  # as written (the usual case): no character by character walk
            out.append(i)
            i += len(piece)
            continue
        while i < n and text[i].isspace():
            i += 1
        out.append(i)
        if text.startswith(piece, i):
            i += len(piece)
            continue
        for ch in piece:
            if not ch.isspace():
                while i < n and text[i].isspace():
                    i += 1
                i += 1
    return out


def _piece_starts(text: str, pieces: list[str | Pause]) -> list[int]:
    """Where each of :func:`split_breaks`' text pieces starts in ``text`` (0 for a pause): they
    are its text as written, in order, each at the start or right after a tag's ``>``."""
    out, cursor = [], 0
    for piece in pieces:
        if isinstance(piece, Pause):
            out.append(0)
            continue
        at = text.find(piece, cursor)
        while at > 0 and text[at - 1] != ">":  # found inside a tag before it: further on
            at = text.find(piece, at + 1)
        out.append(max(at, cursor))
        cursor = max(at, cursor) + len(piece)
    return out


INLINE_CHARS = 256  # longer text is planned and prepared on a thread: the loop never waits on a long plan


async def off_loop(text: str, call, *args, **kwargs):
    """``call(*args, **kwargs)`` for ``text``: inline when it is short, else on a thread."""
    if len(text) <= INLINE_CHARS:
        return call(*args, **kwargs)
    return await asyncio.to_thread(call, *args, **kwargs)


def check_work(engine: SynthesisEngine, text: str, params: SynthesisParams, settings,
               job_format: str | None = None, **plan) -> RequestPlan:
    """``text`` planned (:func:`plan_text`, with ``plan``'s ``clone``, ``text_feed`` and
    ``sentences``) and checked before any engine time (:func:`check_limits`; ``job_format``: a
    job's, spoken into one file of that format). Text that is not valid Unicode never reaches
    the engine (every route validated it already; this is the last gate, a 400 whatever the route)."""
    try:
        require_unicode("text", text)
    except FieldError as exc:
        raise ApiError(400, exc.code, str(exc)) from None
    plan = plan_text(engine, text, params, settings, **plan)
    check_limits(plan, settings, job_format)
    return plan


def check_limits(plan: RequestPlan, settings, job_format: str | None = None) -> None:
    """ApiError(413, ``too_much_work``) naming the limit and its flag when the whole plan (every
    utterance after speed, every pause) is over ``--max-work-audio-frames`` (a job:
    ``--max-job-audio-frames``, and a WAV job what a WAV file holds); when the whole plan is over
    ``--max-work-frame-steps`` (DiT; a job: ``--max-job-frame-steps``); when one utterance may
    run more than ``--max-work-talker-steps`` (a model of frame budgets: the talker). 0 = no limit."""
    job = job_format is not None
    talker = plan.ends_itself
    frames = plan.audio_frames
    frames_limit, flag = ((settings.max_job_audio_frames, "--max-job-audio-frames") if job
                          else (settings.max_work_audio_frames, "--max-work-audio-frames"))
    if frames_limit and frames > frames_limit:
        how = "lower max_new_tokens" if talker else "raise speed"
        raise ApiError(413, "too_much_work",
                       f"this {'job' if job else 'request'} plans {frames} audio frames (12.5 per second of audio: "
                       f"{plan.speech_frames} of speech after speed, {plan.pause_frames} of pauses); the limit is "
                       f"{frames_limit} ({flag}): shorten the text or its pauses, or {how}"
                       + ("" if job else "; a job (POST /v1/jobs) may plan up to --max-job-audio-frames"))
    if job_format == "wav" and frames * SAMPLES_PER_FRAME * 2 > WAV_MAX_DATA_BYTES:
        hours = WAV_MAX_DATA_BYTES / 2 / SAMPLE_RATE / 3600
        raise ApiError(413, "too_much_work",
                       f"this job plans {frames} audio frames ({frames / 12.5 / 3600:.1f} hours); a WAV file holds "
                       f"at most {hours:.1f} hours at {SAMPLE_RATE} Hz: ask for response_format flac, or shorten it")
    if talker:
        steps_limit = settings.max_work_talker_steps
        longest = max((u.model_steps for u in plan.utterances), default=0)
        if steps_limit and longest > steps_limit:
            raise ApiError(413, "too_much_work",
                           f"this utterance may run {longest} talker steps (its text's frame budget, at most "
                           f"max_new_tokens - 1); the limit is {steps_limit} (--max-work-talker-steps): "
                           "shorten the text or lower max_new_tokens")
        return
    steps_limit, flag = ((settings.max_job_frame_steps, "--max-job-frame-steps") if job
                         else (settings.max_work_frame_steps, "--max-work-frame-steps"))
    if steps_limit and plan.model_steps > steps_limit:
        raise ApiError(413, "too_much_work",
                       f"this {'job' if job else 'request'} plans {plan.model_steps} "
                       f"{plan.step_unit or 'model steps'} (frames x steps); the limit is {steps_limit} ({flag}): "
                       "shorten the input, raise speed or lower steps")


__all__ = ["BreakTags", "Part", "Pause", "RequestPlan", "Utterance", "break_tag", "check_limits", "check_work",
           "off_loop", "plan_text", "split_breaks", "utterance_fits"]
