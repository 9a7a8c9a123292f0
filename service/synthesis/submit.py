"""How every entry point submits a planned text (speech, WebSocket sessions, jobs):

    plan = check_work(engine, text, params, settings, clone=...)   # plan.py: planned once, checked
    stream = open_stream(state, plan, request_id, priority, tenant=..., high_water=...)

``open_stream`` submits the plan's engine requests as they were planned (their ids, frame budgets,
voice and sampling: plan.py), each under its own id (``request_id``, ``request_id.1``, ...), for
whom (``tenant``) and how urgently (``priority``); the engine checks each once, when it is
submitted. A model that does not honour ``speed`` had 1.0 planned and the service stretches its
audio instead (:mod:`service.synthesis.tempo`). Refusals raise :class:`~service.errors.ApiError`,
from the one map of engine refusals to client errors (:func:`service.errors.engine_error`).
"""

from __future__ import annotations

from dataclasses import replace

from engines.contract import EngineError, Priority, SynthesisEngine, SynthesisRequest
from service.errors import engine_error
from service.state import AppState
from service.synthesis.chunks import ChunkStream, PlaybackClock
from service.synthesis.plan import Part, Pause, RequestPlan
from service.synthesis.sequence import UtteranceSequence
from service.synthesis.tempo import TempoStretch


def submitted(plan: RequestPlan, request_id: str, priority: Priority, tenant: str = "",
              timestamps: bool = False) -> list[SynthesisRequest | Pause]:
    """The plan's parts as they are submitted: each utterance's engine request as planned, under
    its id, for ``tenant`` (:func:`service.access.limits.client_identity`: fair slot order) at
    ``priority``; ``timestamps``: word times wanted (asked of an engine that has an aligner)."""
    out: list[SynthesisRequest | Pause] = []
    for part in plan.parts:
        if isinstance(part, Pause):
            out.append(part)
            continue
        spoken = len([p for p in out if isinstance(p, SynthesisRequest)])
        out.append(replace(part.request, id=f"{request_id}.{spoken}" if spoken else request_id, priority=priority,
                           tenant=tenant, timestamps=timestamps))
    return out


def open_stream(state: AppState, plan: RequestPlan, request_id: str, priority: Priority, *, tenant: str = "",
                timestamps: bool = False, high_water: int,
                clock: PlaybackClock | None = None) -> ChunkStream | UtteranceSequence:
    """Submit a planned text: a started :class:`ChunkStream` when it is one utterance as sent, an
    :class:`UtteranceSequence` (the same interface) for several, for pauses or for text that was
    trimmed (its audio stretched when ``plan.stretch`` says so); ApiError (:func:`engine_error`)
    when the engine refuses it."""
    timestamps = timestamps and state.engine.capabilities.timestamps
    parts = submitted(plan, request_id, priority, tenant, timestamps)
    if not plan.as_sent:
        return _started(UtteranceSequence(state.engine, parts, state.metrics, high_water=high_water,
                                          stretch=plan.stretch, plan=plan), clock)
    stream = ChunkStream(state.engine, parts[0], state.metrics, high_water=high_water)
    stream.tempo = TempoStretch(plan.stretch) if plan.stretch is not None else None
    return _started(stream, clock)


def open_sequence(state: AppState, plan: RequestPlan, request_id: str, priority: Priority, *, tenant: str = "",
                  timestamps: bool = False, high_water: int, after: Part | None = None) -> UtteranceSequence:
    """Submit a planned text as an :class:`UtteranceSequence` whatever its parts (a job keeps each
    part's audio apart); ``after``: the part it continues when a plan's earlier parts were played."""
    parts = submitted(plan, request_id, priority, tenant, timestamps and state.engine.capabilities.timestamps)
    return _started(UtteranceSequence(state.engine, parts, state.metrics, high_water=high_water,
                                      stretch=plan.stretch, after=after, plan=plan), None)


def check_plan(engine: SynthesisEngine, plan: RequestPlan) -> None:
    """The plan's engine requests checked now as the engine checks them when they are submitted (a
    job's: posted long before it runs, maybe on another replica); ApiError naming the field."""
    for utterance in plan.utterances:
        try:
            engine.validate(utterance.request)
        except EngineError as exc:
            raise engine_error(exc) from None


def _started(stream, clock: PlaybackClock | None):
    if clock is not None:
        stream.clock = clock
    try:
        stream.start()
    except EngineError as exc:
        raise engine_error(exc) from None
    return stream


__all__ = ["check_plan", "open_sequence", "open_stream", "submitted"]
