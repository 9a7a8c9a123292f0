"""A request's voice prompt, as the caller's key sees the saved voices: inline reference audio
(``ref_audio`` + ``ref_text`` / ``x_vector_only_mode``) or a saved voice, turned into the
engine request's ``clone``. Speech bodies, WebSocket sessions, the voice-agent dialects and the
job runner all ask here; the saved-voice routes (service/voices/routes.py) store what they read.

* ``ref_audio`` (base64, a ``data:`` URL, or an ``http(s)://`` / ``file://`` URL under
  ``--ref-audio-url-prefixes``: service/voices/fetch.py) -> float32 mono 24 kHz by
  :func:`service.voices.decoder_pool.decode_reference` (allowed containers only, in a worker
  process), refused with a 4xx naming the problem when it is not allowed or decodable, empty,
  silent, shorter than 1 s, longer than ``--max-ref-audio-seconds`` or larger than
  ``--max-ref-audio-mb``.
* :func:`voice_for` - a request's voice, resolved once: inline ``ref_audio`` first (it wins over
  a ``voice`` that names no saved voice, as vllm-omni clients send ``voice: "vivian"`` with it),
  else what :func:`find_voice` - the one voice resolver of every route and socket - finds for
  ``voice``: a voice of the model, or a saved voice. Features come from ``engine.voice_features`` (computed
  once per content, off the event loop) or from the store.

Saved voices belong to their key, as jobs do (:class:`VoiceScope`): with keys on, a key uses
only its own voices (another key's voice does not exist for it), admin keys may also use the
unowned ones (saved before voices had owners). With auth off there is one namespace.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from engines.contract import InvalidRequest, SynthesisEngine, VoiceClone
from service.access.auth import key_owner
from service.errors import ApiError, engine_error
from service.state import STATE_KEY
from service.synthesis.schema import CloneFields
from service.voices.decoder_pool import decode_reference
from service.voices.fetch import fetch_reference, is_url
from service.voices.store import VoiceStore

VOICE_STORE_KEY: web.AppKey[VoiceStore] = web.AppKey("voice_store", VoiceStore)


@dataclass(frozen=True)
class VoiceScope:
    """Whose saved voices a caller works with: ``owner`` (None: the unowned namespace, all there
    is with auth off) for uploads and names; ``sees_all``: lists every owner's voices and may
    name the unowned ones (admin keys; everyone with auth off)."""

    owner: str | None
    sees_all: bool

    def lookup(self) -> tuple[str | None, ...]:
        """The namespaces a voice name is looked up in, in order: the caller's own, then (an
        admin key's) the unowned one."""
        if self.owner is not None and self.sees_all:
            return (self.owner, None)
        return (self.owner,)


def voice_scope(request: web.Request) -> VoiceScope:
    owner, sees_all = key_owner(request, request.app[STATE_KEY].api_keys)
    if owner == "":  # keys on and no key: unreachable past the auth checks, and it owns nothing
        raise ApiError(401, "unauthorized", "missing or invalid API key")
    return VoiceScope(owner, sees_all)


def job_voice_scope(app: web.Application, job_owner: str | None) -> VoiceScope:
    """The scope of a stored job's owner (the runner has no request): with keys on the key's
    digest; with auth off a job's owner is its client address, and voices have one namespace."""
    keys = app[STATE_KEY].api_keys
    if not keys.enabled:
        return VoiceScope(None, True)
    return VoiceScope(job_owner or "", keys.is_admin_owner(job_owner))


def audio_error(field: str, message: str, code: str = "invalid_audio", status: int = 400) -> ApiError:
    return ApiError(status, code, f"{field}: {message}")


def decode_base64_audio(value: str, max_bytes: int, field: str = "ref_audio") -> bytes:
    """Base64 or a ``data:[mime];base64,`` URL -> bytes (other URLs: service/voices/fetch.py)."""
    text = value.strip()
    if text[:5].lower() == "data:":
        header, sep, text = text.partition(",")
        if not sep or ";base64" not in header.lower():
            raise audio_error(field, "a data: URL must be base64 encoded (data:audio/wav;base64,...)", code="invalid_field")
    if len(text) * 3 // 4 > max_bytes:
        raise audio_error(field, f"more than {max_bytes // (1 << 20)} MiB of audio", code="ref_audio_too_large", status=413)
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise audio_error(field, "not valid base64", code="invalid_field") from None
    return data


async def features_of(engine: SynthesisEngine, audio: np.ndarray, field: str = "ref_audio"):
    """The engine's features of a reference (off the event loop); 400 when it cannot clone."""
    try:
        return await asyncio.to_thread(engine.voice_features, audio)
    except InvalidRequest as exc:
        raise engine_error(exc) from None


def content_key(audio: np.ndarray) -> str:
    return hashlib.sha256(audio.tobytes()).hexdigest()


@dataclass(frozen=True)
class Voice:
    """A voice the caller may name on the loaded release (:func:`find_voice`)."""

    name: str  # the model's canonical name for it, or the saved voice's
    clone: VoiceClone | None = None  # a saved voice's prompt
    needs_reference: bool = False  # Base's own "default": it speaks only with the request's ref_audio


