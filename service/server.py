"""Run the service: build and start the engine, serve HTTP, drain on SIGTERM.

Shutdown order on SIGTERM / SIGINT: /readyz turns 503 and admission stops at once;
in-flight streams get ``drain_seconds`` to finish, then end with an ``error`` of code
``shutting_down``; running jobs go back to ``queued``; the engine stops; exit 0.
If the engine's worker dies, the process exits 1 so the orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import socket
import sys

from aiohttp import web

from service.errors import error_body
from service.settings import Settings

log = logging.getLogger("streamvox.server")

WATCHDOG_SECONDS = 1.0
EXIT_WORKER_DIED = 1
# How long a thread holding the GIL keeps it while another waits (Python's default: 5 ms). On
# asyncio's own loop the loop gives up the GIL at every socket call and must win it back from the
# engine's and the planners' threads each time: with hundreds of sockets a turn, 5 ms a time made
# the loop 300-400 ms late under every attack at once; 0.5 ms, 120-220 ms (benchmarks/RESULTS.md),
# at no measurable cost to the talker's step. uvloop (the default loop) keeps the GIL through its
# socket calls; it still waits for it after each poll and for each callback a thread hands over.
GIL_SWITCH_INTERVAL_S = 0.0005


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """Log lines to stderr, written by a thread of their own; what a client sent cannot forge a
    line, repeated errors cannot flood (service/http/log_safety.py)."""
    from service.http.log_safety import queued_writer

    root = logging.getLogger()
    if root.handlers:  # configured already (an embedding program's own): leave it
        return
    root.setLevel(level.upper())
    root.addHandler(queued_writer(sys.stderr, LOG_FORMAT))
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # access lines would carry query strings


class ConnectionGuard:
    """Caps concurrent TCP connections per client address on aiohttp's ``web.Server``.

    aiohttp tells its server of every connection (``connection_made`` /
    ``connection_lost``, before any byte is parsed); the guard wraps those two on the
    instance. A connection over the cap gets a ``503 too_many_connections`` JSON
    response and is closed at once, so silent sockets from one address cannot use up
    the process's file descriptors for everyone else."""

    def __init__(self, server: web.Server, limit: int):
        self.limit = limit
        self.open: dict[str, int] = {}
        self.refused = 0
        self._made, self._lost = server.connection_made, server.connection_lost
        self._addresses: dict[int, str] = {}
        server.connection_made = self.connection_made  # type: ignore[method-assign]
        server.connection_lost = self.connection_lost  # type: ignore[method-assign]

    def connection_made(self, handler, transport: asyncio.Transport) -> None:
        self._made(handler, transport)
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "unknown"
        count = self.open.get(address, 0) + 1
        self.open[address] = count
        self._addresses[id(handler)] = address
        if self.limit and count > self.limit:
            self.refused += 1
            # A warning (the log's repeat filter writes a few a minute, then counts them: a flood
            # is made of refusals).
            log.warning("refusing connections from %s: %d open, the limit is %d (refused so far: %d)",
                        address, count - 1, self.limit, self.refused)
            transport.write(_refusal(self.limit))
            # Closed on the next turn of the loop, once aiohttp has started the connection's
            # handler task: closing it here would end the connection before that task runs,
            # and the task would fail ("Task exception was never retrieved") on every refusal.
            asyncio.get_running_loop().call_soon(handler.force_close)

    def connection_lost(self, handler, exc: BaseException | None = None) -> None:
        address = self._addresses.pop(id(handler), None)
        if address is not None:
            left = self.open.get(address, 1) - 1
            if left > 0:
                self.open[address] = left
            else:
                self.open.pop(address, None)
        self._lost(handler, exc)


def _refusal(limit: int) -> bytes:
    body = json.dumps(error_body("too_many_connections",
                                 f"too many connections from your address (the limit is {limit})")).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + body


class PortUnavailable(OSError):
    """The service's address cannot be bound (in use, no permission, unknown host)."""


def reserve_address(host: str, port: int) -> socket.socket:
    """Bind (not listen on) the service's address before any model loads, so a busy port
    is a one-line error at once, not a traceback after the load. Until ``start_http``
    listens on it, connections are refused rather than left hanging."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PortUnavailable(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers only; never a live listener
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = " (another server is running there: stop it or pick --port)" if exc.errno == 98 else ""
        raise PortUnavailable(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    return sock


async def start_http(app: web.Application, settings: Settings, port: int | None = None,
                     sock: socket.socket | None = None) -> web.AppRunner:
    """Serve ``app`` on ``settings.host``: the slowloris bounds set (keep-alive /
    request-head timeout, per-address connection cap, bounded header lines). The body
    read timeout is the body reader's (:func:`service.http.body.read_body`)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0,
                           keepalive_timeout=settings.http_idle_seconds,
                           # unread body after a response (a 408, a 413) is drained this long, not 10 s
                           lingering_time=min(settings.http_body_seconds, 5.0),
                           max_line_size=8190, max_field_size=8190)
    await runner.setup()
    if runner.server is not None:
        runner.server.connection_guard = ConnectionGuard(runner.server, settings.max_connections_per_address)
    if sock is not None:
        site: web.BaseSite = web.SockSite(runner, sock)
    else:
        site = web.TCPSite(runner, settings.host, settings.port if port is None else port)
    await site.start()
    return runner


