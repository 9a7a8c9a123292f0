"""Cross-cutting HTTP concerns: request ids, JSON errors, request counting, auth, CORS."""

from __future__ import annotations

import logging
import os
import random
import re
from dataclasses import dataclass
from typing import Callable

import aiohttp
from aiohttp import web

from service.access.auth import ACCEPTED_KEY, bearer_key
from service.errors import HTTP_STATUS_CODES, ApiError, StoreUnavailable, error_response
from service.http.log_safety import escape_controls
from service.state import COUNTED, REQUEST_ID, STATE_KEY

log = logging.getLogger("streamvox.http")

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# Request ids are unique, not secret: 128 bits of a generator seeded once, with no system call per
# request (uuid4's os.urandom gave up the GIL at every request and waited to win it back)
_request_ids = random.Random(os.urandom(32))


def new_request_id() -> str:
    return f"{_request_ids.getrandbits(128):032x}"
CORS_ORIGIN = web.RequestKey("cors_origin", str)
ACCESS_LOG_DEBUG = web.RequestKey("access_log_debug", bool)
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/", "/playground"})  # the playground page holds no secret
# WebSockets authenticate inside the socket so they can send an `error` message
WS_PATHS = frozenset({"/v1/stream", "/v1/audio/speech/stream"})


@dataclass(frozen=True)
class ForeignApi:
    """Another TTS service's API, served under its own path prefixes (service/ws/dialects/):
    there the key comes from that service's header and every error - an unknown route, a wrong
    method, a bad field, a refused key - has that service's body, so its SDK reports it."""

    name: str
    prefixes: tuple[str, ...]  # "/tts" covers /tts and /tts/...
    api_key: Callable[[web.Request], str | None]
    key_hint: str  # where the key goes, for the 401 message
    error_body: Callable[[int, str, str, str], dict]  # (status, code, message, request id) -> JSON body

    def serves(self, path: str) -> bool:
        return any(path == prefix or path.startswith(prefix + "/") for prefix in self.prefixes)


FOREIGN_APIS = web.AppKey("foreign_apis", tuple)  # the ForeignApi of each dialect (service/app.py)


def foreign_api(request: web.Request) -> ForeignApi | None:
    for api in request.app.get(FOREIGN_APIS, ()):
        if api.serves(request.path):
            return api
    return None


def _error(request: web.Request, status: int, code: str, message: str,
           headers: dict[str, str] | None = None) -> web.Response:
    """Our error body, or under another service's prefix that service's."""
    api = foreign_api(request)
    if api is None:
        return error_response(status, code, message, headers)
    return web.json_response(api.error_body(status, code, message, request.get(REQUEST_ID, "")), status=status,
                             headers=headers)


def endpoint_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


