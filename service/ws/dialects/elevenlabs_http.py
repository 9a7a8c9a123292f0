"""ElevenLabs' HTTP text-to-speech, on the context core of its sockets (service/ws/dialects/http_speech.py).

- ``POST /v1/text-to-speech/{voice_id}`` (the SDK's ``text_to_speech.convert``) and
  ``POST …/stream``: the audio bytes, streamed as they are generated, in the ``output_format``
  of the query (as the sockets: ``pcm_<rate>``, ``mp3_<rate>_<kbps>`` at that bit rate, ``ulaw_8000``).
- ``POST …/stream/with-timestamps``: newline-separated JSON ``{"audio_base64", "alignment": null,
  "normalized_alignment": null}`` as the audio comes; with an aligner (``--aligner``) each
  utterance's audio is followed by a line whose ``alignment`` / ``normalized_alignment`` is
  ElevenLabs' HTTP timing ``{characters, character_start_times_seconds,
  character_end_times_seconds}`` of that utterance, in seconds from the start of the response.
- ``POST …/with-timestamps`` (``convert_with_timestamps``): one JSON object with all the audio
  (``audio_base64``) and the timing of the whole text (null without an aligner: no invented times).

Body ``{"text", "model_id"?, "voice_settings"?, …}``: only ``voice_settings.speed`` changes the
speech; the other fields are accepted and ignored. Errors are ElevenLabs' ``{"detail": {"status",
"message"}}``; keys as the sockets (``xi-api-key``).
"""

from __future__ import annotations

import base64
import json

from aiohttp import web

from service.errors import ApiError
from service.http.middleware import ForeignApi
from service.synthesis.timestamps import char_times
from service.ws.dialects.common import known_voice, unknown_voice
from service.ws.dialects.elevenlabs import DEFAULT_FORMAT, elevenlabs_key, parse_output_format, speed_of
from service.ws.dialects.http_speech import HttpSpeech, Speech, handler
from service.ws.dialects.wire_audio import CONTENT_TYPES

PREFIX = "/v1/text-to-speech"


def error_body(status: int, code: str, message: str, request_id: str) -> dict:
    return {"detail": {"status": code, "message": message}}


API = ForeignApi("ElevenLabs", (PREFIX,), elevenlabs_key, "xi-api-key header", error_body)


class ElevenLabsSpeech(HttpSpeech):
    ENDPOINT = PREFIX + "/{voice_id}"
    TIMESTAMPS = False  # with-timestamps: JSON with base64 audio and character times
    STREAMED = True  # the stream routes; convert_with_timestamps answers one JSON object

    def __init__(self, request, state):
        super().__init__(request, state)
        self.chars: dict[str, list] = {"characters": [], "character_start_times_seconds": [],
                                       "character_end_times_seconds": []}
        self.timed = False  # an alignment came (an aligner is loaded)
        self.held = bytearray()  # convert_with_timestamps: all the audio, sent at the end

    async def parse(self, body: dict) -> Speech:
        fmt = parse_output_format(self.request.query.get("output_format", DEFAULT_FORMAT))
        voice = self.request.match_info["voice_id"]
        if not await known_voice(self.request, voice):
            raise ApiError(400, "voice_not_found", unknown_voice(self.request, "voice_id", voice))
        text, settings = body.get("text"), body.get("voice_settings") or {}
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "invalid_text", "text: must be a non-empty string")
        if not isinstance(settings, dict):
            raise ApiError(400, "invalid_voice_settings", "voice_settings: must be an object")
        return Speech(text=text, voice=voice, encoding=fmt.encoding, rate=fmt.rate, bit_rate=fmt.bit_rate,
                      timestamps=self.TIMESTAMPS, speed=speed_of(settings))

    def content_type(self) -> str:
        if self.TIMESTAMPS:
            return "application/x-ndjson" if self.STREAMED else "application/json"
        return CONTENT_TYPES[self.speech.encoding]

    def line(self, audio: bytes, alignment: dict | None) -> bytes:
        return json.dumps({"audio_base64": base64.b64encode(audio).decode(), "alignment": alignment,
                           "normalized_alignment": alignment}).encode() + b"\n"

    async def write_audio(self, data: bytes) -> None:
        if not self.TIMESTAMPS:
            await self.response.write(data)
        elif self.STREAMED:
            await self.response.write(self.line(data, None))
        else:
            self.held += data

    async def write_alignment(self, alignment, offset_ms: float) -> None:
        chars = char_times(alignment, offset_ms)
        # the space the sentence cutter dropped after the utterance comes back, as on the socket
        chars["chars"].append(" ")
        chars["charStartTimesMs"].append(round(offset_ms + alignment.duration_ms))
        chars["charDurationsMs"].append(0)
        timing = {"characters": chars["chars"],
                  "character_start_times_seconds": [s / 1000 for s in chars["charStartTimesMs"]],
                  "character_end_times_seconds": [(s + d) / 1000 for s, d in
                                                  zip(chars["charStartTimesMs"], chars["charDurationsMs"])]}
        self.timed = True
        if self.STREAMED:
            await self.response.write(self.line(b"", timing))
        else:
            for name, values in timing.items():
                self.chars[name] += values

    async def write_end(self) -> None:
        if self.TIMESTAMPS and not self.STREAMED:
            await self.response.write(self.line(bytes(self.held), self.chars if self.timed else None)[:-1])


class ElevenLabsSpeechWithTimestamps(ElevenLabsSpeech):
    ENDPOINT = PREFIX + "/{voice_id}/with-timestamps"
    TIMESTAMPS = True
    STREAMED = False
    RESPOND_AT_END = True


class ElevenLabsStream(ElevenLabsSpeech):
    ENDPOINT = PREFIX + "/{voice_id}/stream"


class ElevenLabsStreamWithTimestamps(ElevenLabsSpeech):
    ENDPOINT = PREFIX + "/{voice_id}/stream/with-timestamps"
    TIMESTAMPS = True


def add_routes(app: web.Application) -> None:
    for dialect in (ElevenLabsSpeech, ElevenLabsSpeechWithTimestamps, ElevenLabsStream, ElevenLabsStreamWithTimestamps):
        app.router.add_post(dialect.ENDPOINT, handler(dialect))
