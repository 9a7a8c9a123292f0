"""The one error shape every endpoint returns: ``{"error": {"code", "message"}}``."""

from __future__ import annotations

from aiohttp import web

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


# aiohttp's own HTTP exceptions (404 route, 405 method, 413 body) mapped to our codes.
HTTP_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


class StoreUnavailable(Exception):
    """The database behind jobs and saved voices cannot be reached (down, restarting, network).
    Endpoints answer 503 with Retry-After; the job runner keeps its queue and tries again."""
