"""The front of every work-starting HTTP call: admission, the caller's rate limit, its JSON body."""

from __future__ import annotations

from aiohttp import web

from service.access.limits import client_identity
from service.http.body import read_json_object
from service.state import STATE_KEY, AppState


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
