"""What the voice-agent dialects share: finding a voice by the name a client sends."""

from __future__ import annotations

from aiohttp import web

from engines.contract import InvalidRequest
from service.errors import ApiError, StoreUnavailable
from service.state import STATE_KEY
from service.voices.clones import saved_clone


async def known_voice(request: web.Request, name: str) -> bool:
    """Whether ``name`` is one of the served model's voices (or an alias) or a saved voice.
    Raises ApiError(503) while the saved voices' database is down."""
    state = request.app[STATE_KEY]
    try:
        state.engine.resolve_voice(name)
        return True
    except InvalidRequest:
        pass
    try:
        return await saved_clone(request, name) is not None
    except StoreUnavailable:
        raise ApiError(503, "database_unavailable", "saved voices are unreachable now; retry, "
                                                    "or use one of the model's voices") from None


def voice_list(request: web.Request) -> str:
    return ", ".join(request.app[STATE_KEY].engine.info.voices)