def resolve_model(settings: Settings) -> Settings:
    """``settings`` with ``--model`` resolved (engines/checkpoints/hub.py): ``checkpoint_dir``
    is the local directory to load (None: random weights) and ``checkpoint`` the name clients
    see (the default model's id when it was picked). May download; raises ModelUnavailable."""
    from engines.checkpoints.hub import resolve, served_name

    served = resolve(settings.checkpoint)
    return settings.model_copy(update={"checkpoint": served_name(served.name), "checkpoint_dir": served.path})


def check_source(settings: Settings) -> None:
    """ValueError naming the registered pipelines when ``--source`` names none of them (imports
    torch, so only when a source was given: the other fast failures stay fast)."""
    if settings.source is not None:
        from engines.build import check_source as check_registered

        check_registered(settings.source)


def build_engine_for(settings: Settings):
    from engines.build import build_engine

    return build_engine(settings.engine_config())


async def serve(settings: Settings, engine=None, stop: asyncio.Event | None = None,
                listening: asyncio.Future | None = None, sock: socket.socket | None = None) -> int:
    """Serve until a signal (returns 0) or until the engine's worker dies (returns 1).

    Tests may pass their own started ``engine``, a ``stop`` event (instead of signal
    handlers) and a ``listening`` future that receives the bound URL; ``sock`` is the
    address :func:`run` reserved already.
    """
    # the application (and torch, under it) only once there is something to serve: a busy port or
    # an unknown model fails in a fraction of a second
    from service.app import create_app, display_name, speed_note
    from service.state import STATE_KEY, drain

    loop = asyncio.get_running_loop()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    if sock is None:
        sock = reserve_address(settings.host, settings.port)  # PortUnavailable before any model loads
    if engine is None:
        log.info("loading the models (device %s)", settings.device)
        engine = await asyncio.to_thread(build_engine_for, settings)
        await asyncio.to_thread(engine.start)
    info = engine.info
    log.info("engine ready: %s; device=%s quantize=%s codec=%s random weights in: %s",
             display_name(engine, settings.checkpoint), info.device, info.quantize, info.codec_dtype,
             ", ".join(info.random_components) or "none")
    speed = speed_note(info.warmup_rtf)
    if speed:  # measured on CPU only: a person starting a CPU server learns what to expect
        log.info("expected speed on this machine (one request alone, measured after the start-up warm-up, "
                 "quantize=%s, codec %s, threads: %s): %s", info.quantize, info.codec_dtype, info.threads, speed)
    app = create_app(settings, engine)
    # What is loaded now (modules, the models' Python objects) lives as long as the process: frozen,
    # a full collection no longer walks it (one held the event loop 0.2-0.6 s under load). Before
    # the app runs: this collection is no stall of a serving loop
    gc.collect()
    gc.freeze()
    runner = await start_http(app, settings, sock=sock)
    host, port = runner.addresses[0][:2]
    log.info("listening on http://%s:%s (event loop: %s)", host, port, type(loop).__module__.split(".")[0])
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


def raise_open_file_limit() -> None:
    """Soft open-file limit up to the hard one (no privilege needed): every connection is
    a file descriptor, and a soft 1,024 (or 256) would let idle sockets starve the rest.
    The hard limit is the container's (compose ``ulimits``, the runtime's default on K8s)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        log.info("open-file limit: %d (hard %s)", resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
    except (ImportError, ValueError, OSError) as exc:  # not on every OS; never fatal
        log.warning("could not raise the open-file limit: %s", exc)


M_ARENA_MAX = -8  # glibc mallopt parameter
MALLOC_ARENAS = 2


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> None:
    """glibc gives every thread that allocates its own malloc arena (up to 8 per core), and an
    arena keeps what it once held: whole-sentence encodes and reference decodes on executor
    threads then grow the server's RSS with every large request (a soak with 100 s mp3
    sentences: +230 MiB in 2 minutes and still rising; with 2 arenas it stays at the working
    set, +120 MiB, flat). ``MALLOC_ARENA_MAX`` in the environment still wins; no-op off glibc."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        if libc.mallopt(M_ARENA_MAX, arenas) != 1:
            log.warning("could not limit malloc arenas (mallopt refused)")
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to limit
        pass


def run(settings: Settings) -> int:
    configure_logging(settings.log_level)
    raise_open_file_limit()
    limit_malloc_arenas()
    try:
        sock = reserve_address(settings.host, settings.port)  # a busy port fails before any download
    except PortUnavailable as exc:
        print(f"streamvox serve: {exc}", file=sys.stderr)  # one line, no traceback
        return 2
    try:
        check_source(settings)  # an unknown --source fails before a download
        # Before the event loop, in the main thread: a download can take minutes, and SIGTERM
        # must end it at once (the graceful-drain handler is installed only once serving).
        settings = resolve_model(settings)
    except ValueError as exc:  # ModelUnavailable is one too
        sock.close()
        print(f"streamvox serve: {exc}", file=sys.stderr)  # one line: unknown id, gated, offline, unknown pipeline...
        return 2
    with asyncio.Runner(loop_factory=event_loop_factory(settings.event_loop)) as runner:
        return runner.run(serve(settings, sock=sock))


def event_loop_factory(name: str):
    """``--event-loop``'s loop: uvloop's, or None (asyncio's own)."""
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None
