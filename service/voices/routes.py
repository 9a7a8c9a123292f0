"""Voice cloning at the service boundary: reference audio in, a request's ``clone`` out, and
the saved-voice routes (vllm-omni's ``/v1/audio/voices``).

* ``ref_audio`` (base64, a ``data:`` URL, or an ``http(s)://`` / ``file://`` URL under
  ``--ref-audio-url-prefixes``: service/voices/fetch.py) -> float32 mono 24 kHz by
  :func:`service.voices.decoder_pool.decode_reference` (allowed containers only, in a worker
  process), refused with a 4xx naming the problem when it is not allowed or decodable, empty,
  silent, shorter than 1 s, longer than ``--max-ref-audio-seconds`` or larger than
  ``--max-ref-audio-mb``.
* :func:`clone_for` - a speech body's voice prompt: inline ``ref_audio`` first (it wins over a
  ``voice`` that names no saved voice, as vllm-omni clients send ``voice: "vivian"`` with it),
  else a saved voice named by ``voice``. Features come from ``engine.voice_features`` (computed
  once per content, off the event loop) or from the store.
* ``POST /v1/audio/voices`` (multipart ``audio_sample``, ``name``, optional ``ref_text``,
  ``consent``, ``speaker_description``) computes and stores the x-vector and reference codes;
  ``GET /v1/audio/voices`` lists built-in speakers and uploaded voices;
  ``DELETE /v1/audio/voices/{name}``. Storage: :mod:`service.voices.store` (``--data-dir``, or the
  jobs' PostgreSQL with ``--jobs-db``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging

import aiohttp
import numpy as np
from aiohttp import web

from engines.contract import SAMPLE_RATE, InvalidRequest, SynthesisEngine, VoiceClone
from service.errors import ApiError, engine_error
from service.state import STATE_KEY
from service.synthesis.schema import CloneFields
from service.voices.decoder_pool import decode_reference, reference_audio
from service.voices.fetch import fetch_reference, is_url
from service.voices.store import NAME_RULE, SavedVoice, VoiceExists, VoiceStore

log = logging.getLogger("streamvox.voices")

VOICE_STORE_KEY: web.AppKey[VoiceStore] = web.AppKey("voice_store", VoiceStore)
MAX_NAME_FIELD_BYTES = 4096


def _bad(field: str, message: str, code: str = "invalid_audio", status: int = 400) -> ApiError:
    return ApiError(status, code, f"{field}: {message}")


def decode_base64_audio(value: str, max_bytes: int, field: str = "ref_audio") -> bytes:
    """Base64 or a ``data:[mime];base64,`` URL -> bytes (other URLs: service/voices/fetch.py)."""
    text = value.strip()
    if text[:5].lower() == "data:":
        header, sep, text = text.partition(",")
        if not sep or ";base64" not in header.lower():
            raise _bad(field, "a data: URL must be base64 encoded (data:audio/wav;base64,...)", code="invalid_field")
    if len(text) * 3 // 4 > max_bytes:
        raise _bad(field, f"more than {max_bytes // (1 << 20)} MiB of audio", code="ref_audio_too_large", status=413)
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise _bad(field, "not valid base64", code="invalid_field") from None
    return data


async def features_of(engine: SynthesisEngine, audio: np.ndarray, field: str = "ref_audio"):
    """The engine's features of a reference (off the event loop); 400 when it cannot clone."""
    try:
        return await asyncio.to_thread(engine.voice_features, audio)
    except InvalidRequest as exc:
        raise engine_error(exc) from None


def _content_key(audio: np.ndarray) -> str:
    return hashlib.sha256(audio.tobytes()).hexdigest()


async def clone_for(request: web.Request, voice: str, fields: CloneFields) -> VoiceClone | None:
    """The ``clone`` a speech body or WebSocket ``session.config`` asks for (see the module
    docstring): inline ``fields.ref_audio``, else the saved voice named ``voice``; None when
    neither names one."""
    state = request.app[STATE_KEY]
    settings = state.settings
    x_only = bool(fields.x_vector_only_mode)
    if fields.ref_audio is not None:
        max_bytes = int(settings.max_ref_audio_mb * (1 << 20))
        if is_url(fields.ref_audio):  # only under the operator's prefixes (--ref-audio-url-prefixes)
            data = await fetch_reference(fields.ref_audio, settings.ref_audio_url_prefixes, max_bytes)
        else:
            data = decode_base64_audio(fields.ref_audio, max_bytes)
        audio = await decode_reference(data, settings.max_ref_audio_seconds)
        if not x_only and not (fields.ref_text or "").strip():
            raise ApiError(400, "invalid_field", "ref_text: in-context cloning needs the transcript of ref_audio "
                                                 "(or x_vector_only_mode: true)")
        features = await features_of(state.engine, audio)
        if x_only:
            return VoiceClone(features.xvector, key=_content_key(audio))
        return VoiceClone(features.xvector, features.codes, fields.ref_text, key=_content_key(audio))
    clone = await saved_clone(request.app, voice)
    if clone is None:
        if state.engine.capabilities.task_type == "Base" and voice.strip().lower() != "default":
            raise ApiError(400, "invalid_field", f"voice: no saved voice named {voice[:64]!r}; upload one "
                                                 "with POST /v1/audio/voices or send ref_audio")
        return None
    return VoiceClone(clone.xvector, key=clone.key) if x_only else clone


