"""ElevenLabs' ``POST /v1/text-to-speech/{voice_id}/stream``: the whole text in one body
``{"text", "model_id"?, "voice_settings"?}``, the audio streamed back as it is generated in
the ``output_format`` of the query (as the sockets: ``pcm_<rate>``, ``mp3_<rate>_<kbps>``,
``ulaw_8000``). ``/stream/with-timestamps`` streams newline-separated JSON objects
``{"audio_base64", "alignment": null, "normalized_alignment": null}``; with an aligner loaded
(``--aligner``) a last object ``{"audio_base64": "", "alignment", "normalized_alignment"}``
carries ElevenLabs' HTTP timing shape ``{characters, character_start_times_seconds,
character_end_times_seconds}`` of the whole text (without one: null, no invented times). Errors are ElevenLabs' ``{"detail": {"status", "message"}}``; keys as the sockets."""

from __future__ import annotations

import base64
import json

from aiohttp import web

from engines.contract import Priority
from service.access.auth import ACCEPTED_KEY
from service.access.limits import client_identity
from service.errors import ApiError
from service.http.body import read_json_object
from service.state import REQUEST_ID, STATE_KEY
from service.synthesis.params import check_work, parse, resolve_voice
from service.synthesis.schema import SpeechText, SynthesisParams
from service.synthesis.submit import open_stream, prepare
from service.synthesis.timestamps import char_times
from service.voices.routes import saved_clone
from service.ws.dialects.common import known_voice, voice_list
from service.ws.dialects.elevenlabs import DEFAULT_FORMAT, elevenlabs_key, parse_output_format, speed_of
from service.ws.dialects.wire_audio import WireEncoder

CONTENT_TYPES = {"pcm_s16le": "audio/pcm", "mp3": "audio/mpeg", "pcm_mulaw": "audio/basic"}


def refusal(exc: ApiError) -> web.Response:
    return web.json_response({"detail": {"status": exc.code, "message": exc.message}}, status=exc.status,
                             headers=exc.headers or None)


async def stream(request: web.Request) -> web.StreamResponse:
    try:
        return await _stream(request, timestamps=request.path.endswith("/with-timestamps"))
    except ApiError as exc:
        return refusal(exc)


async def _stream(request: web.Request, timestamps: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    state.check_admission()
    key = elevenlabs_key(request)
    if not state.api_keys.accepts(key):
        raise ApiError(401, "invalid_api_key", "missing or invalid xi-api-key")
    if key:
        request[ACCEPTED_KEY] = key
    identity = client_identity(request, state.api_keys, websocket=True)  # the accepted xi-api-key
    state.limits.check_rate(identity)
    encoding, rate = parse_output_format(request.query.get("output_format", DEFAULT_FORMAT))
    voice = request.match_info["voice_id"]
    if not await known_voice(request, voice):
        raise ApiError(400, "voice_not_found", f"voice_id {voice[:64]!r} is not a voice of this server; "
                                               f"use one of {voice_list(request)} or a saved voice")
    body = await read_json_object(request)
    text = parse(SpeechText, body, max_chars=state.settings.max_input_chars).text  # as every route's
    settings = body.get("voice_settings") or {}
    if not isinstance(settings, dict):
        raise ApiError(400, "invalid_voice_settings", "voice_settings: must be an object")
    try:
        params = resolve_voice(state.engine, SynthesisParams().update({"voice": voice, **speed_of(settings)}))
    except ValueError as exc:
        raise ApiError(400, "invalid_voice_settings", str(exc)) from None
    check_work(state.engine, text, params, state.settings)
    clone = await saved_clone(request, voice)
    prepared = prepare(state.engine, request[REQUEST_ID], text, params, Priority.REALTIME, clone=clone,
                       tenant=identity, timestamps=timestamps)
    state.limits.open_stream(identity)
    chunks = None
    try:
        chunks = open_stream(state, prepared, high_water=state.settings.ws_buffer_chunks)
        response = web.StreamResponse(headers={
            "Content-Type": "application/x-ndjson" if timestamps else CONTENT_TYPES[encoding],
            **state.audio_headers()})
        encoder = WireEncoder(encoding, rate)
        await response.prepare(request)

        async def send(data: bytes) -> None:
            if data:
                await response.write(json.dumps({"audio_base64": base64.b64encode(data).decode(), "alignment": None,
                                                 "normalized_alignment": None}).encode() + b"\n"
                                     if timestamps else data)
        try:
            while True:
                chunk = await chunks.next_chunk()
                await send(encoder.encode(chunk.pcm))
                if chunk.is_final:
                    break
            if not chunk.error:
                await send(encoder.finish())
            if timestamps and chunk.alignment is not None and not chunk.error:
                chars = char_times(chunk.alignment)
                seconds = {"characters": chars["chars"],
                           "character_start_times_seconds": [s / 1000 for s in chars["charStartTimesMs"]],
                           "character_end_times_seconds": [(s + d) / 1000 for s, d in
                                                           zip(chars["charStartTimesMs"], chars["charDurationsMs"])]}
                await response.write(json.dumps({"audio_base64": "", "alignment": seconds,
                                                 "normalized_alignment": seconds}).encode() + b"\n")
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass
        return response
    finally:
        if chunks is not None:
            chunks.cancel()
        state.limits.close_stream(identity)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/text-to-speech/{voice_id}/stream", stream)
    app.router.add_post("/v1/text-to-speech/{voice_id}/stream/with-timestamps", stream)
