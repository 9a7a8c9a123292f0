"""What the voice-agent dialects share: finding a voice by the name a client sends."""

from __future__ import annotations

from aiohttp import web

from service.errors import ApiError, StoreUnavailable
from service.state import STATE_KEY
from service.voices.clones import Voice, find_voice, voice_choices


async def dialect_voice(request: web.Request, name: str) -> Voice | None:
    """The voice ``name`` names for a dialect's request, resolved once (the one resolver,
    :func:`service.voices.clones.find_voice`): one of the served model's voices or aliases, or a
    saved voice of the caller's; not a Base checkpoint's ``default``, which needs reference audio
    that no dialect sends. None when it names none. Checked before a socket upgrades; what it
    finds is what the dialect's speech is submitted with. Raises ApiError(503) while the saved
    voices' database is down."""
    try:
        found = await find_voice(request, name)
    except StoreUnavailable:
        raise ApiError(503, "database_unavailable", "saved voices are unreachable now; retry, "
                                                    "or use one of the model's voices") from None
    return found if found is not None and not found.needs_reference else None


def unknown_voice(request: web.Request, field: str, name: str) -> str:
    """The message of a dialect's refusal of ``name`` (its ``field``), saying what to name instead."""
    return f"{field} {name[:64]!r} is not a voice of this server; {voice_choices(request.app[STATE_KEY].engine)}"
