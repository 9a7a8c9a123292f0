"""Run the service: build and start the engine, serve HTTP, drain on SIGTERM.

Shutdown order on SIGTERM / SIGINT: /readyz turns 503 and admission stops at once;
in-flight streams get ``drain_seconds`` to finish, then end with an ``error`` of code
``shutting_down``; running jobs go back to ``queued``; the engine stops; exit 0.
If the engine's worker dies, the process exits 1 so the orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web

from .app import create_app
from .settings import Settings
from .state import STATE_KEY, drain

log = logging.getLogger("streamvox.server")

WATCHDOG_SECONDS = 1.0
EXIT_WORKER_DIED = 1


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # access lines would carry query strings


def build_engine_for(settings: Settings):
    from engines.build import DTYPES, build_engine

    return build_engine(preset=settings.preset, device=settings.device, checkpoint=settings.checkpoint,
                        seed=settings.seed, max_queue=settings.max_queue, source=settings.source,
                        backend=settings.backend, artifacts_dir=settings.artifacts_dir,
                        max_slots=settings.max_slots, dtype=DTYPES.get(settings.dtype))


async def serve(settings: Settings, engine=None, stop: asyncio.Event | None = None,
                listening: asyncio.Future | None = None) -> int:
    """Serve until a signal (returns 0) or until the engine's worker dies (returns 1).

    Tests may pass their own started ``engine``, a ``stop`` event (instead of signal
    handlers) and a ``listening`` future that receives the bound URL.
    """
    loop = asyncio.get_running_loop()
    if engine is None:
        engine = await asyncio.to_thread(build_engine_for, settings)
        await asyncio.to_thread(engine.start)
    info = engine.info
    log.info("engine ready: preset=%s device=%s random weights in: %s", info.preset, info.device,
             ", ".join(info.random_components) or "none")
    app = create_app(settings, engine)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    log.info("listening on http://%s:%s", host, port)
    if listening is not None:
        listening.set_result(f"http://{host}:{port}")

    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    exit_code = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=WATCHDOG_SECONDS)
        except asyncio.TimeoutError:
            if not engine.stats().alive:
                log.error("the engine worker died (%s); exiting for a restart", engine.stats().error)
                exit_code = EXIT_WORKER_DIED
                break

    log.info("draining: admission stopped, up to %.1f s for in-flight streams", settings.drain_seconds)
    await drain(app[STATE_KEY], settings.drain_seconds if exit_code == 0 else 0.0)
    await runner.cleanup()  # stops the job runner (running jobs back to queued)
    await asyncio.to_thread(engine.stop)
    log.info("stopped")
    return exit_code


def run(settings: Settings) -> int:
    configure_logging(settings.log_level)
    return asyncio.run(serve(settings))
