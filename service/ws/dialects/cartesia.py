"""Cartesia's ``WS /tts/websocket``, so Cartesia clients (LiveKit's and Pipecat's plugins)
can use streamvox by changing the base URL.

A generation request ``{"context_id", "transcript", "voice": {"mode": "id", "id"},
"output_format": {"container": "raw", "encoding": "pcm_s16le" | "pcm_f32le" | "pcm_mulaw",
"sample_rate"}, "continue", "flush"?, "add_timestamps"?, "model_id", "language"}`` adds its
transcript to the context (opened by its first request; transcripts are joined verbatim).
``continue: false`` ends the context: its audio is spoken, then ``done``. ``flush: true``
answers ``flush_done`` (with a ``flush_id`` counting from 1) once the audio before it is out.
``{"context_id", "cancel": true}`` is a barge-in: the context's audio stops within one chunk
and nothing more is sent for it. Many contexts speak at once on one socket.

Replies: ``chunk`` (base64 ``data``), ``flush_done``, ``done``, ``error`` with Cartesia's
fields (``status_code``, ``done``, ``context_id``), and ``timestamps`` (``word_timestamps:
{words, start, end}`` in seconds on the context's audio clock) after each utterance's audio
when the context's first request had ``add_timestamps: true`` and an aligner is loaded
(``--aligner``); without one ``add_timestamps`` has no effect (no invented times). Keys: ``X-API-Key``
header, ``api_key`` query or a bearer token; ``Cartesia-Version`` (header or
``cartesia_version`` query) is accepted whatever its value. ``voice.id`` is a voice of the
served model or a saved voice; ``model_id``, ``language``, ``duration`` and the other fields
Cartesia defines are accepted and ignored; ``voice.mode: "embedding"`` is refused.
"""

from __future__ import annotations

import base64
import time
import uuid

from aiohttp import web

from service.access.auth import bearer_key
from service.synthesis.numbers import json_whole_number, shown
from service.synthesis.timestamps import cartesia_words
from service.ws.contexts import Context
from service.ws.dialects.common import dialect_voice, unknown_voice
from service.ws.dialects.encoded_socket import EncodedAudioSocket
from service.ws.dialects.wire_audio import MAX_RATE, MIN_RATE
from service.ws.handshake import serve

ENCODINGS = ("pcm_s16le", "pcm_f32le", "pcm_mulaw")
MAX_CONTEXTS = 16


class BadRequest(Exception):
    """A generation request Cartesia would refuse: ``error`` with status 400."""


def output_format(value: object) -> tuple[str, int]:
    if not isinstance(value, dict):
        raise BadRequest("output_format: must be an object {container, encoding, sample_rate}")
    if value.get("container", "raw") != "raw":
        raise BadRequest("output_format.container: only \"raw\" is served on the WebSocket")
    encoding, rate = value.get("encoding"), json_whole_number(value.get("sample_rate"))
    if encoding not in ENCODINGS:
        raise BadRequest(f"output_format.encoding: choose one of {', '.join(ENCODINGS)}")
    if rate is None or not MIN_RATE <= rate <= MAX_RATE:
        raise BadRequest(f"output_format.sample_rate: a whole number from {MIN_RATE} to {MAX_RATE}, "
                         f"got {shown(value.get('sample_rate'))}")
    return encoding, rate


def voice_id(value: object) -> str:
    if not isinstance(value, dict) or value.get("mode", "id") != "id":
        raise BadRequest("voice: only {\"mode\": \"id\", \"id\": name} is served (no embeddings)")
    name = value.get("id")
    if not isinstance(name, str) or not name:
        raise BadRequest("voice.id: must be a non-empty string")
    return name


