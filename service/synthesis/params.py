"""The service side of request validation: the pydantic models of :mod:`service.synthesis.schema`
(field ranges) as API errors, the voice resolved by the engine (the loaded model's
voices), and the engine request built from validated parameters."""

from __future__ import annotations

import os
from typing import Any, Mapping, TypeVar

from engines.checkpoints.hub import parse_model_id
from engines.contract import (
    EngineError,
    SynthesisEngine,
    SynthesisRequest,
    TextFeed,
    VoiceClone,
)
from service.errors import ApiError, engine_error
from service.synthesis.audio import check_format
from service.synthesis.schema import (
    MODEL_NAMES,
    QWEN3_TTS_MODEL,
    FieldError,
    JobBody,
    SpeechBody,
    Strict,
    SynthesisParams,
    require_unicode,
    speakable_text,
    validate,
)

M = TypeVar("M", bound=Strict)

__all__ = ["JobBody", "SpeechBody", "SynthesisParams", "check_model", "check_text", "engine_params", "engine_request",
           "check_params", "parse", "parse_body", "public_model_name", "served_model_names", "update_params"]

def parse(model: type[M], data: Mapping[str, Any], **context: Any) -> M:
    """``model`` from ``data``; raises ApiError(400, ``invalid_field`` / ``text_too_long``)."""
    try:
        return validate(model, data, **context)
    except FieldError as exc:
        raise ApiError(400, exc.code, str(exc)) from None


def check_text(field: str, value: Any, max_chars: int) -> str:
    """A whole text to speak named ``field`` by its route, checked as every route's
    (:func:`~service.synthesis.schema.speakable_text`); ApiError(400, ``invalid_field`` /
    ``text_too_long``) otherwise."""
    try:
        return speakable_text(field, value, max_chars)
    except FieldError as exc:
        raise ApiError(400, exc.code, str(exc)) from None


def engine_params(engine: SynthesisEngine, params: SynthesisParams) -> tuple[SynthesisParams, float | None]:
    """``params`` as the engine takes them, and the speed the service stretches the audio by
    (None: none): a model that does not honour ``speed`` gets 1.0 (the talker)."""
    if params.speed == 1.0 or engine.capabilities.honours("speed"):
        return params, None
    return params.model_copy(update={"speed": 1.0}), params.speed


def check_params(engine: SynthesisEngine, params: SynthesisParams, *, clone: VoiceClone | None = None,
                 live_text: bool = False) -> SynthesisParams:
    """``params`` (with the voice prompt ``clone``) checked against the loaded model now, not when
    the work starts, by :meth:`SynthesisEngine.validate` on the fields present (voice, language,
    task fields; ``live_text``: whether text may arrive live); returned with the model's name for
    the voice. The text is the request's, planned and checked when it is submitted
    (:mod:`service.synthesis.plan`, :mod:`service.synthesis.submit`). ApiError(400) naming the
    field; an unknown voice's message lists the valid ones."""
    request = engine_request(engine, params, clone=clone, text_feed=TextFeed() if live_text else None)
    try:
        voice = engine.validate(request, complete=False).voice
    except EngineError as exc:
        raise engine_error(exc) from None
    return params if voice == params.voice else params.model_copy(update={"voice": voice})


def parse_body(model: type[M], body: Mapping[str, Any], max_chars: int) -> M:
    """A speech or job body: its fields validated, its format available."""
    parsed = parse(model, body, max_chars=max_chars)
    check_format(parsed.response_format)  # libsndfile may lack mp3 / opus: format_unavailable
    return parsed


def served_model_names(checkpoint: str | None) -> tuple[str, ...]:
    """The ``model`` names a speech request may give: OpenAI's, ``streamvox``, the served
    checkpoint's directory (or repo) name with and without the ``Qwen/`` organisation (what
    clients written for vllm-omni send, e.g. ``Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice``), and the
    Hugging Face id it was fetched by, when it was."""
    names = list(MODEL_NAMES)
    if checkpoint:
        base = os.path.basename(os.path.normpath(checkpoint))
        names += [base, f"Qwen/{base}"]
        if parse_model_id(checkpoint) and not os.path.isabs(checkpoint):
            names.append(checkpoint)
    return tuple(dict.fromkeys(names))


def public_model_name(name: str | None) -> str | None:
    """How clients see a model the operator named (``--aligner``): a Hugging Face id as given,
    a local directory by its last component only - the operator's paths are not theirs to see."""
    if not name:
        return None
    if parse_model_id(name) and not os.path.isabs(name) and not os.path.exists(name):
        return name
    return os.path.basename(os.path.normpath(name))


def check_model(model: str, checkpoint: str | None) -> None:
    """ApiError(400) naming the accepted names when ``model`` is not one of them."""
    names = served_model_names(checkpoint)
    # vllm-omni clients send the Hugging Face repo name of the release they were written for.
    if model not in names and not QWEN3_TTS_MODEL.match(model):
        raise ApiError(400, "invalid_field", f"model: choose one of {', '.join(names)} or a Qwen3-TTS "
                                             "release name such as Qwen/Qwen3-TTS-12Hz-0.6B-Base")


def update_params(params: SynthesisParams, fields: Mapping[str, Any]) -> SynthesisParams:
    """A WebSocket ``session.config``: the fields present change ``params`` (ApiError(400) naming
    a field out of range)."""
    try:
        return params.update(fields)
    except FieldError as exc:
        raise ApiError(400, exc.code, str(exc)) from None


def engine_request(engine: SynthesisEngine, params: SynthesisParams, *, clone: VoiceClone | None = None,
                   text_feed: TextFeed | None = None) -> SynthesisRequest:
    """What every engine request of a text shares, built from validated ``params`` as the engine
    takes them (:func:`engine_params`), with the voice prompt ``clone`` and a live ``text_feed``;
    its id, text and plan come later (service/synthesis/plan.py, submit.py). An absent ``seed``
    stays ``None``: the engine picks (the talker a fresh random seed per request, the DiT seed 0)."""
    return SynthesisRequest(id="", text="", clone=clone, text_feed=text_feed, **engine_params(engine, params)[0].model_dump())
