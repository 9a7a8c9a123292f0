"""WebSocket ``/v1/stream``: text in as it is typed, PCM16 out as it is generated.

A session has two tasks: the reader parses client messages and calls the session core's
methods (service/ws/core.py: sentence cutting or live text, the utterance queue, prefetch,
limits), and the core's speaker reports what it speaks as typed events (service/ws/events.py),
which this socket writes as streamvox's messages: ``audio.start``, binary PCM16 frames,
``audio.done``, ``session.done``, ``alignment``, ``error``. The protocol is specified in
docs/API.md; vllm-omni's socket (service/ws/omni.py) is this one with its own names.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import WSCloseCode, web

from service.access.auth import WS_SUBPROTOCOL
from service.state import AppState
from service.synthesis.audio import to_pcm16
from service.synthesis.chunks import behind_event, truncated_event
from service.synthesis.params import parse
from service.synthesis.schema import CloneFields, InputText, LiveTextConfig
from service.synthesis.timestamps import TimestampsField, words_json
from service.synthesis.events import AlignmentReady, Audio, StreamBehind, UtteranceTruncated
from service.ws.core import SessionCore
from service.ws.events import RoundDone, SessionClosed, SessionError, SessionSink, UtteranceDone, UtteranceStarted
from service.ws.handshake import SEND_ERROR_TIMEOUT_S, SocketOwner, close_socket, serve, wait_for_reader

log = logging.getLogger("streamvox.ws")

PROTOCOL_VERSION = 1
ENDPOINT = "/v1/stream"


class StreamSession(SocketOwner, SessionSink):
    ENDPOINT = ENDPOINT
    REFUSE_IN_BAND = True  # browsers cannot read a refused upgrade's status: an error message, then a close
    LONE_SURROGATE = "contains a lone surrogate (not valid Unicode text)"
    TEXT_STREAMING: bool | None = None  # the session's live text before a session.config: the model's

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, state: AppState):
        super().__init__(request, ws, state)
        self.core = SessionCore(request, state, self, self.socket_id, text_streaming=self.TEXT_STREAMING)
        self.tasks: tuple[asyncio.Task, ...] = ()

    @classmethod
    def subprotocols(cls, request: web.Request) -> tuple[str, ...]:
        return (WS_SUBPROTOCOL,)

    @property
    def closed(self) -> bool:
        return self.core.closed

    @property
    def busy(self) -> bool:
        return self.core.busy

    @property
    def outcome(self) -> str:
        return self.core.outcome

    # -- the socket's life (service/ws/handshake.py) --------------------------------------
    async def run(self) -> None:
        speaker = asyncio.create_task(self.core.speak_loop())
        reader = asyncio.create_task(self.read_loop())
        self.tasks = (speaker, reader)
        await self.opened()
        await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                if not isinstance(task.exception(), SessionClosed):
                    log.error("session %s failed", self.socket_id, exc_info=task.exception())

    async def opened(self) -> None:
        engine = self.state.engine
        await self.send_json({"type": "session.created", "session_id": self.socket_id,
                              "protocol": PROTOCOL_VERSION, "sample_rate": engine.info.sample_rate,
                              "format": "pcm_s16le", "channels": 1,
                              # as the speech header X-Streamvox-Random-Weights: noise, not speech
                              "random_components": list(engine.info.random_components)})

    async def shut(self) -> None:
        self.core.stop()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def fatal(self, code: str, message: str, close_code: int) -> None:
        await self.core.fail(code, message, close_code)

    # -- sending -------------------------------------------------------------------------
    async def send_json(self, message: dict) -> None:
        if self.closed or self.ws.closed:
            raise SessionClosed()
        try:
            await self.ws.send_json(message)
        except (ConnectionError, RuntimeError) as exc:
            raise SessionClosed() from exc

    async def send_bytes(self, data: bytes) -> None:
        if self.closed or self.ws.closed:
            raise SessionClosed()
        try:
            await self.ws.send_bytes(data)
            await wait_for_reader(self.request)  # the speaker waits while the client is behind
        except (ConnectionError, RuntimeError) as exc:
            raise SessionClosed() from exc

    async def error(self, code: str, message: str) -> None:
        await self.send_json({"type": "error", "code": code, "message": message})

    # -- the core's events, as streamvox's messages --------------------------------------
    async def utterance_started(self, event: UtteranceStarted) -> None:
        start = {"type": "audio.start", "utterance": event.index, "text": event.text}
        if event.live is not None:  # its text is still arriving: audio.done says what it was
            start.update(live=True, text_start=event.live.text_start)
        await self.send_json(start)

    async def audio(self, event: Audio) -> None:
        await self.send_bytes(to_pcm16(event.pcm))

    async def stream_behind(self, event: StreamBehind) -> None:
        await self.send_json(behind_event(event.gap_s, event.behind_s, utterance=event.index))

    async def utterance_truncated(self, event: UtteranceTruncated) -> None:
        await self.send_json(truncated_event(event.reason, utterance=event.index))

    async def alignment(self, event: AlignmentReady) -> None:
        """Word times of an utterance on the session's clock (after its audio)."""
        alignment = event.alignment
        await self.send_json({"type": "alignment", "utterance": event.index, "text": alignment.text,
                              "language": alignment.language, "offset_ms": round(event.offset_ms, 1),
                              "duration_ms": round(alignment.duration_ms, 1),
                              "words": words_json(alignment, event.offset_ms)})

    async def utterance_done(self, event: UtteranceDone) -> None:
        done = {"type": "audio.done", "utterance": event.index, "samples": event.samples}
        if event.cancelled:
            done["cancelled"] = True
        elif event.error:
            done["error"] = event.error
        done["duration_s"] = event.duration_s
        if event.truncated:
            done["truncated"] = event.truncated
        if event.underruns:
            done.update(behind_s=round(event.behind_s, 3), underruns=event.underruns)
        if event.live is not None:
            live = event.live
            done.update(text=live.text, text_start=live.text_start, text_end=live.text_start + len(live.text))
        await self.send_json(done)

    async def round_done(self, event: RoundDone) -> None:
        await self.send_json({"type": "session.done", "utterances": event.utterances})

    async def session_error(self, event: SessionError) -> None:
        await self.error(event.code, event.message)

    async def session_failed(self, event: SessionError) -> None:
        try:  # a client that does not read must not hold the session open: bounded waits
            if not self.ws.closed:
                await asyncio.wait_for(self.ws.send_json({"type": "error", "code": event.code,
                                                          "message": event.message}), SEND_ERROR_TIMEOUT_S)
        except (ConnectionError, RuntimeError, asyncio.TimeoutError):
            pass
        await close_socket(self.request, self.ws, event.close_code, event.code.encode())

    # -- the reader (service/ws/reader.py) -------------------------------------------------
    def read_timeout(self, first: bool) -> tuple[float, str]:
        settings = self.state.settings
        if first:
            return settings.ws_config_timeout_s, "config_timeout"
        return settings.ws_idle_timeout_s, "idle_timeout"

    async def quiet(self, timeout: float) -> bool:
        if self.core.end_live_text():  # live text stopped without input.done: it ends cleanly
            await self.error("input_idle", f"no text for {timeout:g} s: the live utterance was ended "
                                           "(its audio follows); send input.done to end one yourself")
            return True
        return self.busy

    def unusable_value(self, message: dict) -> str:
        return f"{message.get('type')}: a field has a value that cannot be used"

    async def on_message(self, message: dict) -> None:
        kind = message.get("type")
        handler = {
            "session.config": self.on_config,
            "input.text": self.on_input_text,
            "input.done": self.on_input_done,
            "response.cancel": self.on_cancel,
            "session.close": self.on_close,
        }.get(kind if isinstance(kind, str) else "")
        if handler is None:
            await self.error("unknown_type", f"unknown message type {str(kind)[:64]!r}")
            return
        await handler(message)

    async def on_config(self, message: dict) -> None:
        """``session.config``: all of it or nothing (an ApiError here is the client's ``error``).
        Inline ``ref_audio`` (+ ``ref_text``, ``x_vector_only_mode``) clones as on HTTP speech."""
        streaming = parse(LiveTextConfig, message).text_streaming  # checked first
        timestamps = parse(TimestampsField, message).timestamps
        cloning = any(message.get(name) is not None for name in CloneFields.model_fields)
        await self.core.configure(message, clone=parse(CloneFields, message) if cloning else None,
                                  text_streaming=streaming, timestamps=timestamps)

    async def on_input_text(self, message: dict) -> None:
        await self.core.add_text(parse(InputText, message).text)

    async def on_input_done(self, message: dict) -> None:
        await self.core.end_round()

    async def on_cancel(self, message: dict) -> None:
        await self.core.cancel()

    async def on_close(self, message: dict) -> None:
        self.core.stop()
        await self.ws.close(code=WSCloseCode.OK)


async def stream_session(request: web.Request) -> web.StreamResponse:
    return await serve(request, StreamSession)


__all__ = ["ENDPOINT", "PROTOCOL_VERSION", "StreamSession", "stream_session"]
