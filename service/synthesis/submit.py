"""The one submit recipe every entry point uses (speech, WebSocket sessions, jobs):

    plan = check_work(engine, text, params, settings)        # plan.py: the whole request planned, checked
    prepared = prepare(engine, request_id, plan, priority, clone=..., tenant=...)
    stream = open_stream(state, prepared, high_water=...)   # a started ChunkStream (or UtteranceSequence)

``prepare`` builds the engine request, decides who honours ``speed`` (the model, or the service
by time-stretching the audio when the model does not), and has the engine validate it: the
request comes back with its text tokenized, so nothing downstream tokenizes it again.
``open_stream`` submits it. Both raise :class:`~service.errors.ApiError`, from the one map of
engine refusals to client errors (:func:`service.errors.engine_error`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engines.contract import (
    EngineError,
    Priority,
    SynthesisEngine,
    SynthesisRequest,
    TextFeed,
    VoiceClone,
)
from service.errors import engine_error
from service.state import AppState
from service.synthesis.chunks import ChunkStream, PlaybackClock
from service.synthesis.params import build_request, engine_params
from service.synthesis.plan import Part, Pause, RequestPlan
from service.synthesis.sequence import UtteranceSequence
from service.synthesis.tempo import TempoStretch


@dataclass(frozen=True)
class Prepared:
    """The validated engine requests of a plan's parts (one per utterance, and its pauses:
    service/synthesis/plan.py), one for one, with the plan."""

    plan: RequestPlan
    parts: tuple[SynthesisRequest | Pause, ...]

    @property
    def stretch(self) -> float | None:
        """The speed the service stretches the audio by (None: none)."""
        return self.plan.stretch

    @property
    def request(self) -> SynthesisRequest | None:
        """The engine request when the text is spoken as one utterance, as sent; None when it was
        planned as several (or pauses, or its text was trimmed: a sequence places its word times)."""
        if len(self.parts) != 1 or not isinstance(self.parts[0], SynthesisRequest):
            return None
        return self.parts[0] if self.parts[0].text == self.plan.text else None


def prepare(engine: SynthesisEngine, request_id: str, plan: RequestPlan, priority: Priority,
            clone: VoiceClone | None = None, tenant: str = "", text_feed: TextFeed | None = None,
            timestamps: bool = False) -> Prepared:
    """The engine requests of ``plan`` (:func:`~service.synthesis.plan.check_work`: one request per
    utterance, ids ``request_id``, ``request_id.1``, ...; each served with the ids it was planned
    on), checked by the engine (ApiError(400) naming the field). A model that does not honour
    ``speed`` gets 1.0 and the service stretches its audio instead (:mod:`service.synthesis.tempo`).
    ``text_feed``: the one utterance's text arrives live. ``timestamps``: word times wanted (asked
    of the engine only where it has an aligner)."""
    params = engine_params(engine, plan.params)[0]
    parts = plan.parts
    out: list[SynthesisRequest | Pause] = []
    spoken = 0
    for part in parts:
        if isinstance(part, Pause):
            out.append(part)
            continue
        request = build_request(request_id if not spoken else f"{request_id}.{spoken}", part.text, params, priority,
                                clone=clone, tenant=tenant)
        if part.prompt_ids is not None:
            request = replace(request, prompt_ids=part.prompt_ids)
        if text_feed is not None and len(parts) == 1:
            request = replace(request, text_feed=text_feed)
        if timestamps and engine.capabilities.timestamps:
            request = replace(request, timestamps=True)
        try:
            out.append(engine.validate(request))
        except EngineError as exc:
            raise engine_error(exc) from None
        spoken += 1
    return Prepared(plan, tuple(out))


def open_stream(state: AppState, prepared: Prepared, high_water: int,
                clock: PlaybackClock | None = None) -> ChunkStream | UtteranceSequence:
    """Submit a prepared text: a started :class:`ChunkStream` for one utterance, an
    :class:`UtteranceSequence` (the same interface) for several or for pauses (its audio
    stretched when ``prepared.stretch`` says so); ApiError (:func:`engine_error`) when the
    engine refuses it."""
    if prepared.request is None:
        return open_sequence(state, prepared, high_water, clock=clock)
    stream = ChunkStream(state.engine, prepared.request, state.metrics, high_water=high_water)
    stream.tempo = TempoStretch(prepared.stretch) if prepared.stretch is not None else None
    return _started(stream, clock)


def open_sequence(state: AppState, prepared: Prepared, high_water: int, clock: PlaybackClock | None = None,
                  after: Part | None = None) -> UtteranceSequence:
    """Submit a prepared text as an :class:`UtteranceSequence` whatever its parts (a job keeps
    each part's audio apart); ``after``: the part it continues when a plan's earlier parts were played."""
    return _started(UtteranceSequence(state.engine, list(prepared.parts), state.metrics, high_water=high_water,
                                      stretch=prepared.stretch, after=after, plan=prepared.plan), clock)


def _started(stream, clock: PlaybackClock | None):
    if clock is not None:
        stream.clock = clock
    try:
        stream.start()
    except EngineError as exc:
        raise engine_error(exc) from None
    return stream


__all__ = ["Prepared", "open_sequence", "open_stream", "prepare"]
