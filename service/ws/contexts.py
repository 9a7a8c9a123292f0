"""Speech contexts on a shared WebSocket: the hook the wire dialects of other TTS services
(service/ws/dialects/) stand on.

A *context* is one :class:`~service.ws.session.StreamSession` - the one session core:
sentence cutting or live text, prefetch, cancellation, voices, work limits - that does not
own its socket. Its events (an utterance starts, audio, it ends, a round ends, an error) go
to the dialect's methods, which write that service's own messages. A
:class:`ContextSocket` owns the socket: admission, the API key, reading, a send lock shared
by its contexts, and the contexts themselves (one for ElevenLabs ``stream-input`` and
Deepgram, many for ElevenLabs ``multi-stream-input`` and Cartesia), each with its own
speaker task so that they speak concurrently and one can be cancelled alone.

    class MyDialect(ContextSocket):
        async def on_message(self, message): ...          # parse the dialect's client message
        async def audio(self, context, pcm): ...           # write the dialect's audio message
    return await serve(request, MyDialect, "/my/endpoint")
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import uuid

import numpy as np
from aiohttp import WSCloseCode, web

from service.access.auth import ACCEPTED_KEY
from service.access.limits import client_identity
from service.errors import ApiError
from service.state import COUNTED, REQUEST_ID, STATE_KEY, AppState
from service.ws.reader import MessageReader
from service.ws.session import (
    SEND_ERROR_TIMEOUT_S,
    SOCKET_SEND_BUFFER,
    SessionClosed,
    StreamSession,
    close_socket,
    wait_for_reader,
)

log = logging.getLogger("streamvox.ws.contexts")


class Context(StreamSession):
    """One stream of speech on a :class:`ContextSocket`. The core (StreamSession) drives it;
    what it would write on the streamvox wire goes to the socket's dialect instead."""

    def __init__(self, owner: ContextSocket, context_id: str, number: int):
        super().__init__(owner.request, owner.ws, owner.state)
        self.owner = owner
        self.context_id = context_id  # the client's name for it, which a later context may reuse
        # Engine request ids are "<socket>-c<n>-<utterance>": unique by construction (the
        # socket's own counter), never built from client text, so two contexts whose ids
        # share a prefix, or a context reopened under an id that is still winding down,
        # can never meet in the engine.
        self.session_id = f"{owner.socket_id}-c{number}"
        self.ending = False  # the client ended it (no more text): what is buffered is spoken, then it goes
        self.silenced = False  # the client dropped this context: nothing more is written for it
        self.speaker: asyncio.Task | None = None
        self.extra: dict = {}  # the dialect's per-context state (output format, counters)
        self.round_labels: collections.deque = collections.deque()  # what each pending round was, in order

    # -- the core's events, to the dialect --------------------------------------------
    async def send_json(self, message: dict) -> None:
        if self.closed or self.owner.closed:
            raise SessionClosed()
        if self.silenced:
            return
        kind = message.get("type")
        if kind == "audio.start":
            await self.owner.utterance_start(self, message["text"])
        elif kind == "audio.done":
            await self.owner.utterance_done(self, cancelled=bool(message.get("cancelled")),
                                            failed=bool(message.get("error")))
        elif kind == "session.done":
            label = self.round_labels.popleft() if self.round_labels else None
            await self.owner.round_done(self, label)
        # stream.behind and the like: no dialect has a message for them

    async def send_alignment(self, index: int, alignment, offset_ms: float) -> None:
        if not self.silenced:
            await self.owner.alignment(self, alignment, offset_ms)

    async def send_pcm(self, pcm: np.ndarray) -> int:
        # While cancelling, the core sends a short fade to silence: a dialect's barge-in
        # means no more audio for the context at all.
        if not self.cancelling and not self.silenced and pcm.size:
            await self.owner.audio(self, np.asarray(pcm, dtype=np.float32))
        return int(pcm.size)

    async def error(self, code: str, message: str) -> None:
        if not self.silenced:
            await self.owner.context_error(self, code, message)

    async def fatal(self, code: str, message: str, close_code: int) -> None:
        """A fatal error of the core (overloaded, engine gone) ends this context, not the socket."""
        if self.closed:
            return
        self.outcome = code
        await self.error(code, message)
        self.closed = True
        self.cancel_all()

    async def abort(self, code: str, message: str) -> None:
        await self.owner.fatal(code, message, WSCloseCode.GOING_AWAY)

    # -- what a dialect calls ----------------------------------------------------------
    async def add_text(self, text: str) -> None:
        await self.on_input_text({"text": text})

    @property
    def can_end_round(self) -> bool:
        """False when the client ends rounds faster than they are answered (a flood of flushes)."""
        return self.pending_rounds < self.state.settings.ws_max_pending_rounds

    async def flush(self, label: object = None) -> None:
        """Speak what is buffered; ``round_done(label)`` follows its audio. Check can_end_round first."""
        self.round_labels.append(label)
        await self.on_input_done({})

    async def cancel(self, label: object = None) -> None:
        """Barge-in: drop queued text and stop the utterance being spoken within one chunk;
        ``round_done(label)`` follows (after the rounds still pending, each answered in order)."""
        self.round_labels.append(label)
        await self.on_cancel({})


