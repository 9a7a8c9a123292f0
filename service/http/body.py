"""The front of a work-starting call (admission, the caller's rate limit), and reading a request
body: bounded in time, decoded in its charset, parsed as one JSON object."""

from __future__ import annotations

import codecs

from aiohttp import web

from service.access.limits import client_identity
from service.errors import ApiError, reading_body
from service.state import STATE_KEY, AppState
from service.synthesis.schema import JsonError, parse_json


async def read_work_request(request: web.Request, foreign_api: bool = False) -> tuple[AppState, str, dict]:
    """The common front of every work-starting HTTP call (speech: service/speech.py; jobs):
    admission (drain, readiness), the per-key rate limit, a JSON object body. Returns (state, who
    asks: :func:`~service.access.limits.client_identity`, with ``foreign_api`` the key a vendor's
    header carried, the body); raises ApiError. Its parsing, voice and plan are the caller's."""
    state = request.app[STATE_KEY]
    state.check_admission()
    identity = client_identity(request, state.api_keys, websocket=foreign_api)
    state.limits.check_rate(identity)
    return state, identity, await read_json_object(request)


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request body, within ``timeout_s`` (a client trickling its body, or stopping
    half way, gets 408); bytes that are not what its ``Content-Encoding`` says are 400; a client
    that goes away mid-body is ``client_closed`` (:func:`service.errors.reading_body`)."""
    async with reading_body(request, timeout_s):
        return await request.read()


def decode_text(body: bytes, charset: str | None) -> str:
    """``body`` as text in the Content-Type's charset (UTF-8 without one); a charset that
    is not a text encoding (``foo``, ``rot13``, ``zlib``) is 415, undecodable bytes 400."""
    charset = (charset or "utf-8").strip().strip('"') or "utf-8"
    refusal = ApiError(415, "unsupported_media_type", f"unsupported charset {charset[:40]!r}; send UTF-8 JSON")
    try:
        codecs.lookup(charset)
    except (LookupError, ValueError):
        raise refusal from None
    try:
        return body.decode(charset)
    except LookupError:  # bytes-to-bytes (zlib, base64) and str-to-str (rot13) codecs are not charsets
        raise refusal from None
    except (UnicodeError, ValueError):
        raise ApiError(400, "invalid_json", f"the request body is not valid {charset[:40]}") from None


async def read_json_object(request: web.Request) -> dict:
    """The one front door for JSON bodies: read with a timeout, decoded in its charset,
    parsed with depth and number limits (:func:`service.synthesis.schema.parse_json`)."""
    settings = request.app[STATE_KEY].settings
    raw = await read_body(request, settings.http_body_seconds)
    try:
        charset = request.charset
    except (ValueError, UnicodeError):
        charset = "invalid"
    text = decode_text(raw, charset)
    try:
        body = parse_json(text)
    except JsonError as exc:
        raise ApiError(400, "invalid_json", f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "the request body must be a JSON object")
    return body
