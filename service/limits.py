"""Per-key limits: a token-bucket rate limit on requests that start work, and caps on
concurrent WebSocket sessions and on concurrent streamed speech responses. The key is the
API key, or the client address when auth is off (never an unchecked token: a client could
rotate fake ones to dodge every limit). State is in memory, per replica."""

from __future__ import annotations

import math
import time

from aiohttp import web

from .auth import bearer_key, key_digest, websocket_key
from .errors import ApiError

MAX_TRACKED_KEYS = 10_000  # beyond this, full (idle) buckets are forgotten


def client_identity(request: web.Request, websocket: bool = False) -> str:
    """Call after the key was checked: with auth on, the accepted key; with auth off, the
    client address, whatever token the client presents."""
    from .state import STATE_KEY  # state imports this module

    if request.app[STATE_KEY].api_keys.enabled:
        key = websocket_key(request) if websocket else bearer_key(request)
        if key:  # keep only a digest in memory, never the key itself
            return "key:" + key_digest(key)
    return "addr:" + (request.remote or "unknown")


class TokenBucket:
    def __init__(self, rate: float, burst: int):
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.updated = time.monotonic()

    def take(self) -> float:
        """Take one token; returns 0 on success, else the seconds until one is available."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate

    @property
    def full(self) -> bool:
        return self.tokens + (time.monotonic() - self.updated) * self.rate >= self.burst


class KeyLimits:
    def __init__(self, rate: float, burst: int, max_sessions: int, max_streams: int = 0):
        self.rate = rate
        self.burst = burst
        self.max_sessions = max_sessions
        self.max_streams = max_streams
        self._buckets: dict[str, TokenBucket] = {}
        self._sessions: dict[str, int] = {}
        self._streams: dict[str, int] = {}

    def check_rate(self, identity: str) -> None:
        """Raises 429 ``rate_limited`` with Retry-After when the key is over its rate."""
        if self.rate <= 0:
            return
        bucket = self._buckets.get(identity)
        if bucket is None:
            if len(self._buckets) >= MAX_TRACKED_KEYS:
                self._buckets = {k: b for k, b in self._buckets.items() if not b.full}
            bucket = self._buckets[identity] = TokenBucket(self.rate, self.burst)
        wait = bucket.take()
        if wait > 0:
            raise ApiError(429, "rate_limited", f"more than {self.rate:g} requests/s for this key; slow down",
                           headers={"Retry-After": str(max(1, math.ceil(wait)))})

    def open_session(self, identity: str) -> bool:
        if self.max_sessions and self._sessions.get(identity, 0) >= self.max_sessions:
            return False
        self._sessions[identity] = self._sessions.get(identity, 0) + 1
        return True

    def close_session(self, identity: str) -> None:
        left = self._sessions.get(identity, 0) - 1
        if left > 0:
            self._sessions[identity] = left
        else:
            self._sessions.pop(identity, None)

    def open_stream(self, identity: str) -> None:
        """Count one streamed response of ``identity``; 429 ``too_many_streams`` at the cap
        (one client's realtime streams cannot fill the device: the scheduler's fairness
        works on the requests that get in)."""
        held = self._streams.get(identity, 0)
        if self.max_streams and held >= self.max_streams:
            raise ApiError(429, "too_many_streams", f"at most {self.max_streams} concurrent streamed responses "
                                                    "per key; wait for one to finish", headers={"Retry-After": "1"})
        self._streams[identity] = held + 1

    def close_stream(self, identity: str) -> None:
        left = self._streams.get(identity, 0) - 1
        if left > 0:
            self._streams[identity] = left
        else:
            self._streams.pop(identity, None)
