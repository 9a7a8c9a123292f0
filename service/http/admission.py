"""The front of every work-starting HTTP call: admission, rate limit, JSON body, validation, cost."""

from __future__ import annotations

from aiohttp import web

from service.access.limits import client_identity
from service.http.body import read_json_object
from service.state import STATE_KEY
from service.synthesis.params import parse_body
from service.synthesis.plan import check_work, off_loop


async def read_work_request(request: web.Request, model, max_chars: int | None = None, job: bool = False):
    """The common front of every work-starting HTTP call: admission (drain, readiness),
    the per-key rate limit, a JSON object body validated as ``model`` (a
    :mod:`service.synthesis.schema` body; its voice resolved by the engine), and the work it would
    cost, the whole request's (413 ``too_much_work`` before any engine time; ``job``: a job's limits).
    ``max_chars``: the longest text (``--max-input-chars`` unless given). Returns (state, body, its
    plan: service/synthesis/plan.py); raises ApiError."""
    state = request.app[STATE_KEY]
    state.check_admission()
    state.limits.check_rate(client_identity(request, state.api_keys))
    body = await read_json_object(request)
    parsed = parse_body(model, body, state.engine, max_chars or state.settings.max_input_chars)
    plan = await off_loop(parsed.input, check_work, state.engine, parsed.input, parsed.params, state.settings,
                          job_format=parsed.response_format if job else None)
    return state, parsed, plan
