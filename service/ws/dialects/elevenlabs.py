"""ElevenLabs' text-to-speech WebSockets, so ElevenLabs clients (their SDK, LiveKit's and
Pipecat's plugins) can use streamvox by changing the base URL.

``WS /v1/text-to-speech/{voice_id}/stream-input``: one stream. The first message (BOS)
``{"text": " ", "voice_settings", "generation_config"}``, then text pieces
``{"text": "Hello ", "flush"?}``, then EOS ``{"text": ""}``: the rest is spoken, the last
message is ``{"isFinal": true}`` and the socket closes.

``WS /v1/text-to-speech/{voice_id}/multi-stream-input``: up to five contexts at once, each
message naming its ``context_id`` (absent: the default context). ``{"context_id", "flush":
true}`` speaks what is buffered; ``{"context_id", "close_context": true}`` ends the context
as LiveKit and Pipecat use it at the end of every turn - the text sent before it is spoken,
then ``{"isFinal": true, "contextId"}``; with ``"immediate": true`` (a streamvox addition)
it is a barge-in: the context's audio stops within one chunk and ``isFinal`` follows at
once. ``{"close_socket": true}`` ends everything. ``{"text": ""}`` is a keep-alive.

Audio replies ``{"audio": base64, "isFinal": false, "normalizedAlignment": null,
"alignment": null}`` (+ ``contextId``), in the ``output_format`` of the query (``pcm_<rate>``,
``mp3_<rate>_<kbps>``, ``ulaw_8000``). With an aligner loaded (``--aligner``), each utterance's
audio is followed by ``{"audio": "", "isFinal": false, "alignment", "normalizedAlignment"}``
(``{chars, charStartTimesMs, charDurationsMs}`` of the utterance's text, both the same: the
text is not normalised; times from the utterance's start, as ElevenLabs restarts them at zero
in every message); without one they stay null (no invented times).
Errors are ElevenLabs' ``{"message", "error", "code"}`` (+ ``contextId``); the socket stays
open after a bad message. Keys: ``xi-api-key`` header or query (or a bearer token).
``voice_id`` is a voice of the served model or a saved voice; ``voice_settings.speed`` sets
the speed; ``model_id``, ``language_code``, ``sync_alignment``, ``auto_mode`` and the other
query parameters and ``voice_settings`` fields are accepted and ignored.
"""

from __future__ import annotations

import base64
import re
from typing import NamedTuple

from aiohttp import WSCloseCode, web

from service.access.auth import bearer_key
from service.errors import ApiError
from service.synthesis.numbers import shown, whole_number
from service.synthesis.timestamps import char_times
from service.ws.contexts import Context
from service.ws.dialects.common import dialect_voice, unknown_voice
from service.ws.dialects.encoded_socket import EncodedAudioSocket
from service.ws.handshake import serve

PCM_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
MP3_RATES = (22050, 24000, 44100)
MP3_KBPS = (32, 48, 64, 96, 128, 192)  # ElevenLabs' mp3 bit rates; MPEG-2 rates (below 32 kHz) stop at 160
DEFAULT_FORMAT = "mp3_44100_128"
MAX_INACTIVITY_S = 180
POLICY = 1008  # ElevenLabs puts the close code it would use in its error messages
_FORMAT = re.compile(r"(pcm|mp3|ulaw)_([0-9]{4,5})(?:_([0-9]{2,3}))?")  # ASCII digits: \d takes "٢٤٠٠٠"
DEFAULT_CONTEXT = ""


class OutputFormat(NamedTuple):
    """An ``output_format`` as the wire encoder takes it: ``StreamEncoder(*fmt)``."""

    encoding: str
    rate: int
    bit_rate: int | None = None  # mp3, bits per second


