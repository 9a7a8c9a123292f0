"""The request fields are validated in one place (service/synthesis/schema.py): the same pydantic
models for the speech body, the jobs body and the WebSocket messages, with the API's
error messages. No engine, no server."""

from __future__ import annotations

import math

import pytest

from service.synthesis.schema import (
    MAX_SEED,
    FieldError,
    InputText,
    JobBody,
    SpeechBody,
    SynthesisParams,
    validate,
)

BAD_PARAMS = [
    ({"speed": 10}, "speed: must be between 0.25 and 4.0"),
    ({"speed": "fast"}, "speed: must be a number"),
    ({"speed": True}, "speed: must be a number"),
    ({"speed": 10**400}, "speed: must be a number"),
    ({"guidance_scale": math.nan}, "guidance_scale: must be a number"),
    ({"guidance_scale": math.inf}, "guidance_scale: must be a number"),
    ({"seed": -1}, f"seed: must be between 0 and {MAX_SEED}"),
    ({"seed": 1.5}, "seed: must be an integer"),
    ({"seed": "7"}, "seed: must be an integer"),
    ({"steps": 0}, "steps: must be between 1 and 64"),
    ({"voice": ""}, "voice: must be a non-empty string or {\"id\": \"name\"}"),
    ({"voice": 3}, "voice: must be a non-empty string or {\"id\": \"name\"}"),
    ({"language": "  "}, "language: must be a language name or 'Auto'"),
    ({"language": "x" * 65}, "language: must be a language name or 'Auto'"),
    ({"temperature": -0.1}, "temperature: must be between 0.0 and 5.0"),
    ({"temperature": "hot"}, "temperature: must be a number"),
    ({"repetition_penalty": 0}, "repetition_penalty: must be in (0.0, 10.0]"),
    ({"max_new_tokens": 0}, "max_new_tokens: must be between 1 and 16384"),
    ({"max_new_tokens": 2.5}, "max_new_tokens: must be an integer"),
    ({"initial_codec_chunk_frames": 0}, "initial_codec_chunk_frames: must be between 1 and 64"),
    ({"top_p": 1.5}, "top_p: must be in (0.0, 1.0]"),
    ({"top_k": -1}, "top_k: must be between 0 and 4096"),
    ({"greedy": 1}, "greedy: must be true or false"),
]


@pytest.mark.parametrize("model", [SpeechBody, JobBody])
@pytest.mark.parametrize("fields,message", BAD_PARAMS)
def test_the_bodies_share_the_parameter_ranges(model, fields, message):
    with pytest.raises(FieldError) as exc:
        validate(model, {"input": "Hi.", **fields})
    assert (exc.value.code, str(exc.value)) == ("invalid_field", message)


@pytest.mark.parametrize("fields,message", BAD_PARAMS)
def test_session_config_shares_the_parameter_ranges(fields, message):
    base = SynthesisParams(speed=2.0)
    with pytest.raises(FieldError) as exc:
        base.update(fields)
    assert str(exc.value) == message


def test_session_config_changes_only_the_fields_present():
    base = SynthesisParams().update({"speed": 2.0, "seed": 7})
    updated = base.update({"type": "session.config", "steps": 4, "voice": None})
    assert (updated.speed, updated.seed, updated.steps, updated.voice) == (2.0, 7, 4, "default")
    assert base.steps == 8


def test_speech_body_fields_and_defaults():
    body = validate(SpeechBody, {"input": "Hi.", "voice": "alloy", "speed": 1, "response_format": None,
                                 "language": " English "}, max_chars=10)
    assert (body.model, body.response_format, body.stream_format, body.speed) == ("streamvox", "mp3", None, 1.0)
    assert body.params == SynthesisParams(voice="alloy", language="English")
    assert validate(SpeechBody, {"input": "Hi.", "response_format": ""}).response_format == "mp3"
    assert validate(JobBody, {"input": "Hi."}).response_format == "wav"


@pytest.mark.parametrize("model,body,code,message", [
    (SpeechBody, {}, "invalid_field", "input: must be a non-empty string"),
    (SpeechBody, {"input": 123}, "invalid_field", "input: must be a non-empty string"),
    (SpeechBody, {"input": "   "}, "invalid_field", "input: must be a non-empty string"),
    (SpeechBody, {"input": "x" * 11}, "text_too_long", "input: 11 characters, the limit is 10"),
    (SpeechBody, {"input": "Hi.", "stream_format": "video"}, "invalid_field", "stream_format: choose one of audio, sse"),
    (SpeechBody, {"input": "Hi.", "response_format": "m4a"}, "invalid_field",
     "response_format: choose one of pcm, wav, flac, mp3, opus, aac, ulaw"),
    (SpeechBody, {"input": "Hi.", "instructions": 3}, "invalid_field", "instructions: must be a string of at most 4096 characters"),
    (JobBody, {"input": "Hi.", "response_format": "mp3"}, "invalid_field", "response_format: choose one of wav, flac"),
    (JobBody, {"input": ""}, "invalid_field", "input: must be a non-empty string"),
    (InputText, {"type": "input.text", "text": 5}, "invalid_field", "text: must be a string"),
    (InputText, {"type": "input.text"}, "invalid_field", "text: must be a string"),
])
def test_body_errors(model, body, code, message):
    with pytest.raises(FieldError) as exc:
        validate(model, body, max_chars=10)
    assert (exc.value.code, str(exc.value)) == (code, message)


def test_the_first_bad_field_is_reported_input_first():
    with pytest.raises(FieldError) as exc:
        validate(SpeechBody, {"input": "", "speed": 99, "model": "x"})
    assert exc.value.field == "input"
