"""The one submit recipe every entry point uses (speech, WebSocket sessions, jobs):

    parts = check_work(engine, text, params, settings)       # plan.py: long text -> utterances, checked
    prepared = prepare(engine, request_id, parts, params, priority, clone=..., tenant=...)
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
from service.synthesis.params import SynthesisParams, build_request, engine_params
from service.synthesis.plan import Part, Pause, Utterance
from service.synthesis.sequence import UtteranceSequence
from service.synthesis.tempo import TempoStretch


@dataclass(frozen=True)
class Prepared:
    """The validated engine requests of a text's parts (one per utterance, and its pauses:
    service/synthesis/plan.py) and the speed the service stretches their audio by (None: none)."""

    parts: tuple[SynthesisRequest | Pause, ...]
    stretch: float | None = None

    @property
    def request(self) -> SynthesisRequest | None:
        """The engine request when the text is spoken as one utterance; None when it was planned
        as several."""
        return self.parts[0] if len(self.parts) == 1 and isinstance(self.parts[0], SynthesisRequest) else None


def prepare(engine: SynthesisEngine, request_id: str, text: str | list[Part], params: SynthesisParams,
            priority: Priority, clone: VoiceClone | None = None, tenant: str = "", text_feed: TextFeed | None = None,
            prompt_ids: tuple[int, ...] | None = None, timestamps: bool = False) -> Prepared:
    """The engine requests for validated ``params``, checked by the engine (ApiError(400) naming
    the field) and tokenized once. ``text``: the text, or the parts :func:`~service.synthesis.plan.check_work`
    planned it as (one request per utterance, ids ``request_id``, ``request_id.1``, ...; each served
    with the ids it was planned on). ``prompt_ids``: the ids of ``text`` given as a string, when an
    earlier ``prepare`` returned them (a job run where it was posted). A model that does not honour ``speed`` gets 1.0 and the service
    stretches its audio instead (:mod:`service.synthesis.tempo`). ``timestamps``: word times
    wanted (asked of the engine only where it has an aligner)."""
    params, stretch = engine_params(engine, params)
    parts = [Utterance(text, prompt_ids)] if isinstance(text, str) else list(text)
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
    return Prepared(tuple(out), stretch)


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
                                      stretch=prepared.stretch, after=after), clock)


def _started(stream, clock: PlaybackClock | None):
    if clock is not None:
        stream.clock = clock
    try:
        stream.start()
    except EngineError as exc:
        raise engine_error(exc) from None
    return stream


__all__ = ["Prepared", "open_sequence", "open_stream", "prepare"]