async def on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Headers every response carries, streamed or not: its request id and CORS."""
    if REQUEST_ID in request:
        response.headers["X-Request-Id"] = request[REQUEST_ID]
    origin = request.get(CORS_ORIGIN)
    if origin:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = ("X-Request-Id, Location, Retry-After, "
                                                             "X-Streamvox-Random-Weights")
        response.headers["Vary"] = "Origin"


@web.middleware
async def request_id_middleware(request: web.Request, handler):
    incoming = request.headers.get("X-Request-Id", "")
    request[REQUEST_ID] = incoming if _REQUEST_ID_RE.fullmatch(incoming) else new_request_id()
    bad = undecodable_header(request)
    if bad is not None:  # before any handler (auth, CORS, the WS upgrade) reads it
        request.app[STATE_KEY].metrics.count(endpoint_label(request), "bad_request")
        return error_response(400, "bad_request", f"header {bad}: not valid UTF-8")
    return await handler(request)


def undecodable_header(request: web.Request) -> str | None:
    """The name of the first header whose bytes were not UTF-8 (aiohttp keeps them as
    lone surrogates, which crash whoever encodes them later), else None."""
    for name, value in request.headers.items():
        try:
            name.encode("utf-8")
            value.encode("utf-8")
        except UnicodeEncodeError:
            return name.encode("ascii", "replace").decode()[:64]
    return None


CLIENT_GONE = (ConnectionError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)


STORE_RETRY_AFTER_SECONDS = 5  # Retry-After while the job/voice database is unreachable


@web.middleware
async def error_middleware(request: web.Request, handler):
    metrics = request.app[STATE_KEY].metrics
    endpoint = endpoint_label(request)
    try:
        response = await handler(request)
    except ApiError as exc:
        metrics.count(endpoint, exc.code)
        if exc.code == "client_closed":
            log.info("request %s: %s", request.get(REQUEST_ID), exc.message)
        return _error(request, exc.status, exc.code, exc.message, exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = HTTP_STATUS_CODES.get(exc.status, "http_error")
        metrics.count(endpoint, code)
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        return _error(request, exc.status, code, message or exc.reason)
    except StoreUnavailable as exc:  # the jobs' and voices' database is down: retry later, not a 500
        log.warning("request %s: %s", request.get(REQUEST_ID), exc)
        metrics.count(endpoint, "database_unavailable")
        return _error(request, 503, "database_unavailable", "the job and voice database is unreachable; retry later "
                              "(streaming without saved voices is unaffected)",
                              {"Retry-After": str(STORE_RETRY_AFTER_SECONDS)})
    except CLIENT_GONE as exc:  # the client went away: not our error, no traceback
        log.info("request %s: the client went away (%s)", request.get(REQUEST_ID), type(exc).__name__)
        metrics.count(endpoint, "client_closed")
        return _error(request, 499, "client_closed", "the client went away")
    except Exception:
        log.exception("request %s failed", request.get(REQUEST_ID))
        metrics.count(endpoint, "internal_error")
        return _error(request, 500, "internal_error", f"internal error (request id {request.get(REQUEST_ID)})")
    if not request.get(COUNTED):
        metrics.count(endpoint, "ok" if response.status < 400 else HTTP_STATUS_CODES.get(response.status, "error"))
    return response


def log_at_debug(request: web.Request) -> None:
    """This request's access-log line at DEBUG, not INFO: a poll (a job's status, asked every
    second or so while a client waits) is not news."""
    request[ACCESS_LOG_DEBUG] = True


@web.middleware
async def access_log_middleware(request: web.Request, handler):
    """Our access log: path without the query string (it may hold ?token=KEY), plus the request id."""
    response = await handler(request)
    log.log(logging.DEBUG if request.get(ACCESS_LOG_DEBUG) else logging.INFO, "%s %s -> %d (request %s)",
            request.method, escape_controls(request.path), response.status,
            request.get(REQUEST_ID))  # the decoded path may hold "\n": never a line of its own
    return response


@web.middleware
async def auth_middleware(request: web.Request, handler):
    state = request.app[STATE_KEY]
    if not state.api_keys.enabled or request.method == "OPTIONS":
        return await handler(request)
    api = foreign_api(request)
    if api is not None:  # that service's own key header
        key = api.api_key(request)
        if not state.api_keys.accepts(key):
            raise ApiError(401, "unauthorized", f"missing or invalid API key ({api.key_hint})")
        request[ACCEPTED_KEY] = key  # the client's identity for limits and saved voices
    elif not _is_open(request.path, state.settings.metrics_auth):
        if not state.api_keys.accepts(bearer_key(request)):
            raise ApiError(401, "unauthorized", "missing or invalid API key (Authorization: Bearer KEY)",
                           headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


def _is_open(path: str, metrics_auth: bool) -> bool:
    return path in OPEN_PATHS or path in WS_PATHS or (path == "/metrics" and not metrics_auth)


def cors_middleware(origins: tuple[str, ...]):
    allow_any = "*" in origins

    @web.middleware
    async def middleware(request: web.Request, handler):
        origin = request.headers.get("Origin")
        allowed = origin is not None and (allow_any or origin in origins)
        if not allowed:
            return await handler(request)
        request[CORS_ORIGIN] = origin
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Request-Id",
                "Access-Control-Max-Age": "600",
            })
        return await handler(request)

    return middleware
