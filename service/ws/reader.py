"""The read loop every WebSocket of the service runs: the /v1/stream session
(service/ws/session.py) and the sockets of the other services' dialects (service/ws/contexts.py).

It reads client messages with an idle deadline, yields to the event loop under a flood,
refuses binary frames and oversized messages, decodes JSON (bad input is an ``error``, never
fatal) and hands each message object to its owner. The owner says what a message means and
how its errors are written.
"""

from __future__ import annotations

import asyncio
import logging
import re

from aiohttp import WSCloseCode, WSMsgType, web

from service.errors import ApiError
from service.synthesis.schema import parse_json

log = logging.getLogger("streamvox.ws.reader")

# The reader yields to the event loop after this many messages that arrived together, so a
# flood of cheap messages on one socket never holds the loop (every message is O(1) work).
YIELD_EVERY_MESSAGES = 32
_SURROGATE = re.compile("[\ud800-\udfff]")


def decode_message(data: str) -> dict:
    """A client message as a dict (the service's one JSON decoder: nesting and absurd numbers
    are errors, never crashes); ValueError with a message fit for the client otherwise."""
    message = parse_json(data)
    if not isinstance(message, dict):
        raise ValueError("the message must be a JSON object")
    return message


def surrogate_field(message: dict) -> str | None:
    """The first top-level key or string value holding a lone surrogate (not encodable as UTF-8)."""
    for key, value in message.items():
        if _SURROGATE.search(key):
            return "a field name"
        if isinstance(value, str) and _SURROGATE.search(value):
            return key
    return None


class MessageReader:
    """Mixin for the owner of a socket: ``read_loop`` reads it until the client leaves or
    the owner closes. The owner provides ``ws``, ``closed``, ``busy``, :meth:`error` (a
    non-fatal error message), :meth:`fatal` (error, then close) and :meth:`on_message`."""

    ws: web.WebSocketResponse
    closed: bool
    # What follows the field's name when a message holds a lone surrogate (each wire's own words).
    LONE_SURROGATE = "contains a lone surrogate"

    @property
    def busy(self) -> bool:
        raise NotImplementedError

    async def error(self, code: str, message: str) -> None:
        raise NotImplementedError

    async def fatal(self, code: str, message: str, close_code: int) -> None:
        raise NotImplementedError

    async def on_message(self, message: dict) -> None:
        """One decoded client message (a JSON object free of lone surrogates)."""
        raise NotImplementedError

    def read_timeout(self, first: bool) -> tuple[float, str]:
        """How long the client may stay silent before its (first) next message, and the
        fatal error code when it does."""
        raise NotImplementedError

    async def quiet(self, timeout: float) -> bool:
        """The client sent nothing for ``timeout`` seconds: True to keep reading (the clock
        restarts), False to end the socket with the idle error. Audio still being produced
        means the client is listening, not idling."""
        return self.busy

    async def bad_frame(self) -> None:
        await self.error("binary_not_supported", "send JSON text messages; binary input is not accepted")

    def unusable_value(self, message: dict) -> str:
        """The error text for a message with a field whose value the handler could not use."""
        return "a field has a value that cannot be used"

    async def read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        first_message = True
        last_message = loop.time()
        since_yield = 0
        while not self.closed:
            # Idle means no client *message*: pings and pongs are answered inside receive()
            # and must not restart the clock, so the deadline is kept here, not by receive().
            timeout, timeout_code = self.read_timeout(first_message)
            remaining = last_message + timeout - loop.time()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError()
                async with asyncio.timeout(remaining):  # (no task per message, as wait_for would make)
                    message = await self.ws.receive()
            except asyncio.TimeoutError:
                if await self.quiet(timeout):
                    last_message = loop.time()
                    continue
                await self.fatal(timeout_code, f"no message for {timeout:g} s", WSCloseCode.OK)
                return
            first_message = False
            last_message = loop.time()
            since_yield += 1
            if since_yield >= YIELD_EVERY_MESSAGES:
                since_yield = 0
                await asyncio.sleep(0)  # messages that arrived together do not hold the loop
            if message.type == WSMsgType.TEXT:
                await self.on_text(message.data)
            elif message.type == WSMsgType.BINARY:
                await self.bad_frame()
            elif message.type == WSMsgType.ERROR:
                too_large = isinstance(self.ws.exception(), ValueError)
                await self.fatal("message_too_large" if too_large else "bad_frame", str(self.ws.exception()),
                                 WSCloseCode.MESSAGE_TOO_BIG)
                return
            else:  # CLOSE / CLOSING / CLOSED
                return

    async def on_text(self, data: str) -> None:
        # Bad input is never fatal: an error message, and the socket keeps working.
        try:
            message = decode_message(data)
        except ValueError as exc:
            await self.error("invalid_json", str(exc))
            return
        field = surrogate_field(message)
        if field is not None:
            await self.error("invalid_field", f"{field}: {self.LONE_SURROGATE}")
            return
        try:
            await self.on_message(message)
        except ApiError as exc:
            await self.error(exc.code, exc.message)
        except (ValueError, TypeError, ArithmeticError, RecursionError, KeyError) as exc:
            # Schema checks raise ApiError; anything else a value could trigger stays non-fatal.
            log.debug("message rejected: %s", type(exc).__name__)  # the type only: no log flood, no text
            await self.error("invalid_field", self.unusable_value(message))
