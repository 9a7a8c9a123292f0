"""The one handshake of every WebSocket the service serves: ``/v1/stream``, vllm-omni's socket
and each voice-agent dialect's.

In order: admission (a draining server takes no new socket), the API key (as the socket's
protocol carries it), the socket's own checks of its request (a dialect's query), the key's
request rate and its concurrent sessions; then the upgrade, a small kernel send buffer (so
back-pressure reaches the engine quickly), the socket's life, and, however it ends, the
session released, its work cancelled and its outcome counted.

A refusal is written the way the socket's protocol says: an HTTP error in the dialect's shape
before the upgrade (:meth:`SocketOwner.refusal`), or - ``/v1/stream``, whose browser clients
cannot read the status of a failed upgrade - an ``error`` message on the opened socket, then a
close (``REFUSE_IN_BAND``). Admission is always refused before the upgrade.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid

from aiohttp import WSCloseCode, web

from service.access.auth import ACCEPTED_KEY, websocket_key
from service.access.limits import client_identity
from service.errors import ApiError, error_response
from service.state import COUNTED, REQUEST_ID, STATE_KEY, AppState
from service.ws.events import CLOSE_OVERLOADED, SessionClosed
from service.ws.reader import MessageReader

log = logging.getLogger("streamvox.ws")

# Back-pressure must reach the engine quickly: cap what the kernel and the transport
# may hold for one slow reader (64 KiB is over a second of PCM16 at 24 kHz, plenty of
# window for real-time audio on any link).
SOCKET_SEND_BUFFER = 64 * 1024
TRANSPORT_BUFFER_LIMIT = 64 * 1024
SEND_ERROR_TIMEOUT_S = 2.0  # a fatal error to a client that does not read: give up and drop the socket
HEARTBEAT_S = 30.0


async def wait_for_reader(request: web.Request) -> None:
    """Back-pressure: return once the socket's write buffer is below ``TRANSPORT_BUFFER_LIMIT``
    (the client reads again); SessionClosed when the connection is going away."""
    transport = request.transport
    while transport is not None and not transport.is_closing() \
            and transport.get_write_buffer_size() > TRANSPORT_BUFFER_LIMIT:
        await asyncio.sleep(0.02)
    if transport is None or transport.is_closing():
        raise SessionClosed()


async def close_socket(request: web.Request, ws: web.WebSocketResponse, close_code: int, reason: bytes) -> None:
    """Close ``ws``; a client that does not answer the close within ``SEND_ERROR_TIMEOUT_S``
    must not hold it open: its connection is dropped."""
    try:
        await asyncio.wait_for(ws.close(code=close_code, message=reason), SEND_ERROR_TIMEOUT_S)
    except asyncio.TimeoutError:
        if request.transport is not None:
            request.transport.close()


class SocketOwner(MessageReader):
    """What the handshake asks of the owner of a socket (it reads the socket: MessageReader)."""

    ENDPOINT = ""  # the route, as the metrics label it
    REFUSE_IN_BAND = False
    outcome = "ok"  # or the error code that ended the socket

    def __init__(self, request: web.Request, ws: web.WebSocketResponse | None, state: AppState):
        self.request = request
        self.ws = ws
        self.state = state
        self.socket_id = uuid.uuid4().hex

    @classmethod
    def api_key(cls, request: web.Request) -> str | None:
        """The key the client presented, where its protocol carries it."""
        return websocket_key(request)

    @classmethod
    def subprotocols(cls, request: web.Request) -> tuple[str, ...]:
        """The subprotocols the server may pick in the handshake."""
        return ()

    @classmethod
    def refusal(cls, status: int, code: str, message: str) -> web.Response:
        """An HTTP error before the upgrade, in the protocol's shape."""
        return error_response(status, code, message)

    async def check_request(self) -> None:
        """Raise ApiError for what the protocol refuses in the handshake (query, path)."""

    async def run(self) -> None:
        """The socket is open: serve it until the client or the server ends it."""
        raise NotImplementedError

    async def shut(self) -> None:
        """The socket ended (however it did): stop every session on it and wait for its tasks."""
        raise NotImplementedError

    async def abort(self, code: str, message: str) -> None:
        """Called by the drain when the grace period is over."""
        await self.fatal(code, message, WSCloseCode.GOING_AWAY)


async def serve(request: web.Request, owner_type: type[SocketOwner]) -> web.StreamResponse:
    """The WebSocket of ``owner_type``: the handshake, then its life (see the module docstring)."""
    state = request.app[STATE_KEY]
    endpoint = owner_type.ENDPOINT
    ws = web.WebSocketResponse(protocols=owner_type.subprotocols(request), heartbeat=HEARTBEAT_S,
                               max_msg_size=state.settings.max_ws_message_bytes)
    ws.headers.update(state.audio_headers())  # in the handshake: not every protocol has a first message
    owner = owner_type(request, ws, state)
    try:
        state.check_admission()
    except ApiError as exc:
        return _refuse_http(request, owner_type, exc)
    try:
        key = owner_type.api_key(request)
        if not state.api_keys.accepts(key):
            raise ApiError(401, "unauthorized", "missing or invalid API key")
        if key:
            request[ACCEPTED_KEY] = key
        await owner.check_request()
        identity = client_identity(request, state.api_keys, websocket=True)
        state.limits.check_rate(identity)
        if not state.limits.open_session(identity):
            raise ApiError(429, "too_many_sessions",
                           f"at most {state.settings.max_sessions_per_key} concurrent sessions per key")
    except ApiError as exc:
        if not owner_type.REFUSE_IN_BAND:
            return _refuse_http(request, owner_type, exc)
        await _prepare(request, ws)
        state.metrics.count(endpoint, exc.code)
        request[COUNTED] = True
        close_code = CLOSE_OVERLOADED if exc.code == "rate_limited" else WSCloseCode.POLICY_VIOLATION
        await owner.fatal(exc.code, exc.message, close_code)
        return ws
    try:
        await _prepare(request, ws)
        log.info("%s socket %s opened (request %s)", endpoint, owner.socket_id, request[REQUEST_ID])
        state.streams.add(owner)
        try:
            await owner.run()
        except SessionClosed:
            pass
    finally:
        state.limits.close_session(identity)
        state.streams.discard(owner)
        await owner.shut()
        if not ws.closed and ws.prepared:
            await ws.close()
        state.metrics.count(endpoint, owner.outcome)
        request[COUNTED] = True
        log.info("%s socket %s closed (%s)", endpoint, owner.socket_id, owner.outcome)
    return ws



async def _prepare(request: web.Request, ws: web.WebSocketResponse) -> None:
    await ws.prepare(request)
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER)


def _refuse_http(request: web.Request, owner_type: type[SocketOwner], exc: ApiError) -> web.Response:
    request.app[STATE_KEY].metrics.count(owner_type.ENDPOINT, exc.code)
    request[COUNTED] = True
    response = owner_type.refusal(exc.status, exc.code, exc.message)
    response.headers.update(exc.headers or {})
    return response


__all__ = ["SEND_ERROR_TIMEOUT_S", "SocketOwner", "close_socket", "serve", "wait_for_reader"]
