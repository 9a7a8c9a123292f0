"""Optional API keys: constant-time comparison, keys never logged.

A configured key that starts with ``admin.`` is an admin key: it sees and cancels every
key's jobs and saved voices. Every other key sees only the jobs and voices it made. Header bytes that are not UTF-8
never raise: such a key simply does not match (401).
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

WS_SUBPROTOCOL = "streamvox"
WS_KEY_PREFIX = "bearer."  # browsers send the key as a subprotocol "bearer.KEY"
# A key a voice-agent dialect accepted from its own header (xi-api-key, X-API-Key,
# Authorization: Token): the identity and the saved voices of the request are that key's.
ACCEPTED_KEY = web.RequestKey("accepted_api_key", str)
ADMIN_KEY_PREFIX = "admin."  # a configured key named so may see every key's jobs


def key_bytes(presented: str) -> bytes:
    """The bytes the client sent: aiohttp decodes header bytes that are not UTF-8 as lone
    surrogates (surrogateescape); turn them back instead of raising."""
    return presented.encode("utf-8", "surrogateescape")


def key_digest(presented: str) -> str:
    """What is kept in memory and in the job store instead of the key itself."""
    return hashlib.sha256(key_bytes(presented)).hexdigest()[:32]


class ApiKeys:
    def __init__(self, keys: tuple[str, ...]):
        self._keys = tuple(key.encode() for key in keys)
        # owners (as stored with jobs and voices) of the admin keys: a job's owner is all the runner knows
        self._admin_owners = frozenset("key:" + key_digest(key) for key in keys if key.startswith(ADMIN_KEY_PREFIX))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def accepts(self, presented: str | None) -> bool:
        if not self._keys:
            return True
        if not presented:
            return False
        try:
            candidate = key_bytes(presented)
        except UnicodeError:  # not from a header (no surrogateescape round trip): no match
            return False
        matched = False
        for key in self._keys:  # compare against every key so timing does not reveal which matched
            matched |= hmac.compare_digest(candidate, key)
        return matched

    def is_admin(self, presented: str | None) -> bool:
        return bool(presented) and presented.startswith(ADMIN_KEY_PREFIX) and self.accepts(presented)

    def is_admin_owner(self, owner: str | None) -> bool:
        """``owner`` (``key:<digest>``) is an admin key's."""
        return owner in self._admin_owners


def bearer_key(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


def websocket_key(request: web.Request) -> str | None:
    """Header for programs; a ``bearer.KEY`` subprotocol or ``?token=`` for browsers; the key a
    dialect accepted from its own header (``ACCEPTED_KEY``)."""
    key = request.get(ACCEPTED_KEY) or bearer_key(request)
    if key:
        return key
    for protocol in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        protocol = protocol.strip()
        if protocol.startswith(WS_KEY_PREFIX):
            return protocol[len(WS_KEY_PREFIX):]
    return request.query.get("token") or None


def job_owner(request: web.Request, keys: ApiKeys) -> tuple[str | None, bool]:
    """(owner, sees_all) for the jobs API: with auth off there is one owner (None) who sees
    everything; with auth on the owner is the digest of the (already accepted) key."""
    if not keys.enabled:
        return None, True
    key = bearer_key(request)
    if not key:
        return "", False  # unreachable behind the auth middleware; owns nothing
    return "key:" + key_digest(key), keys.is_admin(key)


def key_owner(request: web.Request, keys: ApiKeys) -> tuple[str | None, bool]:
    """(owner, sees_all) as :func:`job_owner`, for routes that WebSockets share (saved voices):
    the key may come as a header, a ``bearer.KEY`` subprotocol or ``?token=``. Plain HTTP routes
    were let in by a valid bearer header, which comes first."""
    if not keys.enabled:
        return None, True
    key = websocket_key(request)
    if not key:
        return "", False
    return "key:" + key_digest(key), keys.is_admin(key)