async def voice_for(request: web.Request, name: str, fields: CloneFields | None = None) -> Voice:
    """The voice a speech body, a WebSocket ``session.config`` or a job names, resolved once (its
    result travels in the request plan, service/synthesis/plan.py): inline ``fields.ref_audio``
    first (it wins over a ``name`` that names no saved voice, as vllm-omni clients send ``voice:
    "vivian"`` with it), else what :func:`find_voice` finds for ``name``; ApiError(400) for a name
    that is neither. Raises StoreUnavailable while a shared store's database is down."""
    if fields is not None and fields.ref_audio is not None:
        return Voice(name, await inline_clone(request.app[STATE_KEY], fields))
    found = await find_voice(request, name)
    if found is None:
        raise ApiError(400, "invalid_field", f"voice: {name[:64]!r} is not a voice of this server; "
                                             f"{voice_choices(request.app[STATE_KEY].engine)}")
    if fields is not None and fields.x_vector_only_mode and found.clone is not None:
        return Voice(found.name, VoiceClone(found.clone.xvector, key=found.clone.key))
    return found


async def inline_clone(state, fields: CloneFields) -> VoiceClone:
    """The clone of inline reference audio (see the module docstring)."""
    settings = state.settings
    max_bytes = int(settings.max_ref_audio_mb * (1 << 20))
    if is_url(fields.ref_audio):  # only under the operator's prefixes (--ref-audio-url-prefixes)
        data = await fetch_reference(fields.ref_audio, settings.ref_audio_url_prefixes, max_bytes)
    else:
        data = decode_base64_audio(fields.ref_audio, max_bytes)
    audio = await decode_reference(data, settings.max_ref_audio_seconds)
    x_only = bool(fields.x_vector_only_mode)
    if not x_only and not (fields.ref_text or "").strip():
        raise ApiError(400, "invalid_field", "ref_text: in-context cloning needs the transcript of ref_audio "
                                             "(or x_vector_only_mode: true)")
    features = await features_of(state.engine, audio)
    if x_only:
        return VoiceClone(features.xvector, key=content_key(audio))
    return VoiceClone(features.xvector, features.codes, fields.ref_text, key=content_key(audio))


async def find_voice(request: web.Request, name: str) -> Voice | None:
    """The one voice resolver of every route and socket (the dialects' handshakes, speech bodies,
    WebSocket ``session.config``, jobs): what ``name`` names for this caller on the loaded release,
    else None.

    * a release of preset voices (the DiT, CustomVoice): one of them or an alias, in any case;
    * a release that clones (Base): a saved voice of the caller's (another key's is no voice), or
      its own ``default``, which needs the request's reference audio;
    * VoiceDesign: any name (the voice is the request's instructions; a name names nothing).

    Raises StoreUnavailable while a shared store's database is down."""
    engine = request.app[STATE_KEY].engine
    capabilities = engine.capabilities
    if capabilities.preset_voices:
        try:
            return Voice(engine.resolve_voice(name))
        except InvalidRequest:
            return None
    if capabilities.voice_cloning:
        clone = await saved_clone(request, name)
        if clone is not None:
            return Voice(name, clone)
        own = name.strip().lower() in {voice.lower() for voice in capabilities.voices}
        return Voice(engine.resolve_voice(name), needs_reference=True) if own else None
    return Voice(engine.resolve_voice(name))


def voice_choices(engine: SynthesisEngine) -> str:
    """What a client may name instead of a voice that does not exist, for error messages."""
    capabilities = engine.capabilities
    if capabilities.preset_voices:
        names = sorted(set(capabilities.voices) | set(capabilities.voice_aliases))
        return f"use one of {', '.join(names)} (GET /v1/voices) or a saved voice"
    return "use a saved voice (POST /v1/audio/voices uploads one)"


async def saved_clone(request: web.Request, voice: str) -> VoiceClone | None:
    """The clone of the caller's saved voice named ``voice`` (WebSocket sessions: ``session.config``
    voice), else None: another key's voice is no voice. Raises StoreUnavailable while a shared
    store's database is down."""
    return await scoped_clone(request.app, voice, voice_scope(request))


async def scoped_clone(app: web.Application, voice: str, scope: VoiceScope) -> VoiceClone | None:
    """The clone of the saved voice ``voice`` as ``scope`` sees it (jobs: :func:`job_voice_scope`)."""
    store = app.get(VOICE_STORE_KEY)
    saved = None
    for owner in scope.lookup() if store is not None else ():
        if (saved := await store.get(voice, owner)) is not None:
            break
    if saved is None:
        return None
    if not saved.ref_text:
        return VoiceClone(saved.xvector, key=saved.audio_sha256)
    return VoiceClone(saved.xvector, saved.codes, saved.ref_text, key=saved.audio_sha256)


__all__ = ["VOICE_STORE_KEY", "Voice", "VoiceScope", "audio_error", "content_key", "decode_base64_audio",
           "features_of", "find_voice", "inline_clone", "job_voice_scope", "saved_clone", "scoped_clone", "voice_choices",
           "voice_for", "voice_scope"]
