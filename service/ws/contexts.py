"""Speech contexts on a shared WebSocket: the hook the wire dialects of other TTS services
(service/ws/dialects/) stand on.

A *context* is one stream of speech on a socket: a :class:`~service.ws.core.SessionCore` - the
one session core: sentence cutting or live text, prefetch, cancellation, voices, work limits -
whose sink is the :class:`Context`, which hands the core's events to the dialect's methods, which
write that service's own messages. A :class:`ContextSocket` owns the socket: the handshake
(service/ws/handshake.py), reading, a send lock shared by its contexts, and the contexts
themselves (one for ElevenLabs ``stream-input`` and Deepgram, many for ElevenLabs
``multi-stream-input`` and Cartesia), each with its own speaker task so that they speak
concurrently and one can be cancelled alone.

    class MyDialect(ContextSocket):
        async def on_message(self, message): ...          # parse the dialect's client message
        async def audio(self, context, pcm): ...           # write the dialect's audio message
    return await serve(request, MyDialect)
"""

from __future__ import annotations

import asyncio
import collections
import logging

import numpy as np
from aiohttp import WSCloseCode, web

from service.state import AppState
from service.synthesis.events import AlignmentReady, Audio, StreamBehind, UtteranceTruncated
from service.voices.clones import Voice
from service.ws.core import SessionCore
from service.ws.events import RoundDone, SessionClosed, SessionError, SessionSink, UtteranceDone, UtteranceStarted
from service.ws.handshake import SEND_ERROR_TIMEOUT_S, SocketOwner, close_socket, wait_for_reader

log = logging.getLogger("streamvox.ws.contexts")


class Context(SessionSink):
    """One stream of speech on a :class:`ContextSocket`: the session core's sink, which hands
    its events to the socket's dialect. A dialect calls :meth:`configure`, :meth:`add_text`,
    :meth:`flush` and :meth:`cancel`."""

    def __init__(self, owner: ContextSocket, context_id: str, number: int):
        self.owner = owner
        self.number = number  # the socket's count of its contexts (its engine requests' ids; logs)
        self.context_id = context_id  # the client's name for it, which a later context may reuse
        # Engine request ids are "<socket>-c<n>-<utterance>": unique by construction (the
        # socket's own counter), never built from client text, so two contexts whose ids
        # share a prefix, or a context reopened under an id that is still winding down,
        # can never meet in the engine.
        self.core = SessionCore(owner.request, owner.state, self, f"{owner.socket_id}-c{number}",
                                text_streaming=owner.TEXT_STREAMING)
        self.ending = False  # the client ended it (no more text): what is buffered is spoken, then it goes
        self.silenced = False  # the client dropped this context: nothing more is written for it
        self.speaker: asyncio.Task | None = None
        self.extra: dict = {}  # the dialect's per-context state (output format, counters)
        self.round_labels: collections.deque = collections.deque()  # what each pending round was, in order

    # -- what a dialect calls ----------------------------------------------------------
    async def configure(self, voice: Voice, speed: object = None, timestamps: bool = False) -> None:
        """The context's voice (as the dialect found it: service/ws/dialects/common.py), ``speed``
        (None: 1.0) and word timestamps (a refusal is the dialect's error)."""
        await self.core.configure({"speed": speed}, voice=voice, timestamps=timestamps)

    async def add_text(self, text: str) -> None:
        await self.core.add_text(text)

    @property
    def can_end_round(self) -> bool:
        """False when the client ends rounds faster than they are answered (a flood of flushes)."""
        return self.core.can_end_round

    async def flush(self, label: object = None) -> None:
        """Speak what is buffered; ``round_done(label)`` follows its audio. Check can_end_round first."""
        self.round_labels.append(label)
        await self.core.end_round()

    async def cancel(self, label: object = None) -> None:
        """Barge-in: drop queued text and stop the utterance being spoken within one chunk;
        ``round_done(label)`` follows (after the rounds still pending, each answered in order)."""
        self.round_labels.append(label)
        await self.core.cancel()

    # -- the core's events, to the dialect -----------------------------------------------
    def _writes(self) -> bool:
        """Whether the dialect hears of this context still (SessionClosed: the socket is gone)."""
        if self.core.closed or self.owner.closed:
            raise SessionClosed()
        return not self.silenced

    async def utterance_started(self, event: UtteranceStarted) -> None:
        if self._writes():
            await self.owner.utterance_start(self, event.text)

    async def audio(self, event: Audio) -> None:
        # While the core cancels an utterance it sends a short fade to silence: a dialect's
        # barge-in means no more audio for the context at all.
        if not self.core.cancelling and not self.silenced and event.pcm.size:
            await self.owner.audio(self, np.asarray(event.pcm, dtype=np.float32))

    async def stream_behind(self, event: StreamBehind) -> None:
        if not self.core.cancelling and not self.silenced:
            await self.owner.stream_behind(self, event)

    async def utterance_truncated(self, event: UtteranceTruncated) -> None:
        if not self.silenced:
            await self.owner.utterance_truncated(self, event)

    async def alignment(self, event: AlignmentReady) -> None:
        if not self.silenced:
            await self.owner.alignment(self, event.alignment, event.offset_ms)

    async def utterance_done(self, event: UtteranceDone) -> None:
        if self._writes():
            await self.owner.utterance_done(self, cancelled=event.cancelled, failed=bool(event.error))

    async def round_done(self, event: RoundDone) -> None:
        if self._writes():
            label = self.round_labels.popleft() if self.round_labels else None
            await self.owner.round_done(self, label)

    async def session_error(self, event: SessionError) -> None:
        if not self.silenced:
            await self.owner.context_error(self, event.code, event.message)

    async def session_failed(self, event: SessionError) -> None:
        """A fatal error of the core (overloaded, engine gone) ends this context, not the socket."""
        await self.session_error(event)