def parse_output_format(name: str) -> OutputFormat:
    """``pcm_24000`` -> (``pcm_s16le``, 24000), ``mp3_44100_128`` -> (``mp3``, 44100, 128000);
    ApiError(400) for a format not served."""
    match = _FORMAT.fullmatch(name)
    if match:
        kind, rate, kbps = match.group(1), int(match.group(2)), match.group(3)
        if kind == "pcm" and rate in PCM_RATES and kbps is None:
            return OutputFormat("pcm_s16le", rate)
        if kind == "mp3" and rate in MP3_RATES and kbps is not None and int(kbps) in MP3_KBPS \
                and (rate >= 32000 or int(kbps) <= 160):
            return OutputFormat("mp3", rate, int(kbps) * 1000)
        if kind == "ulaw" and rate == 8000 and kbps is None:
            return OutputFormat("pcm_mulaw", rate)
    served = ([f"pcm_{r}" for r in PCM_RATES] + [f"mp3_{r}_{{{','.join(map(str, MP3_KBPS[:-1]))}}}" for r in MP3_RATES[:2]]
              + [f"mp3_44100_{{{','.join(map(str, MP3_KBPS))}}}", "ulaw_8000"])
    raise ApiError(400, "invalid_output_format", f"output_format {name[:40]!r} is not served; choose one of "
                                                 f"{', '.join(served)}")


def elevenlabs_key(request: web.Request) -> str | None:
    return (request.headers.get("xi-api-key") or request.query.get("xi-api-key")
            or request.query.get("xi_api_key") or bearer_key(request))


def speed_of(voice_settings: dict) -> object:
    """What of ``voice_settings`` changes our synthesis: only ``speed`` (None: absent)."""
    return voice_settings.get("speed")


