"""ElevenLabs' HTTP text-to-speech, a route of the one HTTP speech service (service/ws/dialects/http_speech.py).

- ``POST /v1/text-to-speech/{voice_id}`` (the SDK's ``text_to_speech.convert``) and
  ``POST …/stream``: the audio bytes, streamed as they are generated, in the ``output_format``
  of the query (as the sockets: ``pcm_<rate>``, ``mp3_<rate>_<kbps>`` at that bit rate, ``ulaw_8000``).
- ``POST …/stream/with-timestamps``: newline-separated JSON ``{"audio_base64", "alignment": null,
  "normalized_alignment": null}`` as the audio comes; with an aligner (``--aligner``) each
  utterance's audio is followed by a line whose ``alignment`` / ``normalized_alignment`` is
  ElevenLabs' HTTP timing ``{characters, character_start_times_seconds,
  character_end_times_seconds}`` of that utterance, in seconds from the start of the response.
- ``POST …/with-timestamps`` (``convert_with_timestamps``): one JSON object with all the audio
  (``audio_base64``) and the timing of the whole text (null without an aligner: no invented times),
  sent once all of it was spoken; meanwhile the encoded audio waits in a spool (memory, then a
  temporary file), never as base64 or JSON text.

A client that goes away ends its request at once (its engine work cancelled), on every route.

Body ``{"text", "model_id"?, "voice_settings"?, …}``: only ``voice_settings.speed`` changes the
speech; the other fields are accepted and ignored. Errors are ElevenLabs' ``{"detail": {"status",
"message"}}``; keys as the sockets (``xi-api-key``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import tempfile

from aiohttp import web

from service.errors import ApiError
from service.http.middleware import ForeignApi
from service.speech import handler
from service.synthesis.timestamps import char_times
from service.ws.dialects.common import dialect_voice, unknown_voice
from service.ws.dialects.elevenlabs import DEFAULT_FORMAT, elevenlabs_key, parse_output_format, speed_of
from service.ws.dialects.http_speech import DialectSpeech, Speech
from service.ws.dialects.wire_audio import CONTENT_TYPES

PREFIX = "/v1/text-to-speech"


def error_body(status: int, code: str, message: str, request_id: str) -> dict:
    return {"detail": {"status": code, "message": message}}


API = ForeignApi("ElevenLabs", (PREFIX,), elevenlabs_key, "xi-api-key header", error_body)


class ElevenLabsSpeech(DialectSpeech):
    ENDPOINT = PREFIX + "/{voice_id}"
    TIMESTAMPS = False  # with-timestamps: JSON lines with base64 audio and character times

    async def read(self, body: dict) -> Speech:
        fmt = parse_output_format(self.request.query.get("output_format", DEFAULT_FORMAT))
        voice_id = self.request.match_info["voice_id"]
        voice = await dialect_voice(self.request, voice_id)
        if voice is None:
            raise ApiError(400, "voice_not_found", unknown_voice(self.request, "voice_id", voice_id))
        text, settings = body.get("text"), body.get("voice_settings") or {}
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "invalid_text", "text: must be a non-empty string")
        if not isinstance(settings, dict):
            raise ApiError(400, "invalid_voice_settings", "voice_settings: must be an object")
        return Speech(text=text, voice=voice, encoding=fmt.encoding, rate=fmt.rate, bit_rate=fmt.bit_rate,
                      timestamps=self.TIMESTAMPS, speed=speed_of(settings))

    def content_type(self) -> str:
        return "application/x-ndjson" if self.TIMESTAMPS else CONTENT_TYPES[self.speech.encoding]

    @staticmethod
    def line(audio: bytes, alignment: dict | None) -> bytes:
        return json.dumps({"audio_base64": base64.b64encode(audio).decode(), "alignment": alignment,
                           "normalized_alignment": alignment}).encode() + b"\n"

    async def write_audio(self, data: bytes) -> None:
        await self.response.write(self.line(data, None) if self.TIMESTAMPS else data)

    async def write_alignment(self, alignment, offset_ms: float) -> None:
        await self.response.write(self.line(b"", http_timing(alignment, offset_ms)))


def http_timing(alignment, offset_ms: float) -> dict:
    """An utterance's character times as ElevenLabs' HTTP routes give them (seconds from the start
    of the response: ``offset_ms`` is where the utterance starts)."""
    chars = char_times(alignment, offset_ms)
    # the space the sentence cutter dropped after the utterance comes back, as on the socket
    chars["chars"].append(" ")
    chars["charStartTimesMs"].append(round(offset_ms + alignment.duration_ms))
    chars["charDurationsMs"].append(0)
    return {"characters": chars["chars"],
            "character_start_times_seconds": [s / 1000 for s in chars["charStartTimesMs"]],
            "character_end_times_seconds": [(s + d) / 1000 for s, d in
                                            zip(chars["charStartTimesMs"], chars["charDurationsMs"])]}


class ElevenLabsSpeechWithTimestamps(ElevenLabsSpeech):
    """``convert_with_timestamps``: one JSON object, sent once everything was spoken (a failure
    before the end is still an HTTP error). The encoded audio waits in a spool - memory up to
    ``whole_file_memory_bytes``, then a temporary file, as whole-file speech does
    (service/synthesis/spool.py) - and goes out base64 in blocks, so what the server holds is the
    audio once, not the audio, its base64 and the JSON text around it. The character times (a
    few per character of the text) are held as they come."""

    ENDPOINT = PREFIX + "/{voice_id}/with-timestamps"
    TIMESTAMPS = True
    RESPOND_AT_END = True
    BASE64_BLOCK = 3 * 64 * 1024  # a multiple of 3: the blocks' base64 joins into the whole's

    def __init__(self, request, state):
        super().__init__(request, state)
        self.held = tempfile.SpooledTemporaryFile(max_size=state.settings.whole_file_memory_bytes)  # (no file yet)
        self.timing: dict[str, list] | None = None  # None until an alignment comes (an aligner is loaded)

    def content_type(self) -> str:
        return "application/json"

    async def write_audio(self, data: bytes) -> None:
        await asyncio.to_thread(self.held.write, data)  # (once spilled, a file write: off the loop)

    async def write_alignment(self, alignment, offset_ms: float) -> None:
        if self.timing is None:
            self.timing = {"characters": [], "character_start_times_seconds": [], "character_end_times_seconds": []}
        for name, values in http_timing(alignment, offset_ms).items():
            self.timing[name] += values

    async def write_end(self) -> None:
        # {"audio_base64": "...", "alignment": ..., "normalized_alignment": ...}, as json.dumps writes it
        await self.response.write(b'{"audio_base64": "')
        self.held.seek(0)
        while block := await asyncio.to_thread(self.held.read, self.BASE64_BLOCK):
            await self.response.write(base64.b64encode(block))
        timing = json.dumps(self.timing)  # (null without an aligner: no invented times)
        await self.response.write(f'", "alignment": {timing}, "normalized_alignment": {timing}}}'.encode())

    def release(self) -> None:
        self.held.close()


class ElevenLabsStream(ElevenLabsSpeech):
    ENDPOINT = PREFIX + "/{voice_id}/stream"


class ElevenLabsStreamWithTimestamps(ElevenLabsSpeech):
    ENDPOINT = PREFIX + "/{voice_id}/stream/with-timestamps"
    TIMESTAMPS = True


def add_routes(app: web.Application) -> None:
    for dialect in (ElevenLabsSpeech, ElevenLabsSpeechWithTimestamps, ElevenLabsStream, ElevenLabsStreamWithTimestamps):
        app.router.add_post(dialect.ENDPOINT, handler(dialect))