async def saved_clone(app: web.Application, voice: str) -> VoiceClone | None:
    """The clone of a saved voice named ``voice`` (WebSocket sessions: ``session.config`` voice), else None.
    Raises StoreUnavailable while a shared store's database is down."""
    store = app.get(VOICE_STORE_KEY)
    saved = await store.get(voice) if store is not None else None
    if saved is None:
        return None
    if not saved.ref_text:
        return VoiceClone(saved.xvector, key=saved.audio_sha256)
    return VoiceClone(saved.xvector, saved.codes, saved.ref_text, key=saved.audio_sha256)


# --------------------------------------------------------------------------- routes


async def _form(request: web.Request, max_bytes: int) -> tuple[dict[str, str], bytes | None]:
    """The multipart fields (text) and the ``audio_sample`` file, bounded in size."""
    fields: dict[str, str] = {}
    audio: bytes | None = None
    try:
        reader = await request.multipart()
    except (AssertionError, ValueError, KeyError):
        raise ApiError(400, "invalid_form", "send multipart/form-data with audio_sample and name") from None
    try:
        while (part := await reader.next()) is not None:
            if not isinstance(part, aiohttp.BodyPartReader) or not part.name:
                continue
            limit = max_bytes if part.name == "audio_sample" else MAX_NAME_FIELD_BYTES
            data = bytearray()
            while chunk := await part.read_chunk(64 * 1024):
                data += chunk
                if len(data) > limit:
                    if part.name == "audio_sample":
                        raise _bad("audio_sample", f"more than {max_bytes // (1 << 20)} MiB",
                                   code="ref_audio_too_large", status=413)
                    raise ApiError(400, "invalid_field", f"{part.name}: longer than {limit} bytes")
            if part.name == "audio_sample":
                audio = bytes(data)
            else:
                try:
                    fields[part.name] = data.decode("utf-8")
                except UnicodeDecodeError:
                    raise ApiError(400, "invalid_field", f"{part.name}: not UTF-8 text") from None
    except ValueError as exc:
        raise ApiError(400, "invalid_form", f"malformed multipart body ({exc})") from None
    return fields, audio


async def create_voice(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.check_admission()
    settings = state.settings
    max_bytes = int(settings.max_ref_audio_mb * (1 << 20))
    # Streamed multipart parts, each bounded by _form (the JSON body limit does not apply here).
    fields, data = await _form(request, max_bytes)
    store = request.app[VOICE_STORE_KEY]
    name = fields.get("name", "").strip()
    if not store.valid_name(name):
        raise ApiError(400, "invalid_field", f"name: {NAME_RULE}")
    if data is None:
        raise ApiError(400, "invalid_field", "audio_sample: missing (a multipart file field)")
    builtin = {v.lower() for v in state.engine.info.voices} | {a.lower() for a in state.engine.info.voice_aliases}
    if name.lower() in builtin or await store.get(name) is not None:
        raise ApiError(409, "voice_exists", f"name: a voice named {name!r} exists already")
    audio = await decode_reference(data, settings.max_ref_audio_seconds, field="audio_sample")
    features = await features_of(state.engine, audio, field="audio_sample")
    ref_text = fields.get("ref_text", "").strip() or None
    voice = SavedVoice(name=name, xvector=features.xvector, codes=features.codes, ref_text=ref_text,
                       consent=fields.get("consent") or None,
                       speaker_description=fields.get("speaker_description") or None,
                       audio_sha256=_content_key(audio), seconds=audio.size / SAMPLE_RATE)
    try:
        await store.add(voice)
    except VoiceExists:
        raise ApiError(409, "voice_exists", f"name: a voice named {name!r} exists already") from None
    log.info("voice %r saved: %.1f s, %d reference frames, in-context=%s", name, voice.seconds,
             voice.codes.shape[0], bool(ref_text))
    return web.json_response({"success": True, "voice": voice.describe()}, status=201)


async def list_voices(request: web.Request) -> web.Response:
    engine = request.app[STATE_KEY].engine
    builtin = list(engine.info.voices) if engine.capabilities.preset_voices else []
    uploaded = await request.app[VOICE_STORE_KEY].list()
    return web.json_response({"voices": builtin, "uploaded_voices": [v.describe() for v in uploaded]})


async def delete_voice(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if not await request.app[VOICE_STORE_KEY].delete(name):
        raise ApiError(404, "voice_not_found", f"no saved voice named {name[:64]!r}")
    return web.json_response({"success": True, "name": name, "deleted": True})


def add_routes(app: web.Application, store: VoiceStore) -> None:
    app[VOICE_STORE_KEY] = store
    app.router.add_get("/v1/audio/voices", list_voices)
    app.router.add_post("/v1/audio/voices", create_voice)
    app.router.add_delete("/v1/audio/voices/{name}", delete_voice)


__all__ = ["VOICE_STORE_KEY", "add_routes", "clone_for", "decode_base64_audio", "reference_audio", "saved_clone"]
