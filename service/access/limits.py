"""Per-key limits: a token-bucket rate limit on requests that start work, and caps on
concurrent WebSocket sessions, on the engine requests those sessions hold (every socket and
every context of a dialect's socket together), and on concurrent streamed speech responses.
The key is the API key, or the client address when auth is off (never an unchecked token: a
client could rotate fake ones to dodge every limit). State is in memory, per replica.

The session cap counts work, not sockets: per session it may open, a key may start one
utterance at a time and hold ``REQUESTS_PER_SESSION`` engine requests (the utterance being
spoken and the next one, prefetched), however it spreads them - one Cartesia socket with 16
contexts holds no more than one /v1/stream session would. An utterance waits for its key's
turn; one that would be prefetched beyond the share is simply not prefetched.

The stream cap is a fairness rule, not a quota: it applies only while another identity has
speech in flight (a streamed or whole-file speech request, or an open WebSocket session), so
a lone client may use the whole server (the engine's queue is its limit)."""

from __future__ import annotations

import asyncio
import collections
import math
import time

from aiohttp import web

from service.access.auth import ApiKeys, bearer_key, key_digest, websocket_key
from service.errors import ApiError

MAX_TRACKED_KEYS = 10_000  # beyond this, full (idle) buckets are forgotten
REQUESTS_PER_SESSION = 2  # a /v1/stream session's utterance being spoken and the next one, prefetched


def client_identity(request: web.Request, api_keys: ApiKeys, websocket: bool = False) -> str:
    """Call after the key was checked: with auth on, the accepted key; with auth off, the
    client address, whatever token the client presents."""
    if api_keys.enabled:
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
    def __init__(self, rate: float, burst: int, max_sessions: int, max_streams: int = 0,
                 per: str = "per API key"):
        self.rate = rate
        self.burst = burst
        self.max_sessions = max_sessions
        self.max_requests = max_sessions * REQUESTS_PER_SESSION  # engine requests of a key's sockets (0: no cap)
        self.max_streams = max_streams
        self.per = per  # how an identity is named in messages: "per API key" or "per client address"
        self._buckets: dict[str, TokenBucket] = {}
        self._sessions: dict[str, int] = {}
        self._streams: dict[str, int] = {}
        self._whole: dict[str, int] = {}  # whole-file speech in flight: not capped, but it is contention
        self._requests: dict[str, int] = {}  # engine requests the key's sockets hold
        self._starting: dict[str, int] = {}  # of those, utterances started by open_request (not prefetched)
        self._request_waiters: dict[str, collections.deque[asyncio.Future]] = {}  # in arrival order

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
        _inc(self._sessions, identity)
        return True

    def close_session(self, identity: str) -> None:
        _dec(self._sessions, identity)

    def open_prefetch(self, identity: str) -> bool:
        """Count one engine request that ``identity``'s socket submits ahead (the next utterance,
        while one speaks), if the key's share allows; False otherwise (it is not prefetched)."""
        if self.max_requests and self._requests.get(identity, 0) >= self.max_requests:
            return False
        _inc(self._requests, identity)
        return True

    async def open_request(self, identity: str) -> None:
        """Count one utterance that ``identity``'s socket starts now (its first audio is awaited),
        waiting first come, first served while the key starts as many as its sessions may
        (one each) or holds its share; a wait that is cancelled takes nothing."""
        waiters = self._request_waiters.setdefault(identity, collections.deque())
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        self._admit_waiting(identity)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.close_request(identity, started=True)  # admitted as it was cancelled: pass it on
            raise
        finally:
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters and self._request_waiters.get(identity) is waiters:
                del self._request_waiters[identity]

    def close_request(self, identity: str, started: bool) -> None:
        """One engine request of ``identity``'s sockets ended (``started``: counted by
        :meth:`open_request`); the next waiting utterance may start."""
        _dec(self._requests, identity)
        if started:
            _dec(self._starting, identity)
        self._admit_waiting(identity)

    def _admit_waiting(self, identity: str) -> None:
        waiters = self._request_waiters.get(identity)
        while waiters and (not self.max_requests or (self._requests.get(identity, 0) < self.max_requests
                                                     and self._starting.get(identity, 0) < self.max_sessions)):
            waiter = waiters.popleft()
            if not waiter.done():
                _inc(self._requests, identity)
                _inc(self._starting, identity)
                waiter.set_result(None)

    def others_active(self, identity: str) -> bool:
        """Another identity has speech in flight or a WebSocket session open (it is streaming,
        or waiting for its first audio). Each dict holds only identities with a count > 0, so
        this looks at two entries per dict at most."""
        return any(_has_other(counts, identity) for counts in (self._streams, self._whole, self._sessions))

    def open_stream(self, identity: str) -> None:
        """Count one streamed response of ``identity``; 429 ``too_many_streams`` when it holds
        the cap already *and* another identity has speech in flight: one client's realtime
        streams then cannot fill the device under another's first chunk (the scheduler's
        fairness works on the requests that get in), while a lone client is never refused."""
        held = self._streams.get(identity, 0)
        if self.max_streams and held >= self.max_streams and self.others_active(identity):
            raise ApiError(429, "too_many_streams",
                           f"at most {self.max_streams} concurrent streamed responses {self.per} while other "
                           "clients are streaming; wait for one of yours to finish, or ask the operator to raise "
                           "--max-streams-per-key (STREAMVOX_MAX_STREAMS_PER_KEY; 0 = no cap)",
                           headers={"Retry-After": "1"})
        _inc(self._streams, identity)

    def close_stream(self, identity: str) -> None:
        _dec(self._streams, identity)

    def open_whole(self, identity: str) -> None:
        """A whole-file speech request of ``identity`` is in flight (never refused here)."""
        _inc(self._whole, identity)

    def close_whole(self, identity: str) -> None:
        _dec(self._whole, identity)


def _inc(counts: dict[str, int], identity: str) -> None:
    counts[identity] = counts.get(identity, 0) + 1


def _dec(counts: dict[str, int], identity: str) -> None:
    left = counts.get(identity, 0) - 1
    if left > 0:
        counts[identity] = left
    else:
        counts.pop(identity, None)


def _has_other(counts: dict[str, int], identity: str) -> bool:
    for key in counts:  # at most two iterations: the first key is ours or another's
        if key != identity:
            return True
    return False
