"""Optional API keys: constant-time comparison, keys never logged."""

from __future__ import annotations

import hmac

from aiohttp import web

WS_SUBPROTOCOL = "streamvox"
WS_KEY_PREFIX = "bearer."  # browsers send the key as a subprotocol "bearer.KEY"


class ApiKeys:
    def __init__(self, keys: tuple[str, ...]):
        self._keys = tuple(key.encode() for key in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def accepts(self, presented: str | None) -> bool:
        if not self._keys:
            return True
        if not presented:
            return False
        candidate = presented.encode()
        matched = False
        for key in self._keys:  # compare against every key so timing does not reveal which matched
            matched |= hmac.compare_digest(candidate, key)
        return matched


def bearer_key(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


def websocket_key(request: web.Request) -> str | None:
    """Header for programs; a ``bearer.KEY`` subprotocol or ``?token=`` for browsers."""
    key = bearer_key(request)
    if key:
        return key
    for protocol in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        protocol = protocol.strip()
        if protocol.startswith(WS_KEY_PREFIX):
            return protocol[len(WS_KEY_PREFIX):]
    return request.query.get("token") or None
