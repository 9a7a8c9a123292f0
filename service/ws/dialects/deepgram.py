"""Deepgram's ``WS /v1/speak``, so Deepgram clients (their SDK, LiveKit's plugin) can use
streamvox by changing the base URL.

Query: ``model`` (a voice of the served model or a saved voice, also written as Deepgram
names its models, ``aura-<voice>-<lang>`` / ``aura-2-<voice>-<lang>``), ``encoding``
(``linear16`` default, ``mulaw``), ``sample_rate`` (8000-48000; 24000 default, 8000 for
mulaw), ``speed`` (0.7-1.5); ``container``, ``bit_rate``, ``mip_opt_out`` and the like are
accepted and ignored. A bad query is refused before the upgrade with Deepgram's HTTP error
``{"err_code", "err_msg", "request_id"}``.

Client: ``{"type": "Speak", "text"}``, ``{"type": "Flush"}`` (answered by ``Flushed`` with
its ``sequence_id`` once its audio is out), ``{"type": "Clear"}`` (barge-in: the audio stops
within one chunk, then ``Cleared``), ``{"type": "Close"}`` (the socket closes at once).
Server: ``Metadata`` on connect, audio as binary frames, ``Flushed``, ``Cleared``,
``Warning {warn_code, warn_msg}`` for a message that is ignored, ``Error {err_code,
err_msg, description}`` for one that is refused; the socket stays open after either.
Keys: ``Authorization: Token KEY`` (or ``Bearer``), or the ``token`` subprotocol.
"""

from __future__ import annotations

import re

from aiohttp import WSCloseCode, web

from service.errors import ApiError
from service.synthesis.numbers import decimal_number, shown, whole_number
from service.voices.clones import Voice
from service.ws.contexts import Context
from service.ws.dialects.common import dialect_voice, unknown_voice
from service.ws.dialects.encoded_socket import EncodedAudioSocket
from service.ws.dialects.wire_audio import MAX_RATE, MIN_RATE
from service.ws.handshake import serve

ENCODINGS = {"linear16": "pcm_s16le", "mulaw": "pcm_mulaw"}
DEFAULT_RATES = {"linear16": 24000, "mulaw": 8000}
MIN_SPEED, MAX_SPEED = 0.7, 1.5
_AURA = re.compile(r"^aura-(?:2-)?(.+?)-[a-z]{2}(?:-[a-z]{2})?$")
CONTEXT = "speak"


def deepgram_key(request: web.Request) -> str | None:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() in ("token", "bearer") and value.strip():
        return value.strip()
    protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
    if len(protocols) == 2 and protocols[0] == "token":  # browsers: new WebSocket(url, ["token", KEY])
        return protocols[1]
    return None


def query_speed(query) -> float | None:
    """The ``speed`` query parameter (0.7-1.5; None when absent); ApiError(400) otherwise."""
    if "speed" not in query:
        return None
    speed = decimal_number(query["speed"])
    if speed is None or not MIN_SPEED <= speed <= MAX_SPEED:
        raise ApiError(400, "invalid_query_parameter", f"speed: a number from {MIN_SPEED} to {MAX_SPEED}, "
                                                       f"got {shown(query['speed'])}")
    return speed


def query_rate(query, name: str, default: int, low: int, high: int) -> int:
    """The whole number ``query[name]`` (``default`` when absent; a float's text such as ``24000.0``,
    as Deepgram's SDK writes numbers, is taken) within ``low``-``high``; ApiError(400) otherwise."""
    value = whole_number(query[name]) if name in query else default
    if value is None or not low <= value <= high:
        span = f"{low}" if low == high else f"from {low} to {high}"
        raise ApiError(400, "invalid_query_parameter", f"{name}: a whole number {span}, got {shown(query.get(name))}")
    return value


async def deepgram_voice(request: web.Request, model: str) -> Voice:
    """The voice a Deepgram ``model`` names: a voice or alias of the server (``aura-2-thalia-en``
    is one), a saved voice, or ``aura-<voice>-<lang>`` / ``aura-2-<voice>-<lang>`` of either (as
    Deepgram names its models; on a Base checkpoint the voice is a saved one); ApiError(400)
    otherwise."""
    voice = await dialect_voice(request, model)
    match = _AURA.match(model) if voice is None else None
    if match:
        voice = await dialect_voice(request, match.group(1))
    if voice is not None:
        return voice
    raise ApiError(400, "invalid_query_parameter", unknown_voice(request, "model", model) + " (also as aura-<voice>-en)")