class ElevenLabsSocket(EncodedAudioSocket):
    ENDPOINT = "/v1/text-to-speech/{voice_id}/stream-input"
    MAX_CONTEXTS = 1
    MULTI = False

    def __init__(self, request, ws, state):
        super().__init__(request, ws, state)
        self.voice_id = request.match_info["voice_id"]
        self.voice = None  # what voice_id names (dialect_voice), found in the handshake
        self.output_format = parse_output_format(DEFAULT_FORMAT)
        self.ended = False  # stream-input: EOS was sent

    @classmethod
    def api_key(cls, request: web.Request) -> str | None:
        return elevenlabs_key(request)

    @classmethod
    def refusal(cls, status: int, code: str, message: str) -> web.Response:
        return web.json_response({"detail": {"status": code, "message": message}}, status=status)

    async def check_request(self) -> None:
        self.output_format = parse_output_format(self.request.query.get("output_format", DEFAULT_FORMAT))
        timeout = self.request.query.get("inactivity_timeout")
        if timeout is not None:
            seconds = whole_number(timeout)
            if seconds is None or not 1 <= seconds <= MAX_INACTIVITY_S:
                raise ApiError(400, "invalid_inactivity_timeout", f"inactivity_timeout: a whole number of seconds "
                                                                  f"from 1 to {MAX_INACTIVITY_S}, got {shown(timeout)}")
            self.idle_timeout_s = float(seconds)
        self.voice = await dialect_voice(self.request, self.voice_id)
        if self.voice is None:
            raise ApiError(400, "voice_not_found", unknown_voice(self.request, "voice_id", self.voice_id))

    # -- client messages -----------------------------------------------------------
    async def on_message(self, message: dict) -> None:
        if self.MULTI and message.get("close_socket") is True:
            await self.close(WSCloseCode.OK)
            return
        context_id = message.get("context_id", DEFAULT_CONTEXT) if self.MULTI else DEFAULT_CONTEXT
        if not isinstance(context_id, str) or len(context_id) > 256:
            await self.context_error(None, "invalid_context_id", "context_id: must be a string (at most 256 characters)")
            return
        text = message.get("text")
        if text is not None and not isinstance(text, str):
            await self.context_error(None, "invalid_text", "text: must be a string")
            return
        for name in ("flush", "close_context", "immediate", "try_trigger_generation"):
            if message.get(name) is not None and not isinstance(message[name], bool):
                await self.context_error(None, f"invalid_{name}", f"{name}: must be true or false")
                return
        for name in ("voice_settings", "generation_config"):
            if message.get(name) is not None and not isinstance(message[name], dict):
                await self.context_error(None, f"invalid_{name}", f"{name}: must be an object")
                return
        context = self.contexts.get(context_id)
        if self.MULTI and message.get("close_context") is True:
            await self.close_context(context, context_id, immediate=message.get("immediate") is True)
            return
        if self.ended:
            await self.context_error(None, "stream_ended", "the stream has ended (EOS was sent); open a new socket")
            return
        if context is None:
            if not text and not message.get("flush"):
                return  # a keep-alive before any context exists
            context = await self.open(context_id, message)
            if context is None:
                return
        if text == "" and not self.MULTI:  # EOS: speak the rest, then isFinal and close
            self.ended = True
            await self.end_round(context, "eos")
            return
        if text and text.strip():
            await context.add_text(text)
        if message.get("flush") is True:
            await self.end_round(context, "flush")

    async def open(self, context_id: str, message: dict) -> Context | None:
        if len(self.contexts) >= self.MAX_CONTEXTS:
            await self.context_error(None, "max_active_conversations",
                                     f"Maximum simultaneous contexts per WebSocket connection exceeded "
                                     f"({self.MAX_CONTEXTS}). Please close an existing context before opening a new one.")
            return None
        context = self.open_context(context_id)
        context.extra["encoder"] = None
        speed = speed_of(message.get("voice_settings") or {})
        # ElevenLabs always sends alignment (asked of an engine with an aligner only)
        await context.configure(self.voice, speed=speed, timestamps=True)
        return context

    async def end_round(self, context: Context, label: str, last: bool = False) -> None:
        """Speak what ``context`` holds (``last``: and end it: no more text)."""
        if not context.can_end_round:
            await self.context_error(context, "too_many_flushes", "flushes arrive faster than they are answered; "
                                                                  "this one was ignored")
            return
        await (self.end_context(context, label) if last else context.flush(label))

    async def close_context(self, context: Context | None, context_id: str, immediate: bool) -> None:
        if context is None or (context.ending and not immediate):  # a barge-in may follow a close
            await self.context_error(None, "context_not_found", f"context {context_id[:64]!r} is not open",
                                     context_id=context_id)
            return
        if immediate:
            await self.drop_context(context)
            await self.send_json({"isFinal": True, "contextId": context_id})
            return
        await self.end_round(context, "close", last=True)

    # -- our events, in ElevenLabs' messages -----------------------------------------
    def wire_format(self, context: Context) -> OutputFormat:
        return self.output_format

    def reply(self, context: Context, message: dict) -> dict:
        if self.MULTI:
            message["contextId"] = context.context_id
        return message

    async def alignment(self, context: Context, alignment, offset_ms: float) -> None:
        chars = char_times(alignment)
        # The sentence cutter dropped the space after the utterance; clients join the chars of
        # successive messages into their text, so it comes back (no time of its own).
        chars["chars"].append(" ")
        chars["charStartTimesMs"].append(round(alignment.duration_ms))
        chars["charDurationsMs"].append(0)
        await self.send_json(self.reply(context, {"audio": "", "isFinal": False, "alignment": chars,
                                                  "normalizedAlignment": chars}))

    async def send_encoded(self, context: Context, data: bytes) -> None:
        await self.send_json(self.reply(context, {"audio": base64.b64encode(data).decode(), "isFinal": False,
                                                  "normalizedAlignment": None, "alignment": None}))

    async def round_done(self, context: Context, label: object) -> None:
        if label == "close":
            await self.drop_context(context)
            await self.send_json(self.reply(context, {"isFinal": True}))
        elif label == "eos":
            await self.send_json({"isFinal": True})
            await self.close(WSCloseCode.OK)

    async def context_error(self, context: Context | None, code: str, message: str,
                            context_id: str | None = None) -> None:
        body = {"message": message, "error": code, "code": POLICY}
        if self.MULTI and (context is not None or context_id is not None):
            body["contextId"] = context.context_id if context is not None else context_id
        await self.send_json(body)


class ElevenLabsMultiSocket(ElevenLabsSocket):
    ENDPOINT = "/v1/text-to-speech/{voice_id}/multi-stream-input"
    MAX_CONTEXTS = 5  # ElevenLabs' own limit per connection
    MULTI = True


async def stream_input(request: web.Request) -> web.StreamResponse:
    return await serve(request, ElevenLabsSocket)


async def multi_stream_input(request: web.Request) -> web.StreamResponse:
    return await serve(request, ElevenLabsMultiSocket)


def add_routes(app: web.Application) -> None:
    app.router.add_get(ElevenLabsSocket.ENDPOINT, stream_input)
    app.router.add_get(ElevenLabsMultiSocket.ENDPOINT, multi_stream_input)
