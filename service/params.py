"""Validation of the synthesis parameters shared by speech, jobs and WebSocket sessions."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping

from engines.contract import InvalidRequest, Priority, SynthesisEngine, SynthesisRequest

from .errors import ApiError, invalid_field

MAX_SEED = 2**63 - 1
STEPS_RANGE = (1, 64)
GUIDANCE_RANGE = (0.0, 20.0)
SPEED_RANGE = (0.25, 4.0)


@dataclass(frozen=True)
class VoiceParams:
    voice: str = "default"
    seed: int = 0
    steps: int = 8
    guidance_scale: float = 2.0
    speed: float = 1.0
    language: str = "Auto"  # talker source: a language name or "Auto"


def _int_field(body: Mapping, name: str, low: int, high: int) -> int:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_field(name, "must be an integer")
    if not low <= value <= high:
        raise invalid_field(name, f"must be between {low} and {high}")
    return value


def _float_field(body: Mapping, name: str, low: float, high: float) -> float:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid_field(name, "must be a number")
    if not low <= value <= high:
        raise invalid_field(name, f"must be between {low} and {high}")
    return float(value)


def resolve_voice(engine: SynthesisEngine, name: object) -> str:
    if not isinstance(name, str) or not name:
        raise invalid_field("voice", "must be a non-empty string")
    try:
        return engine.resolve_voice(name)
    except InvalidRequest:
        valid = sorted(set(engine.info.voices) | set(engine.info.voice_aliases))
        raise invalid_field("voice", f"unknown voice {name[:64]!r}; valid voices: {', '.join(valid)}") from None


def parse_params(body: Mapping, engine: SynthesisEngine, base: VoiceParams = VoiceParams()) -> VoiceParams:
    """The fields of ``body`` that are present override ``base``; raises ApiError(400)."""
    changes: dict[str, object] = {}
    if body.get("voice") is not None:
        changes["voice"] = resolve_voice(engine, body["voice"])
    if body.get("seed") is not None:
        changes["seed"] = _int_field(body, "seed", 0, MAX_SEED)
    if body.get("steps") is not None:
        changes["steps"] = _int_field(body, "steps", *STEPS_RANGE)
    if body.get("guidance_scale") is not None:
        changes["guidance_scale"] = _float_field(body, "guidance_scale", *GUIDANCE_RANGE)
    if body.get("speed") is not None:
        changes["speed"] = _float_field(body, "speed", *SPEED_RANGE)
    if body.get("language") is not None:
        language = body["language"]
        if not isinstance(language, str) or not language.strip() or len(language) > 64:
            raise invalid_field("language", "must be a language name or 'Auto'")
        changes["language"] = language.strip()
    return replace(base, **changes)


def parse_input(body: Mapping, max_chars: int, name: str = "input") -> str:
    text = body.get(name)
    if not isinstance(text, str) or not text.strip():
        raise invalid_field(name, "must be a non-empty string")
    if len(text) > max_chars:
        raise ApiError(400, "text_too_long", f"{name}: {len(text)} characters, the limit is {max_chars}")
    return text


def build_request(request_id: str, text: str, params: VoiceParams, priority: Priority) -> SynthesisRequest:
    return SynthesisRequest(id=request_id, text=text, voice=params.voice, seed=params.seed, steps=params.steps,
                            guidance_scale=params.guidance_scale, speed=params.speed, priority=priority,
                            language=params.language)
