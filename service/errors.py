"""The one error shape every endpoint returns: ``{"error": {"code", "message"}}``."""

from __future__ import annotations

from aiohttp import web


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
