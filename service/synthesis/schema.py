"""The request fields, validated in one place: pydantic models shared by the OpenAI speech
body, the jobs body, the WebSocket messages and the in-process CLI.

Every range a client can get wrong lives here. What depends on the loaded model (which
voices and languages exist) is the engine's to check (``Engine.validate``); the engine
trusts the ranges it is given. A JSON ``null`` counts as an absent field.

Errors come out as :class:`FieldError` (field, message, code), with the messages the API
documents: ``"speed: must be between 0.25 and 4.0"``.
"""

from __future__ import annotations

import json
import re
import typing
from typing import Any, ClassVar, Literal, Mapping, TypeVar

from annotated_types import Ge, Gt, Le, Lt
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

MAX_SEED = 2**63 - 1
MAX_JSON_INT_DIGITS = 40  # longer integer literals become floats (inf past 1e308): a field error, never a 500
MAX_LANGUAGE_CHARS = 64
MAX_NEW_TOKENS = 16_384  # talker tokens per utterance (80 ms each: 22 minutes); the KV cache may bound it lower
MAX_INITIAL_CHUNK_FRAMES = 64
# OpenAI's speech model names; the served checkpoint's own names are the engine's (service/synthesis/params.py)
MODEL_NAMES = ("streamvox", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
SPEECH_FORMATS = ("pcm", "wav", "flac", "mp3", "opus", "aac", "ulaw")
JOB_FORMATS = ("wav", "flac")
STREAM_FORMATS = ("audio", "sse")
DEFAULT_SPEECH_FORMAT = "mp3"  # OpenAI's default
# Qwen3-TTS tasks and release names: any release's name is accepted as ``model``.
TASK_TYPES = ("CustomVoice", "VoiceDesign", "Base")
QWEN3_TTS_MODEL = re.compile(r"^(?:[\w.-]+/)?Qwen3-TTS-12Hz-(?:0\.6B|1\.7B)-(?:Base|CustomVoice|VoiceDesign)$",
                             re.IGNORECASE)
MAX_INSTRUCTION_CHARS = 4096
DEFAULT_JOB_FORMAT = "wav"


class FieldError(ValueError):
    """A bad request field; ``code`` is the API error code (``invalid_field`` or ``text_too_long``)."""

    def __init__(self, field: str, message: str, code: str = "invalid_field"):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.code = code


class Strict(BaseModel):
    # strict: no "1" -> 1, no true -> 1, no 1.5 -> int; floats must be finite
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore", allow_inf_nan=False)

    MESSAGES: ClassVar[dict[str, str]] = {}
    """The message for a field's type errors, where the generic one ("must be a number") says too little."""


class SynthesisParams(Strict):
    """The parameters of one utterance: the defaults of every endpoint, updated by a
    speech or job body and by each WebSocket ``session.config``."""

    voice: str = Field("default", min_length=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # absent: the engine's choice (talker: random per request)
    steps: int = Field(8, ge=1, le=64)  # DiT denoising steps
    guidance_scale: float = Field(2.0, ge=0.0, le=20.0)
    speed: float = Field(1.0, ge=0.25, le=4.0)
    language: str = "Auto"  # talker source: a language name or "Auto"
    # --- sampling: absent = the checkpoint's generation_config.json; temperature 0 = greedy
    greedy: bool | None = None  # true: greedy (as temperature 0)
    temperature: float | None = Field(None, ge=0.0, le=5.0)
    top_k: int | None = Field(None, ge=0, le=4096)  # 0: off
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    initial_codec_chunk_frames: int | None = Field(None, ge=1, le=MAX_INITIAL_CHUNK_FRAMES)  # frames before 1st PCM
    # --- end sampling
    # Qwen3-TTS task and prompt (vllm-omni's names). None: the loaded release's default.
    task_type: Literal[TASK_TYPES] | None = None
    instructions: str | None = Field(None, max_length=MAX_INSTRUCTION_CHARS)
    non_streaming_mode: bool | None = None

    MESSAGES: ClassVar[dict[str, str]] = {
        "voice": "must be a non-empty string or {\"id\": \"name\"}",
        "language": "must be a language name or 'Auto'",
        "instructions": f"must be a string of at most {MAX_INSTRUCTION_CHARS} characters",
    }

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_object(cls, value: Any) -> Any:
        # OpenAI and vllm-omni also take a voice as {"id": "name"}
        if isinstance(value, dict) and set(value) == {"id"}:
            return value["id"]
        return value

    @field_validator("language")
    @classmethod
    def _language(cls, value: str) -> str:
        value = value.strip()
        if not value or len(value) > MAX_LANGUAGE_CHARS:
            raise ValueError("bad language")
        return value

    def update(self, fields: Mapping[str, Any]) -> SynthesisParams:
        """These parameters with the fields of ``fields`` that are present (and not null) changed."""
        names = type(self).model_fields
        changes = {k: v for k, v in fields.items() if k in names and v is not None}
        return validate(type(self), {**self.model_dump(), **changes})


def too_long(field: str, chars: int, limit: int) -> str:
    """The one text-limit message of every surface: HTTP bodies, WebSocket text, the CLI."""
    return f"{field}: {chars} characters, the limit is {limit}"


def _speakable(cls, value: str, info: ValidationInfo) -> str:
    """The one check of a whole text to speak, on every route that takes one: non-empty, at
    most ``context["max_chars"]`` characters (lone surrogates were refused by :func:`validate`)."""
    if not value.strip():
        raise ValueError("empty")
    limit = (info.context or {}).get("max_chars")
    if limit is not None and len(value) > limit:
        raise PydanticCustomError("text_too_long", "{chars} characters, the limit is {limit}",
                                  {"chars": len(value), "limit": limit})
    return value


class _Input(Strict):
    """``input``: non-empty text of at most ``context["max_chars"]`` characters."""

    input: str

    _input = field_validator("input")(_speakable)


class SpeechText(Strict):
    """``text``: the whole text of a request under another service's name for it (the dialects'
    HTTP routes: ``text``, ``transcript``), checked exactly as ``input`` (:func:`speakable_text`)."""

    text: str

    MESSAGES: ClassVar[dict[str, str]] = {"text": "must be a non-empty string"}

    _text = field_validator("text")(_speakable)


def speakable_text(field: str, value: Any, max_chars: int | None) -> str:
    """``value`` checked as every route checks a text to speak (a non-empty string of valid
    Unicode, at most ``max_chars`` characters); FieldError naming ``field`` otherwise."""
    try:
        return validate(SpeechText, {"text": value}, max_chars=max_chars).text
    except FieldError as exc:
        raise FieldError(field, exc.message, exc.code) from None


class CloneFields(Strict):
    """Voice cloning from a reference (vllm-omni's names): on speech bodies and on
    WebSocket ``session.config`` (service/voices/clones.py decodes and checks the audio)."""

    ref_audio: str | None = None  # base64 audio or a data: URL
    ref_text: str | None = Field(None, max_length=MAX_INSTRUCTION_CHARS)
    x_vector_only_mode: bool | None = None

    MESSAGES: ClassVar[dict[str, str]] = {"ref_audio": "must be base64 audio or a data: URL",
                                          "ref_text": f"must be a string of at most {MAX_INSTRUCTION_CHARS} "
                                                      "characters",
                                          "x_vector_only_mode": "must be true or false"}


class SpeechBody(SynthesisParams, CloneFields, _Input):
    """``POST /v1/audio/speech``."""

    model: str = "streamvox"  # MODEL_NAMES, a Qwen3-TTS release name or the served checkpoint's (service/synthesis/params.py)
    response_format: Literal[SPEECH_FORMATS] = DEFAULT_SPEECH_FORMAT
    stream_format: Literal[STREAM_FORMATS] | None = None
    # OpenAI / vllm-omni conformance: ``stream`` true = SSE (when stream_format is absent),
    # false = one whole file; absent = OpenAI's default (streamed bytes where the format allows)
    stream: bool | None = None
    sample_rate: int | None = Field(None, ge=8000, le=48000)  # resampled with soxr
    timestamps: bool = False  # SSE: a speech.audio.alignment event with the word times (an aligner loaded)

    MESSAGES: ClassVar[dict[str, str]] = {**SynthesisParams.MESSAGES, **CloneFields.MESSAGES,
                                          "input": "must be a non-empty string"}

    @property
    def params(self) -> SynthesisParams:
        return SynthesisParams.model_construct(**{k: getattr(self, k) for k in SynthesisParams.model_fields})


class JobBody(SynthesisParams, _Input):
    """``POST /v1/jobs``."""

    response_format: Literal[JOB_FORMATS] = DEFAULT_JOB_FORMAT

    MESSAGES: ClassVar[dict[str, str]] = {**SynthesisParams.MESSAGES, "input": "must be a non-empty string"}

    @property
    def params(self) -> SynthesisParams:
        return SynthesisParams.model_construct(**{k: getattr(self, k) for k in SynthesisParams.model_fields})


class InputText(Strict):
    """WebSocket ``input.text``: text to append (may be empty or whitespace)."""

    text: str

    MESSAGES: ClassVar[dict[str, str]] = {"text": "must be a string"}


# WebSocket ``session.config`` is :meth:`SynthesisParams.update` of the session's parameters.


# --- live text ---
class LiveTextConfig(Strict):
    """WebSocket ``session.config`` ``text_streaming``: true (the default on a talker
    checkpoint) speaks while the text arrives; false cuts sentences first."""

    text_streaming: bool | None = None

    MESSAGES: ClassVar[dict[str, str]] = {"text_streaming": "must be true or false"}

M = TypeVar("M", bound=Strict)


class JsonError(ValueError):
    """A request body or message that is not acceptable JSON (API code ``invalid_json``)."""


def _parse_int(digits: str) -> int | float:
    # int() of thousands of digits is slow and raises ValueError past 4,300; a huge
    # number is out of every range anyway, so it reaches validation as a float
    if len(digits.lstrip("-")) > MAX_JSON_INT_DIGITS:
        return float(digits)
    return int(digits)


def parse_json(text: str) -> Any:
    """The one JSON decoder for request bodies and WebSocket messages: any failure
    (syntax, nesting too deep, absurd numbers) is a :class:`JsonError`, never a crash."""
    try:
        return json.loads(text, parse_int=_parse_int)
    except RecursionError:
        raise JsonError("the JSON is nested too deeply") from None
    except (ValueError, OverflowError):  # JSONDecodeError is a ValueError
        raise JsonError("not valid JSON") from None


def require_unicode(name: str, value: str) -> None:
    """A lone surrogate ("\\ud800" in JSON) is not text: FieldError naming the field."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise FieldError(name, "is not valid Unicode (lone surrogate)") from None


def _check_unicode(model: type[Strict], data: Mapping[str, Any]) -> None:
    for name, value in data.items():
        if isinstance(value, str) and name in model.model_fields:
            require_unicode(name, value)


def validate(model: type[M], data: Mapping[str, Any], **context: Any) -> M:
    """``model`` from ``data`` (nulls dropped); raises :class:`FieldError` naming the first bad field."""
    present = {k: v for k, v in data.items() if v is not None}
    _check_unicode(model, present)
    if isinstance(present.get("response_format"), str) and not present["response_format"]:
        del present["response_format"]  # "" means the default, as OpenAI does
    try:
        return model.model_validate(present, context=context or None)
    except ValidationError as exc:
        raise _first_error(model, exc) from None


def _first_error(model: type[Strict], exc: ValidationError) -> FieldError:
    errors = exc.errors(include_url=False)
    order = list(model.model_fields)
    errors.sort(key=lambda e: order.index(e["loc"][0]) if e["loc"] and e["loc"][0] in order else len(order))
    error = errors[0]
    field = str(error["loc"][0]) if error["loc"] else "body"
    kind = error["type"]
    if kind == "text_too_long":
        return FieldError(field, error["msg"], code="text_too_long")
    info = model.model_fields.get(field)
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal") and info is not None:
        return FieldError(field, range_message(info.metadata))
    if kind == "literal_error" and info is not None:
        return FieldError(field, f"choose one of {', '.join(_choices(info.annotation))}")
    if field in model.MESSAGES:
        return FieldError(field, model.MESSAGES[field])
    if kind.startswith("int") or (info is not None and info.annotation is int):
        return FieldError(field, "must be an integer")
    if kind.startswith("bool"):
        return FieldError(field, "must be true or false")
    if kind.startswith("float") or kind == "finite_number":
        return FieldError(field, "must be a number")
    if kind == "missing":
        return FieldError(field, "is required")
    return FieldError(field, "must be a string" if kind.startswith("string") else error["msg"])


def range_message(metadata: list) -> str:
    """"must be between 1 and 64", "must be in (0.0, 5.0]", "must be >= 0" from a field's bounds."""
    low = high = None
    low_open = high_open = False
    for bound in metadata:
        if isinstance(bound, Ge):
            low = bound.ge
        elif isinstance(bound, Gt):
            low, low_open = bound.gt, True
        elif isinstance(bound, Le):
            high = bound.le
        elif isinstance(bound, Lt):
            high, high_open = bound.lt, True
    if low is not None and high is not None:
        if not low_open and not high_open:
            return f"must be between {low} and {high}"
        return f"must be in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"must be {'>' if low_open else '>='} {low}"
    return f"must be {'<' if high_open else '<='} {high}"


def _choices(annotation: Any) -> list[str]:
    if typing.get_origin(annotation) is Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return [c for arg in typing.get_args(annotation) for c in _choices(arg)]  # Literal[...] | None
