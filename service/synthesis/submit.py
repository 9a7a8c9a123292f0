"""The one submit recipe every entry point uses (speech, WebSocket sessions, jobs):

    prepared = prepare(engine, request_id, text, params, priority, clone=..., tenant=...)
    stream = open_stream(state, prepared, high_water=...)   # a started ChunkStream

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
from service.synthesis.tempo import TempoStretch


@dataclass(frozen=True)
class Prepared:
    """A validated engine request and the speed the service stretches its audio by (None: none)."""

    request: SynthesisRequest
    stretch: float | None = None


def prepare(engine: SynthesisEngine, request_id: str, text: str, params: SynthesisParams, priority: Priority,
            clone: VoiceClone | None = None, tenant: str = "", text_feed: TextFeed | None = None,
            prompt_ids: tuple[int, ...] | None = None, timestamps: bool = False) -> Prepared:
    """The engine request for validated ``params``, checked by the engine (ApiError(400) naming
    the field) and tokenized once (``prompt_ids``: the ids an earlier ``prepare`` of the same
    text returned, for a job run where it was posted). A model that does not honour ``speed``
    gets 1.0 and the service stretches its audio instead (:mod:`service.synthesis.tempo`).
    ``timestamps``: word times wanted (asked of the engine only where it has an aligner)."""
    params, stretch = engine_params(engine, params)
    request = build_request(request_id, text, params, priority, clone=clone, tenant=tenant)
    if text_feed is not None or prompt_ids is not None:
        request = replace(request, text_feed=text_feed, prompt_ids=prompt_ids)
    if timestamps and engine.capabilities.timestamps:
        request = replace(request, timestamps=True)
    try:
        return Prepared(engine.validate(request), stretch)
    except EngineError as exc:
        raise engine_error(exc) from None


def open_stream(state: AppState, prepared: Prepared, high_water: int, clock: PlaybackClock | None = None) -> ChunkStream:
    """Submit a prepared request: a started :class:`ChunkStream` (its audio stretched when
    ``prepared.stretch`` says so); ApiError (:func:`engine_error`) when the engine refuses it."""
    stream = ChunkStream(state.engine, prepared.request, state.metrics, high_water=high_water)
    stream.tempo = TempoStretch(prepared.stretch) if prepared.stretch is not None else None
    if clock is not None:
        stream.clock = clock
    try:
        stream.start()
    except EngineError as exc:
        raise engine_error(exc) from None
    return stream


__all__ = ["Prepared", "open_stream", "prepare"]