class ContextSocket(MessageReader):
    """A dialect's socket. Subclasses parse client messages (:meth:`on_message`) and write
    the events of their contexts (:meth:`utterance_start`, :meth:`audio`, ...)."""

    ENDPOINT = ""
    MAX_CONTEXTS = 1

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, state: AppState):
        self.request = request
        self.ws = ws
        self.state = state
        self.socket_id = uuid.uuid4().hex
        self.contexts: dict[str, Context] = {}  # open or ending contexts, by the client's id
        self.contexts_opened = 0  # contexts opened on this socket so far: each one's number
        self.speakers: set[asyncio.Task] = set()  # every context's speaker task until it ends, dropped ones too
        self.closed = False
        self.outcome = "ok"
        self.send_lock = asyncio.Lock()
        self.idle_timeout_s = state.settings.ws_idle_timeout_s

    # -- handshake: what a dialect decides before the upgrade --------------------------
    @classmethod
    def api_key(cls, request: web.Request) -> str | None:
        raise NotImplementedError

    @classmethod
    def refusal(cls, status: int, code: str, message: str) -> web.Response:
        """An HTTP error before the upgrade (bad key, bad query), in the dialect's shape."""
        return web.json_response({"error": {"code": code, "message": message}}, status=status)

    @classmethod
    def subprotocols(cls, request: web.Request) -> tuple[str, ...]:
        """The subprotocols the server may pick in the handshake (Deepgram's browser auth)."""
        return ()

    async def check_request(self) -> None:
        """Raise ApiError for what the dialect refuses in the handshake (query, path), before the upgrade."""

    async def opened(self) -> None:
        """The socket is open (Deepgram sends its ``Metadata`` here)."""

    # -- the dialect's messages --------------------------------------------------------
    async def on_message(self, message: dict) -> None:
        raise NotImplementedError

    async def utterance_start(self, context: Context, text: str) -> None:
        """An utterance (a sentence, or live text) begins: the dialect sets up its encoder."""

    async def audio(self, context: Context, pcm: np.ndarray) -> None:
        raise NotImplementedError

    async def alignment(self, context: Context, alignment, offset_ms: float) -> None:
        """An utterance's word times (engines.contract.Alignment, from its start; ``offset_ms``:
        where it starts in the context's audio), after its audio; only when the context asked
        for timestamps (``context.timestamps``). Dialects without a timestamp message ignore it."""

    async def utterance_done(self, context: Context, cancelled: bool, failed: bool) -> None:
        """An utterance ended (its encoder's tail, if any, goes out here)."""

    async def round_done(self, context: Context, label: object) -> None:
        """Everything up to a flush (or a cancel) has been spoken; ``label`` is what the
        dialect passed to :meth:`Context.flush` / :meth:`Context.cancel`."""

    async def context_error(self, context: Context | None, code: str, message: str) -> None:
        raise NotImplementedError

    # -- contexts ----------------------------------------------------------------------
    # A context's lifecycle lives here, and only here: open_context (a new context, also
    # for an id used before), end_context (no more text: spoken, then dropped by the dialect
    # when its last round is answered), drop_context (cancelled, or finished). The dialects
    # ask ``self.contexts`` (open or ending contexts by client id) and ``context.ending``.
    def open_context(self, context_id: str) -> Context:
        """A new context with its own speaker task, whatever an earlier context of that id is
        still doing (it was dropped: its engine requests are being cancelled under ids of
        their own). Callers check MAX_CONTEXTS first."""
        earlier = self.contexts.get(context_id)
        if earlier is not None:  # callers open only unknown ids; never let two share one
            self._forget(earlier)
        self.contexts_opened += 1
        context = Context(self, context_id, self.contexts_opened)
        self.contexts[context_id] = context
        context.speaker = asyncio.create_task(self._speak(context))
        self.speakers.add(context.speaker)
        context.speaker.add_done_callback(self.speakers.discard)
        return context

    async def end_context(self, context: Context, label: object) -> None:
        """The client will send no more text for ``context``: speak what it holds; the round
        ``label`` names is answered after it (the dialect drops the context there)."""
        context.ending = True
        await context.flush(label)

    async def _speak(self, context: Context) -> None:
        try:
            await context.speak_loop()
        except SessionClosed:
            pass
        except Exception:  # one context failing never takes the socket down
            log.exception("socket %s context failed", self.socket_id)
        finally:
            if self.contexts.get(context.context_id) is context and context.closed:
                del self.contexts[context.context_id]

    async def drop_context(self, context: Context) -> None:
        """``context`` is over (cancelled by the client, or finished): its engine requests are
        cancelled now, nothing more is written for it, and its id is free for a new context."""
        self._forget(context)

    def _forget(self, context: Context) -> None:
        context.silenced = True
        context.ending = True
        context.closed = True
        context.cancel_all()
        if self.contexts.get(context.context_id) is context:
            del self.contexts[context.context_id]
        if context.speaker is not None and context.speaker is not asyncio.current_task():
            context.speaker.cancel()

    @property
    def busy(self) -> bool:
        return any(c.busy for c in self.contexts.values())

    # -- sending -----------------------------------------------------------------------
    async def send_json(self, message: dict) -> None:
        await self._send(self.ws.send_json, message)

    async def send_bytes(self, data: bytes) -> None:
        await self._send(self.ws.send_bytes, data)

    async def _send(self, send, payload) -> None:
        if self.closed or self.ws.closed:
            raise SessionClosed()
        try:
            async with self.send_lock:
                await send(payload)
            await self.wait_for_reader()
        except (ConnectionError, RuntimeError) as exc:
            raise SessionClosed() from exc

    async def wait_for_reader(self) -> None:
        """Back-pressure: hold the sender while the client is behind (see StreamSession)."""
        await wait_for_reader(self.request)

    async def fatal(self, code: str, message: str, close_code: int) -> None:
        """The socket ends: the dialect's error (bounded wait), then the close."""
        if self.closed:
            return
        self.outcome = code
        try:
            await asyncio.wait_for(self.context_error(None, code, message), SEND_ERROR_TIMEOUT_S)
        except (SessionClosed, asyncio.TimeoutError, ConnectionError, RuntimeError):
            pass
        await self.close(close_code, code)

    async def close(self, close_code: int = WSCloseCode.OK, reason: str = "") -> None:
        self.closed = True
        self.cancel_all()
        await close_socket(self.request, self.ws, close_code, reason.encode()[:120])

    async def abort(self, code: str, message: str) -> None:
        """Called by the drain when the grace period is over."""
        await self.fatal(code, message, WSCloseCode.GOING_AWAY)

    def cancel_all(self) -> None:
        for context in list(self.contexts.values()):
            context.closed = True
            context.cancel_all()
            if context.speaker is not None and context.speaker is not asyncio.current_task():
                context.speaker.cancel()

    # -- the reader (service/ws/reader.py) ---------------------------------------------
    def read_timeout(self, first: bool) -> tuple[float, str]:
        return self.idle_timeout_s, "idle_timeout"

    async def error(self, code: str, message: str) -> None:
        """A client message was refused: the dialect's error, for no context in particular."""
        await self.context_error(None, code, message)


