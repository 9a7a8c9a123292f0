"""The one error shape every endpoint returns: ``{"error": {"code", "message"}}``."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from engines.contract import EngineError, EngineOverloaded, EngineUnavailable


class ApiError(Exception):
    """Raised by handlers for any client-visible failure; turned into JSON by middleware."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def error_body(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(code, message), status=status, headers=headers)


def invalid_field(field: str, message: str) -> ApiError:
    return ApiError(400, "invalid_field", f"{field}: {message}")


RETRY_LATER = (429, 503)  # engine_error statuses that say "the engine is busy or down", not "bad request"


def engine_error(exc: EngineError) -> ApiError:
    """The one map from the engine's refusals to client errors: InvalidRequest (a 400 naming the
    field), EngineOverloaded (429), EngineUnavailable (503). A WebSocket session and the job
    runner read the status: ``RETRY_LATER`` ones are "try later", the others the request's fault."""
    if isinstance(exc, EngineOverloaded):
        retry = max(1, round(exc.retry_after_s))
        return ApiError(429, "overloaded", "the server is at capacity; retry later", headers={"Retry-After": str(retry)})
    if isinstance(exc, EngineUnavailable):
        return ApiError(503, "unavailable", "the engine is not running", headers={"Retry-After": "5"})
    return ApiError(400, "invalid_field", str(exc))


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


# aiohttp's own HTTP exceptions (404 route, 405 method, 413 body) mapped to our codes.
HTTP_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


@asynccontextmanager
async def reading_body(request: web.Request, timeout_s: float) -> AsyncIterator[None]:
    """Around every read of a request body (JSON: service/http/body.py; multipart: the voice
    upload): what the read may raise, as the client's error. Bytes that do not decode in the
    body's ``Content-Encoding`` (a "gzip" body that is not gzip) are 400 ``invalid_body``; a body
    that takes longer than ``timeout_s`` to arrive (trickled, or stopped half way) is 408; a
    client that goes away mid-body is ``client_closed``."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        raise ApiError(408, "body_timeout", f"the request body did not arrive within {timeout_s:g} s",
                       headers={"Connection": "close"}) from None
    except RequestPayloadError as exc:  # aiohttp's decoder refused the bytes (its message names the encoding)
        # The rest of the body can never be read: marked read, so that aiohttp does not read it after
        # the answer ("lingering") and log the decoder's error again as an unhandled traceback.
        request.content.feed_eof()
        raise ApiError(400, "invalid_body", f"the request body could not be read: {_payload_problem(exc)}",
                       headers={"Connection": "close"}) from None
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as exc:
        raise ApiError(499, "client_closed", f"the client went away mid-body ({type(exc).__name__})") from None


def _payload_problem(exc: RequestPayloadError) -> str:
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    message = " ".join(str(getattr(cause, "message", "") or cause).split())  # aiohttp's "400, message: ..." on one line
    return message[:200] or "malformed payload"


class StoreUnavailable(Exception):
    """The database behind jobs and saved voices cannot be reached (down, restarting, network).
    Endpoints answer 503 with Retry-After; the job runner keeps its queue and tries again."""
