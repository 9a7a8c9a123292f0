"""The aiohttp application: one port for HTTP and WebSocket.

``create_app(settings, engine)`` wires routes and middleware around an engine that the
caller has already started (``service.server`` in production, fixtures in tests).
"""

from __future__ import annotations

import asyncio
import os

from aiohttp import web

from engines.contract import EngineCapabilities, SynthesisEngine
from service.http import playground
from service.http.middleware import (
    FOREIGN_APIS,
    access_log_middleware,
    auth_middleware,
    cors_middleware,
    error_middleware,
    on_response_prepare,
    request_id_middleware,
)
from service.jobs import captions as job_captions
from service.jobs import routes as jobs
from service.jobs.store import make_job_store
from service.metrics import CONTENT_TYPE
from service.rest import speech
from service.settings import Settings
from service.speed import real_time_words
from service.state import STATE_KEY, AppState
from service.synthesis.params import public_model_name, served_model_names
from service.voices import routes as saved_voices
from service.ws import omni as omni_stream
from service.ws import session as ws
from service.ws.dialects import cartesia, cartesia_http, deepgram, deepgram_http, elevenlabs, elevenlabs_http


async def watching_the_event_loop(app: web.Application):
    """The event loop's lag measured while the app runs (streamvox_event_loop_lag_seconds)."""
    watch = asyncio.create_task(app[STATE_KEY].metrics.watch_event_loop())
    yield
    watch.cancel()


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    stats = state.engine.stats()
    # not ready while the job store is unreachable, unless the caller asks about
    # streaming only (?jobs=optional: the Kubernetes readiness probe, so that a database outage
    # does not take streaming out of the Service)
    jobs_db = await jobs.store_health(state)
    ready = state.ready() and (jobs_db["reachable"] or request.query.get("jobs") == "optional")
    state.metrics.ready.set(1 if ready else 0)
    body = {"ready": ready, "draining": state.draining, "engine": {"alive": stats.alive, "ready": stats.ready,
                                                                    "error": stats.error}, "jobs_db": jobs_db}
    return web.json_response(body, status=200 if ready else 503)


def release_of(caps: EngineCapabilities) -> str:
    """What kind of model is loaded: the Qwen3-TTS talker release's task type (``CustomVoice``,
    ``Base``, ``VoiceDesign``), else the pipeline (``dit``: a streamvox DiT preset)."""
    return caps.task_type or caps.pipeline


def display_name(engine: SynthesisEngine, checkpoint: str | None) -> str:
    """A person's name for the loaded model: the checkpoint's directory where one was named and
    names it (the DiT's preset names random weights, not a checkpoint), else the pipeline and its
    preset."""
    caps = engine.capabilities
    if checkpoint and not caps.named_by_preset:
        return os.path.basename(os.path.normpath(checkpoint))
    return f"streamvox {caps.title or caps.pipeline + ' pipeline'}, preset {engine.info.preset}"


def controls(caps: EngineCapabilities) -> dict[str, bool]:
    """Which request fields change this model's output (the playground shows only these)."""
    return {"voice": caps.preset_voices,  # Base/VoiceDesign have no presets
            "instructions": caps.instructions,
            "voice_cloning": caps.voice_cloning,
            "sampling": caps.honours("repetition_penalty"),  # temperature, top_k, top_p, repetition_penalty, greedy
            "language": caps.languages is not None,  # the DiT's byte frontend reads any language
            "steps": caps.honours("steps"), "guidance_scale": caps.honours("guidance_scale")}


def speed_note(rtf: float | None) -> str | None:
    """The measured real-time factor (wall seconds per audio second, warm) in words."""
    if not rtf:
        return None
    note = real_time_words(rtf)
    if rtf > 1:
        note += "; streamed audio will have gaps - use whole-file speech (stream: false) or jobs"
    return note


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    info, caps = state.engine.info, state.engine.capabilities
    rtf = info.warmup_rtf
    model = {
        "id": "streamvox", "object": "model", "owned_by": "streamvox",
        "engine_model": info.model, "preset": info.preset, "source": info.source, "device": info.device,
        "dtype": info.dtype, "quantize": info.quantize, "codec_dtype": info.codec_dtype, "sample_rate": info.sample_rate, "random_components": list(info.random_components),
        "random_weights": bool(info.random_components), "voices": list(info.voices), "max_queue": info.max_queue,
        # the engine as served: dit | talker, requests batched together at most, the DiT/decoder runtime
        "pipeline": info.pipeline, "slots": info.slots, "backend": info.backend or state.settings.backend,
        "names": list(served_model_names(state.settings.checkpoint)),  # what a speech request's `model` may be
        # what the loaded Qwen3-TTS release can do (task_type None: the DiT pipeline)
        "task_types": [caps.task_type] if caps.task_type else [],
        "instructions": caps.instructions,
        "voice_cloning": caps.voice_cloning,
        # word timestamps (a forced aligner loaded with --aligner): whether, with what, for which languages
        "timestamps": {"available": caps.timestamps, "aligner": public_model_name(caps.aligner),
                       "languages": list(caps.timestamp_languages)},
        # what the playground shows: the model's name and release, the fields it uses
        "display_name": display_name(state.engine, state.settings.checkpoint), "release": release_of(caps),
        "controls": controls(caps),
        # what a request without sampling fields gets (the checkpoint's generation_config.json; null: the DiT)
        "sampling_defaults": dict(caps.sampling_defaults) if caps.sampling_defaults is not None else None,
        # measured at start on CPU (a request alone, after the warm-up): wall seconds per audio second
        "expected_rtf": rtf, "speed": speed_note(rtf),
    }
    return web.json_response({"object": "list", "data": [model]})


async def voices(request: web.Request) -> web.Response:
    info = request.app[STATE_KEY].engine.info
    return web.json_response({"voices": list(info.voices), "aliases": dict(info.voice_aliases), "default": "default"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.metrics.ready.set(1 if state.ready() else 0)
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def create_app(settings: Settings, engine: SynthesisEngine) -> web.Application:
    middlewares = [request_id_middleware, access_log_middleware, error_middleware]
    if settings.cors_origins:
        middlewares.append(cors_middleware(settings.cors_origins))
    middlewares.append(auth_middleware)
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    state = AppState(settings, engine)
    engine.add_tick_listener(state.metrics.on_tick)
    app[STATE_KEY] = state
    app.on_response_prepare.append(on_response_prepare)
    app.cleanup_ctx.append(watching_the_event_loop)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/voices", voices)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/audio/speech", speech.create_speech)
    app.router.add_get("/v1/stream", ws.stream_session)
    app.router.add_get(omni_stream.ENDPOINT, omni_stream.speech_stream)  # vllm-omni's dialect
    # voice-agent services' sockets and HTTP speech, under their own prefixes with their own keys and errors
    for dialect in (elevenlabs, elevenlabs_http, cartesia, cartesia_http, deepgram, deepgram_http):
        dialect.add_routes(app)
    app[FOREIGN_APIS] = (elevenlabs_http.API, cartesia_http.API, deepgram_http.API)
    playground.add_routes(app)
    job_store = make_job_store(settings)  # SQLite under --data-dir, or the shared PostgreSQL (--jobs-db)
    jobs.add_routes(app, job_store)
    job_captions.add_routes(app)  # word timestamps of finished jobs
    saved_voices.add_routes(app, job_store.voice_store(settings.data_dir))  # saved voices, same store
    return app