async def serve(request: web.Request, dialect: type[ContextSocket]) -> web.StreamResponse:
    """The WebSocket of ``dialect``: admission, its API key, the per-key limits, then its reader."""
    state = request.app[STATE_KEY]
    endpoint = dialect.ENDPOINT
    try:
        state.check_admission()
    except ApiError as exc:
        return _refuse(request, dialect, endpoint, exc)
    key = dialect.api_key(request)
    if not state.api_keys.accepts(key):
        return _refuse(request, dialect, endpoint, ApiError(401, "unauthorized", "missing or invalid API key"))
    if key:
        request[ACCEPTED_KEY] = key
    identity = client_identity(request, state.api_keys, websocket=True)
    ws = web.WebSocketResponse(max_msg_size=state.settings.max_ws_message_bytes, heartbeat=30.0,
                               protocols=dialect.subprotocols(request))
    socket_ = dialect(request, ws, state)
    try:
        await socket_.check_request()
        state.limits.check_rate(identity)
    except ApiError as exc:
        return _refuse(request, dialect, endpoint, exc)
    if not state.limits.open_session(identity):
        limit = state.settings.max_sessions_per_key
        return _refuse(request, dialect, endpoint,
                       ApiError(429, "too_many_sessions", f"at most {limit} concurrent sessions per key"))
    try:
        ws.headers.update(state.audio_headers())
        await ws.prepare(request)
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER)
        log.info("%s socket %s opened (request %s)", endpoint, socket_.socket_id, request[REQUEST_ID])
        state.streams.add(socket_)
        try:
            await socket_.opened()
            await socket_.read_loop()
        except SessionClosed:
            pass
    finally:
        state.limits.close_session(identity)
        state.streams.discard(socket_)
        socket_.closed = True
        socket_.cancel_all()
        await asyncio.gather(*socket_.speakers, return_exceptions=True)
        if not ws.closed and ws.prepared:
            await ws.close()
        state.metrics.count(endpoint, socket_.outcome)
        request[COUNTED] = True
        log.info("%s socket %s closed (%s)", endpoint, socket_.socket_id, socket_.outcome)
    return ws


def _refuse(request: web.Request, dialect: type[ContextSocket], endpoint: str, exc: ApiError) -> web.Response:
    state = request.app[STATE_KEY]
    state.metrics.count(endpoint, exc.code)
    request[COUNTED] = True
    response = dialect.refusal(exc.status, exc.code, exc.message)
    response.headers.update(exc.headers or {})
    return response


__all__ = ["Context", "ContextSocket", "serve"]