class ContextSocket(SocketOwner):
    """A dialect's socket. Subclasses parse client messages (:meth:`on_message`) and write
    the events of their contexts (:meth:`utterance_start`, :meth:`audio`, ...)."""

    MAX_CONTEXTS = 1
    TEXT_STREAMING: bool | None = None  # its contexts' live text: None, the model's

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, state: AppState):
        super().__init__(request, ws, state)
        self.contexts: dict[str, Context] = {}  # open or ending contexts, by the client's id
        self.contexts_opened = 0  # contexts opened on this socket so far: each one's number
        self.speakers: set[asyncio.Task] = set()  # every context's speaker task until it ends, dropped ones too
        self.closed = False
        self.outcome = "ok"
        self.send_lock = asyncio.Lock()
        self.idle_timeout_s = state.settings.ws_idle_timeout_s

    # -- the socket's life (service/ws/handshake.py: a dialect gives its api_key, refusal,
    # subprotocols and check_request there) --------------------------------------------
    async def run(self) -> None:
        await self.opened()
        await self.read_loop()

    async def opened(self) -> None:
        """The socket is open (Deepgram sends its ``Metadata`` here)."""

    async def shut(self) -> None:
        self.closed = True
        self.cancel_all()
        await asyncio.gather(*self.speakers, return_exceptions=True)

    # -- the dialect's messages --------------------------------------------------------
    async def on_message(self, message: dict) -> None:
        raise NotImplementedError

    async def utterance_start(self, context: Context, text: str) -> None:
        """An utterance (a sentence, or live text) begins: the dialect sets up its encoder."""

    async def audio(self, context: Context, pcm: np.ndarray) -> None:
        raise NotImplementedError

    async def stream_behind(self, context: Context, event: StreamBehind) -> None:
        """The audio that follows comes after ``context``'s listener ran out (the engine is slower
        than real time). A dialect with no message for it logs it (/metrics counts it too)."""
        log.info("socket %s context %s: the audio is %.3f s behind its listener (%.3f s in all)", self.socket_id,
                 context.number, event.gap_s, event.behind_s)

    async def utterance_truncated(self, context: Context, event: UtteranceTruncated) -> None:
        """The engine ended an utterance of ``context`` early (a runaway; ``event.reason``). A dialect
        with no message for it logs it (/metrics counts it too)."""
        log.info("socket %s context %s: utterance %d ended early (%s)", self.socket_id, context.number,
                 event.index, event.reason)

    async def alignment(self, context: Context, alignment, offset_ms: float) -> None:
        """An utterance's word times (engines.contract.Alignment, from its start; ``offset_ms``:
        where it starts in the context's audio), after its audio; only when the context asked
        for timestamps (:meth:`Context.configure`). Dialects without a timestamp message ignore it."""

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
            await context.core.speak_loop()
        except SessionClosed:
            pass
        except Exception:  # one context failing never takes the socket down
            log.exception("socket %s context failed", self.socket_id)
        finally:
            if self.contexts.get(context.context_id) is context and context.core.closed:
                del self.contexts[context.context_id]

    async def drop_context(self, context: Context) -> None:
        """``context`` is over (cancelled by the client, or finished): its engine requests are
        cancelled now, nothing more is written for it, and its id is free for a new context."""
        self._forget(context)

    def _forget(self, context: Context) -> None:
        context.silenced = True
        context.ending = True
        context.core.stop()
        if self.contexts.get(context.context_id) is context:
            del self.contexts[context.context_id]
        if context.speaker is not None and context.speaker is not asyncio.current_task():
            context.speaker.cancel()

    @property
    def busy(self) -> bool:
        return any(c.core.busy for c in self.contexts.values())

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
            await wait_for_reader(self.request)  # back-pressure: the sender waits while the client is behind
        except (ConnectionError, RuntimeError) as exc:
            raise SessionClosed() from exc

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

    def cancel_all(self) -> None:
        for context in list(self.contexts.values()):
            context.core.stop()
            if context.speaker is not None and context.speaker is not asyncio.current_task():
                context.speaker.cancel()

    # -- the reader (service/ws/reader.py) ---------------------------------------------
    def read_timeout(self, first: bool) -> tuple[float, str]:
        return self.idle_timeout_s, "idle_timeout"

    async def error(self, code: str, message: str) -> None:
        """A client message was refused: the dialect's error, for no context in particular."""
        await self.context_error(None, code, message)


__all__ = ["Context", "ContextSocket"]
