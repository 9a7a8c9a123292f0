"""The saved-voice routes (vllm-omni's ``/v1/audio/voices``).

``POST /v1/audio/voices`` (multipart ``audio_sample``, ``name``, optional ``ref_text``,
``consent``, ``speaker_description``) computes and stores the x-vector and reference codes;
``GET /v1/audio/voices`` lists built-in speakers and uploaded voices, a page at a time
(``?limit=``, ``?after=``); ``DELETE /v1/audio/voices/{name}``. Storage:
:mod:`service.voices.store` (``--data-dir``) or :mod:`service.voices.store_postgres` (``--jobs-db``).
How a request uses a saved voice (or inline ``ref_audio``) is :mod:`service.voices.clones`.

Saved voices belong to their key, as jobs do (:class:`~service.voices.clones.VoiceScope`): with
keys on, a key lists, uses and deletes only its own voices (another key's voice does not exist
for it: 404), names are unique per key, admin keys (``admin.``) list every key's and may use or
delete the unowned ones (saved before voices had owners). With auth off there is one namespace,
as before. Uploads and deletes take a ``--rate-limit`` token like every other write; uploads are
capped per key (``--max-voices-per-key``) and in total (``--max-voices``).
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from engines.contract import SAMPLE_RATE
from service.access.limits import client_identity
from service.errors import ApiError, invalid_field, reading_body
from service.state import STATE_KEY
from service.synthesis.numbers import whole_number
from service.voices.clones import VOICE_STORE_KEY, VoiceScope, audio_error, content_key, features_of, voice_scope
from service.voices.decoder_pool import decode_reference
from service.voices.store import NAME_RULE, SavedVoice, VoiceExists, VoiceLimitReached, VoiceStore, limit_message

log = logging.getLogger("streamvox.voices")

MAX_NAME_FIELD_BYTES = 4096
DEFAULT_VOICE_PAGE = 100
TOO_MANY_VOICES_RETRY_SECONDS = 60  # a cap frees up only when voices are deleted



async def _form(request: web.Request, max_bytes: int, timeout_s: float) -> tuple[dict[str, str], bytes | None]:
    """The multipart fields (text) and the ``audio_sample`` file, bounded in size, read as every
    body is (:func:`service.errors.reading_body`: within ``timeout_s``, undecodable bytes a 400)."""
    fields: dict[str, str] = {}
    audio: bytes | None = None
    try:
        reader = await request.multipart()
    except (AssertionError, ValueError, KeyError):
        raise ApiError(400, "invalid_form", "send multipart/form-data with audio_sample and name") from None
    try:
        async with reading_body(request, timeout_s):
            while (part := await reader.next()) is not None:
                if not isinstance(part, aiohttp.BodyPartReader) or not part.name:
                    continue
                limit = max_bytes if part.name == "audio_sample" else MAX_NAME_FIELD_BYTES
                data = bytearray()
                while chunk := await part.read_chunk(64 * 1024):
                    data += chunk
                    if len(data) > limit:
                        if part.name == "audio_sample":
                            raise audio_error("audio_sample", f"more than {max_bytes // (1 << 20)} MiB",
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
    scope = voice_scope(request)
    state.limits.check_rate(client_identity(request, state.api_keys))  # a write, before any byte is read
    settings = state.settings
    max_per_key = settings.max_voices_per_key if state.api_keys.enabled else 0  # one namespace with auth off
    store = request.app[VOICE_STORE_KEY]
    await _check_voice_caps(store, scope, max_per_key, settings.max_voices)  # cheap: before decoding
    max_bytes = int(settings.max_ref_audio_mb * (1 << 20))
    # Streamed multipart parts, each bounded by _form (the JSON body limit does not apply here).
    fields, data = await _form(request, max_bytes, settings.http_body_seconds)
    name = fields.get("name", "").strip()
    if not store.valid_name(name):
        raise ApiError(400, "invalid_field", f"name: {NAME_RULE}")
    if data is None:
        raise ApiError(400, "invalid_field", "audio_sample: missing (a multipart file field)")
    builtin = {v.lower() for v in state.engine.info.voices} | {a.lower() for a in state.engine.info.voice_aliases}
    if name.lower() in builtin or await store.get(name, scope.owner) is not None:
        raise ApiError(409, "voice_exists", f"name: a voice named {name!r} exists already")
    audio = await decode_reference(data, settings.max_ref_audio_seconds, field="audio_sample")
    features = await features_of(state.engine, audio, field="audio_sample")
    ref_text = fields.get("ref_text", "").strip() or None
    voice = SavedVoice(name=name, xvector=features.xvector, codes=features.codes, ref_text=ref_text,
                       consent=fields.get("consent") or None,
                       speaker_description=fields.get("speaker_description") or None,
                       audio_sha256=content_key(audio), seconds=audio.size / SAMPLE_RATE, owner=scope.owner)
    try:
        await store.add(voice, max_per_owner=max_per_key, max_total=settings.max_voices)
    except VoiceExists:
        raise ApiError(409, "voice_exists", f"name: a voice named {name!r} exists already") from None
    except VoiceLimitReached as exc:
        raise _too_many_voices(str(exc)) from None
    log.info("voice %r saved: %.1f s, %d reference frames, in-context=%s", name, voice.seconds,
             voice.codes.shape[0], bool(ref_text))
    return web.json_response({"success": True, "voice": voice.describe()}, status=201)


def _too_many_voices(message: str) -> ApiError:
    return ApiError(429, "too_many_voices", message, headers={"Retry-After": str(TOO_MANY_VOICES_RETRY_SECONDS)})


async def _check_voice_caps(store: VoiceStore, scope: VoiceScope, max_per_key: int, max_total: int) -> None:
    """429 ``too_many_voices`` when the key's or the store's cap is reached (checked again,
    atomically, when the voice is added)."""
    if max_per_key and (held := await store.count(scope.owner)) >= max_per_key:
        raise _too_many_voices(limit_message(held, max_per_key, "this key has"))
    if max_total and (held := await store.count(any_owner=True)) >= max_total:
        raise _too_many_voices(limit_message(held, max_total, "the server holds"))


def _page_limit(request: web.Request, largest: int) -> int:
    raw = request.query.get("limit", str(min(DEFAULT_VOICE_PAGE, largest)))
    limit = whole_number(raw)
    if limit is None:
        raise invalid_field("limit", "must be an integer")
    if not 1 <= limit <= largest:
        raise invalid_field("limit", f"must be between 1 and {largest} (--max-voice-page)")
    return limit


async def list_voices(request: web.Request) -> web.Response:
    """Built-in speakers and one page of the caller's saved voices (every key's for an admin
    key, each then with its ``owner``); ``next_after`` is the next page's ``?after=`` (null: the last)."""
    state = request.app[STATE_KEY]
    engine = state.engine
    scope = voice_scope(request)
    limit = _page_limit(request, state.settings.max_voice_page)
    after = request.query.get("after") or None
    if after is not None and len(after) > 2 * MAX_NAME_FIELD_BYTES:
        raise invalid_field("after", "not a cursor this server gave")
    builtin = list(engine.info.voices) if engine.capabilities.preset_voices else []
    page = await request.app[VOICE_STORE_KEY].list(scope.owner, any_owner=scope.sees_all, limit=limit, after=after)
    show_owner = scope.sees_all and state.api_keys.enabled
    uploaded = [{**v.describe(), "owner": v.owner} if show_owner else v.describe() for v in page.voices]
    return web.json_response({"voices": builtin, "uploaded_voices": uploaded, "next_after": page.next_after})


async def delete_voice(request: web.Request) -> web.Response:
    """The caller's voice of that name (an admin key: its own, else the unowned one, or another
    key's named by ``?owner=``, as the admin listing shows it)."""
    state = request.app[STATE_KEY]
    name = request.match_info["name"]
    scope = voice_scope(request)
    state.limits.check_rate(client_identity(request, state.api_keys))
    store = request.app[VOICE_STORE_KEY]
    owners = scope.lookup()
    if scope.sees_all and state.api_keys.enabled and "owner" in request.query:
        owners = (request.query["owner"] or None,)
    for owner in owners:
        if await store.delete(name, owner):
            return web.json_response({"success": True, "name": name, "deleted": True})
    raise ApiError(404, "voice_not_found", f"no saved voice named {name[:64]!r}")


def add_routes(app: web.Application, store: VoiceStore) -> None:
    app[VOICE_STORE_KEY] = store
    app.router.add_get("/v1/audio/voices", list_voices)
    app.router.add_post("/v1/audio/voices", create_voice)
    app.router.add_delete("/v1/audio/voices/{name}", delete_voice)


__all__ = ["add_routes"]