class DeepgramSocket(EncodedAudioSocket):
    ENDPOINT = "/v1/speak"

    def __init__(self, request, ws, state):
        super().__init__(request, ws, state)
        self.model = ""
        self.voice: Voice | None = None
        self.encoding, self.rate = "pcm_s16le", 24000
        self.speed: float | None = None
        self.sequence = 0  # Flushed / Cleared sequence_id

    @classmethod
    def api_key(cls, request: web.Request) -> str | None:
        return deepgram_key(request)

    @classmethod
    def subprotocols(cls, request: web.Request) -> tuple[str, ...]:
        return ("token",)

    @classmethod
    def refusal(cls, status: int, code: str, message: str) -> web.Response:
        return web.json_response({"err_code": code.upper(), "err_msg": message, "request_id": ""}, status=status)

    async def check_request(self) -> None:
        query = self.request.query
        encoding = query.get("encoding", "linear16")
        if encoding not in ENCODINGS:
            raise ApiError(400, "unsupported_encoding", f"encoding: choose one of {', '.join(ENCODINGS)}")
        rate = query_rate(query, "sample_rate", DEFAULT_RATES[encoding], MIN_RATE, MAX_RATE)
        self.encoding, self.rate = ENCODINGS[encoding], rate
        self.speed = query_speed(query)
        self.model = query.get("model", "default")
        self.voice = await self.voice_for(self.model)

    async def voice_for(self, model: str) -> Voice:
        return await deepgram_voice(self.request, model)

    async def opened(self) -> None:
        context = self.open_context(CONTEXT)
        await context.configure(self.voice, speed=self.speed)
        await self.send_json({"type": "Metadata", "request_id": self.socket_id, "model_name": self.model,
                              "model_version": "streamvox", "model_uuid": self.socket_id})

    async def on_message(self, message: dict) -> None:
        kind = message.get("type")
        context = self.contexts.get(CONTEXT)
        if context is None:
            return  # the socket is closing
        if kind == "Speak":
            text = message.get("text")
            if not isinstance(text, str):
                await self.context_error(None, "INVALID_MESSAGE", "Speak: text must be a string")
                return
            await context.add_text(text)
        elif kind in ("Flush", "Clear"):
            if not context.can_end_round:
                await self.warn("FLUSH_LIMIT_EXCEEDED", f"{kind} messages arrive faster than they are answered; "
                                                        "this one was ignored")
                return
            self.sequence += 1
            await (context.flush if kind == "Flush" else context.cancel)((kind, self.sequence))
        elif kind == "Close":
            await self.close(WSCloseCode.OK)
        else:
            await self.context_error(None, "INVALID_MESSAGE", f"unknown message type {str(kind)[:64]!r}; "
                                                              "send Speak, Flush, Clear or Close")

    # -- our events, in Deepgram's messages -----------------------------------------
    async def send_encoded(self, context: Context, data: bytes) -> None:
        await self.send_bytes(data)  # Deepgram's audio is bare binary frames

    async def round_done(self, context: Context, label: object) -> None:
        kind, sequence = label
        await self.send_json({"type": "Flushed" if kind == "Flush" else "Cleared", "sequence_id": sequence})

    async def warn(self, code: str, message: str) -> None:
        await self.send_json({"type": "Warning", "warn_code": code, "warn_msg": message})

    async def context_error(self, context: Context | None, code: str, message: str) -> None:
        await self.send_json({"type": "Error", "err_code": code.upper(), "err_msg": message, "description": message})

    async def bad_frame(self) -> None:
        await self.context_error(None, "INVALID_MESSAGE", "send JSON text messages; binary input is not accepted")


async def speak(request: web.Request) -> web.StreamResponse:
    return await serve(request, DeepgramSocket)


def add_routes(app: web.Application) -> None:
    app.router.add_get(DeepgramSocket.ENDPOINT, speak)