class CartesiaSocket(EncodedAudioSocket):
    ENDPOINT = "/tts/websocket"
    MAX_CONTEXTS = MAX_CONTEXTS

    @classmethod
    def api_key(cls, request: web.Request) -> str | None:
        return request.headers.get("X-API-Key") or request.query.get("api_key") or bearer_key(request)

    @classmethod
    def refusal(cls, status: int, code: str, message: str) -> web.Response:
        return web.json_response({"error": message, "error_code": code, "status_code": status}, status=status)

    async def on_message(self, message: dict) -> None:
        context_id = message.get("context_id")
        if context_id is not None and (not isinstance(context_id, str) or len(context_id) > 256):
            await self.context_error(None, "invalid_context_id", "context_id: must be a string (at most 256 characters)")
            return
        context = self.contexts.get(context_id) if context_id is not None else None
        if message.get("cancel") is not None:
            if message["cancel"] is not True:
                await self.context_error(None, "invalid_request", "cancel: must be true", context_id=context_id)
            elif context is None:
                await self.context_error(None, "context_not_found", f"context {str(context_id)[:64]!r} is not active",
                                         context_id=context_id)
            else:
                await self.drop_context(context)
            return
        try:
            await self.generate(context, context_id or uuid.uuid4().hex, message)
        except BadRequest as exc:
            await self.context_error(None, "invalid_request", str(exc), context_id=context_id)

    async def generate(self, context: Context | None, context_id: str, message: dict) -> None:
        transcript = message.get("transcript")
        if not isinstance(transcript, str):
            raise BadRequest("transcript: must be a string")
        more = message.get("continue", False)
        flush = message.get("flush", False)
        for name, value in (("continue", more), ("flush", flush), ("add_timestamps", message.get("add_timestamps"))):
            if value is not None and not isinstance(value, bool):
                raise BadRequest(f"{name}: must be true or false")
        if context is None:
            encoding, rate = output_format(message.get("output_format"))
            name = voice_id(message.get("voice"))
            voice = await dialect_voice(self.request, name)
            if voice is None:
                raise BadRequest(unknown_voice(self.request, "voice.id", name))
            if len(self.contexts) >= self.MAX_CONTEXTS:
                raise BadRequest(f"at most {self.MAX_CONTEXTS} contexts may be active on one connection")
            context = self.open_context(context_id)
            context.extra.update(encoding=encoding, rate=rate, flushes=0)
            await context.configure(voice, timestamps=message.get("add_timestamps") is True)
        elif context.ending:
            raise BadRequest(f"context {context_id[:64]!r} has ended (continue was false); use a new context_id")
        if transcript:
            await context.add_text(transcript)
        if flush or not more:
            if not context.can_end_round:
                raise BadRequest("flushes arrive faster than they are answered; this one was ignored")
            if flush:
                context.extra["flushes"] += 1
                await context.flush(("flush", context.extra["flushes"]))
            if not more:
                await self.end_context(context, ("done", None))

    # -- our events, in Cartesia's messages -------------------------------------------
    def wire_format(self, context: Context) -> tuple[str, int]:
        return context.extra["encoding"], context.extra["rate"]

    async def utterance_start(self, context: Context, text: str) -> None:
        await super().utterance_start(context, text)
        context.extra["since"] = time.monotonic()

    async def alignment(self, context: Context, alignment, offset_ms: float) -> None:
        await self.send_json({"type": "timestamps", "done": False, "status_code": 206,
                              "context_id": context.context_id,
                              "word_timestamps": cartesia_words(alignment, offset_ms)})

    async def send_encoded(self, context: Context, data: bytes) -> None:
        now = time.monotonic()
        step_ms = round((now - context.extra.get("since", now)) * 1000)
        context.extra["since"] = now
        await self.send_json({"type": "chunk", "data": base64.b64encode(data).decode(), "done": False,
                              "status_code": 206, "step_time": step_ms, "context_id": context.context_id})

    async def round_done(self, context: Context, label: object) -> None:
        kind, flush_id = label if isinstance(label, tuple) else (None, None)
        if kind == "flush":
            await self.send_json({"type": "flush_done", "done": False, "flush_done": True, "flush_id": flush_id,
                                  "status_code": 206, "context_id": context.context_id})
        elif kind == "done":
            await self.drop_context(context)  # first: once the client reads done, its id is free again
            await self.send_json({"type": "done", "done": True, "status_code": 206,
                                  "context_id": context.context_id})

    async def context_error(self, context: Context | None, code: str, message: str,
                            context_id: str | None = None) -> None:
        body = {"type": "error", "done": True, "status_code": 400, "error": message, "title": code,
                "message": message, "error_code": code}
        if context is not None or context_id is not None:
            body["context_id"] = context.context_id if context is not None else context_id
        await self.send_json(body)


async def tts_websocket(request: web.Request) -> web.StreamResponse:
    return await serve(request, CartesiaSocket)


def add_routes(app: web.Application) -> None:
    app.router.add_get(CartesiaSocket.ENDPOINT, tts_websocket)
