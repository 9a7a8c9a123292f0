"""What one running app holds: settings, engine, metrics, keys, and the drain switch."""

from __future__ import annotations

import asyncio
from typing import Protocol

from aiohttp import web

from engines.contract import (
    EngineOverloaded,
    EngineUnavailable,
    InvalidRequest,
    SynthesisEngine,
)
from service.access.auth import ApiKeys
from service.access.limits import KeyLimits
from service.errors import ApiError
from service.metrics import Metrics
from service.settings import Settings

RANDOM_WEIGHTS_HEADER = "X-Streamvox-Random-Weights"


class Abortable(Protocol):
    busy: bool  # has work in flight (an idle WebSocket session is not busy)

    async def abort(self, code: str, message: str) -> None: ...


class AppState:
    def __init__(self, settings: Settings, engine: SynthesisEngine):
        self.settings = settings
        self.engine = engine
        self.metrics = Metrics(engine)
        self.api_keys = ApiKeys(settings.api_keys)
        self.limits = KeyLimits(settings.rate_limit, settings.rate_burst, settings.max_sessions_per_key,
                                settings.stream_cap(getattr(engine.info, "slots", None)),
                                per="per API key" if self.api_keys.enabled else "per client address (auth is off)")
        self.draining = False
        self.streams: set[Abortable] = set()  # in-flight real-time work, for the drain
        self.jobs = None  # service.jobs.routes.JobRunner, set by the app on startup

    def audio_headers(self) -> dict[str, str]:
        """Headers of every response carrying audio: ``X-Streamvox-Random-Weights`` names the
        loaded model's components that run on random (untrained) weights, when there are any,
        so that a client saving the file learns it is noise, not speech."""
        random = self.engine.info.random_components
        return {RANDOM_WEIGHTS_HEADER: ",".join(random)} if random else {}

    def ready(self) -> bool:
        stats = self.engine.stats()
        return stats.alive and stats.ready and not self.draining

    def check_admission(self) -> None:
        if self.draining:
            raise ApiError(503, "shutting_down", "the server is shutting down; retry on another replica",
                           headers={"Retry-After": "1"})


# Final-chunk errors that mean "no room for this request now", not a fault: the talker's KV pool
# ran out mid-request (engines/pipelines/talker/source.py). Like every capacity refusal: 503
# with Retry-After, never 500.
CAPACITY_ERRORS = ("kv_cache_exhausted",)
CAPACITY_RETRY_AFTER_S = 2


def is_capacity_error(error: str | None) -> bool:
    return bool(error) and error.split(":", 1)[0].strip() in CAPACITY_ERRORS


def capacity_error() -> ApiError:
    return ApiError(503, "overloaded", "the server ran out of room for this request while generating it (the talker's "
                    "KV cache is full); retry later", headers={"Retry-After": str(CAPACITY_RETRY_AFTER_S)})


def engine_error(exc: Exception) -> ApiError:
    """Map the engine's synchronous submit errors to HTTP."""
    if isinstance(exc, InvalidRequest):
        return ApiError(400, "invalid_field", str(exc))
    if isinstance(exc, EngineOverloaded):
        retry = max(1, round(exc.retry_after_s))
        return ApiError(429, "overloaded", "the server is at capacity; retry later", headers={"Retry-After": str(retry)})
    if isinstance(exc, EngineUnavailable):
        return ApiError(503, "unavailable", "the engine is not running", headers={"Retry-After": "5"})
    raise exc


async def drain(state: AppState, grace_seconds: float) -> None:
    """Stop admission, give in-flight streams ``grace_seconds``, then abort the rest."""
    state.draining = True
    state.metrics.ready.set(0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_seconds
    while any(s.busy for s in state.streams) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    leftovers = list(state.streams)
    if leftovers:
        await asyncio.gather(*(s.abort("shutting_down", "the server is shutting down") for s in leftovers),
                             return_exceptions=True)


STATE_KEY = web.AppKey("streamvox_state", AppState)
REQUEST_ID = web.RequestKey("request_id", str)
COUNTED = web.RequestKey("counted", bool)  # the handler already counted its outcome in requests_total
