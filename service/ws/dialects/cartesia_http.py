"""Cartesia's HTTP text-to-speech, a route of the one HTTP speech service (service/ws/dialects/http_speech.py).

- ``POST /tts/bytes`` (the SDK's ``tts.generate``): the audio, streamed as it is generated, in
  ``output_format``: ``{"container": "raw" | "wav", "encoding": "pcm_s16le" | "pcm_f32le" |
  "pcm_mulaw", "sample_rate"}`` or ``{"container": "mp3", "sample_rate", "bit_rate"}`` (an MP3
  stream at that bit rate).
- ``POST /tts/sse`` (``tts.generate_sse``): server-sent events ``chunk`` (base64 ``data``), with
  ``add_timestamps: true`` and an aligner (``--aligner``) ``timestamps`` (``word_timestamps``:
  ``{words, start, end}`` in seconds from the start of the audio) after each utterance's audio,
  then ``done``; a failure after the first audio is an ``error`` event.

Body ``{"model_id", "transcript", "voice": "<id>" | {"mode": "id", "id"}, "output_format", …}``;
``model_id``, ``language``, ``speed``, ``generation_config`` and the other fields Cartesia defines
are accepted and ignored, as on the socket. Errors are Cartesia's ``{"error", "title", "message",
"error_code", "status_code", "request_id"}``; keys as the socket (``X-API-Key`` or a bearer token).
"""

from __future__ import annotations

import base64
import json
import time

from aiohttp import web

from service.errors import ApiError
from service.http.middleware import ForeignApi
from service.speech import handler
from service.state import REQUEST_ID
from service.synthesis.numbers import json_whole_number, shown
from service.synthesis.timestamps import cartesia_words
from service.ws.dialects.cartesia import BadRequest, CartesiaSocket, output_format, voice_id
from service.ws.dialects.common import dialect_voice, unknown_voice
from service.ws.dialects.http_speech import DialectSpeech, Speech
from service.ws.dialects.wire_audio import CONTENT_TYPES

PREFIX = "/tts"
MP3_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
MP3_BIT_RATES = (32000, 64000, 96000, 128000, 192000)


def error_body(status: int, code: str, message: str, request_id: str) -> dict:
    return {"error": message, "title": code, "message": message, "error_code": code, "status_code": status,
            "request_id": request_id}


API = ForeignApi("Cartesia", (PREFIX,), CartesiaSocket.api_key, "X-API-Key header or Authorization: Bearer",
                 error_body)


def http_format(value: object) -> tuple[str, int, int | None, bool]:
    """``output_format`` of an HTTP request: (encoding, sample rate, mp3 bit rate, WAV header)."""
    if isinstance(value, dict) and value.get("container") == "mp3":
        # JSON numbers, whole (8000.0 is 8000: an encoder takes ints only)
        rate, bit_rate = json_whole_number(value.get("sample_rate")), json_whole_number(value.get("bit_rate"))
        if rate not in MP3_RATES:
            raise BadRequest(f"output_format.sample_rate: mp3 takes {', '.join(map(str, MP3_RATES))}, "
                             f"got {shown(value.get('sample_rate'))}")
        if bit_rate not in MP3_BIT_RATES:
            raise BadRequest(f"output_format.bit_rate: mp3 takes {', '.join(map(str, MP3_BIT_RATES))}, "
                             f"got {shown(value.get('bit_rate'))}")
        return "mp3", rate, bit_rate, False
    wav = isinstance(value, dict) and value.get("container") == "wav"
    encoding, rate = output_format({**value, "container": "raw"} if wav else value)
    return encoding, rate, None, wav


class CartesiaBytes(DialectSpeech):
    ENDPOINT = PREFIX + "/bytes"

    async def read(self, body: dict) -> Speech:
        try:
            transcript = body.get("transcript")
            if not isinstance(transcript, str) or not transcript.strip():
                raise BadRequest("transcript: must be a non-empty string")
            encoding, rate, bit_rate, wav = http_format(body.get("output_format"))
            name = body.get("voice")
            name = name if isinstance(name, str) and name else voice_id(name)  # an id, or {"mode": "id", "id"}
            voice = await dialect_voice(self.request, name)
            if voice is None:
                raise BadRequest(unknown_voice(self.request, "voice.id", name))
            if body.get("add_timestamps") is not None and not isinstance(body["add_timestamps"], bool):
                raise BadRequest("add_timestamps: must be true or false")
        except BadRequest as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        return Speech(text=transcript, voice=voice, encoding=encoding, rate=rate, bit_rate=bit_rate, wav=wav,
                      timestamps=body.get("add_timestamps") is True, text_field="transcript")

    def content_type(self) -> str:
        return "audio/wav" if self.speech.wav else CONTENT_TYPES[self.speech.encoding]


class CartesiaSse(CartesiaBytes):
    ENDPOINT = PREFIX + "/sse"
    CONTENT_TYPE = "text/event-stream"

    def __init__(self, request, state):
        super().__init__(request, state)
        self.context_id: str | None = None
        self.since = time.monotonic()

    async def read(self, body: dict) -> Speech:
        speech = await super().read(body)
        if speech.wav or speech.encoding == "mp3":
            raise ApiError(400, "invalid_request", "output_format.container: the SSE endpoint sends raw audio")
        context_id = body.get("context_id")
        if context_id is not None and (not isinstance(context_id, str) or len(context_id) > 256):
            raise ApiError(400, "invalid_request", "context_id: must be a string (at most 256 characters)")
        self.context_id = context_id
        return speech

    def content_type(self) -> str:
        return self.CONTENT_TYPE

    async def event(self, kind: str, message: dict) -> None:
        message = {"type": kind, **message}
        if self.context_id is not None:
            message["context_id"] = self.context_id
        await self.response.write(f"event: {kind}\ndata: {json.dumps(message)}\n\n".encode())

    async def write_audio(self, data: bytes) -> None:
        now = time.monotonic()
        step_ms = round((now - self.since) * 1000)
        self.since = now
        await self.event("chunk", {"data": base64.b64encode(data).decode(), "done": False, "status_code": 206,
                                   "step_time": step_ms})

    async def write_alignment(self, alignment, offset_ms: float) -> None:
        await self.event("timestamps", {"done": False, "status_code": 206,
                                        "word_timestamps": cartesia_words(alignment, offset_ms)})

    async def write_end(self) -> None:
        await self.event("done", {"done": True, "status_code": 200})

    async def write_failure(self, error: ApiError) -> None:
        await self.event("error", {"done": True, "status_code": error.status, "title": error.code,
                                   "message": error.message, "error_code": error.code,
                                   "request_id": self.request[REQUEST_ID]})


def add_routes(app: web.Application) -> None:
    for dialect in (CartesiaBytes, CartesiaSse):
        app.router.add_post(dialect.ENDPOINT, handler(dialect))
