"""The service on a real TCP socket of 127.0.0.1 (an ephemeral port), in this process: what
tests and benchmarks start a server with.

    live = await start_server(engine, data_dir, api_keys=("k",))   # any Settings field
    ... live.url, live.ws_url, live.state ...
    await live.stop()
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web


class LiveServer:
    def __init__(self, runner: web.AppRunner, app: web.Application, tls: bool = False):
        self.runner = runner
        self.app = app
        host, port = runner.addresses[0][:2]
        self.host, self.port = host, port
        self.url = f"{'https' if tls else 'http'}://{host}:{port}"
        self.ws_url = f"{'wss' if tls else 'ws'}://{host}:{port}/v1/stream"

    @property
    def state(self):
        from service.state import STATE_KEY

        return self.app[STATE_KEY]

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_server(engine, data_dir: Path, ssl_context=None, **overrides) -> LiveServer:
    """``ssl_context``: serve https / wss with it (TLS terminated by aiohttp, as a proxy would)."""
    from service.app import (
        create_app,  # imported here so other suites never depend on service/
    )
    from service.settings import Settings

    assert set(overrides) <= set(Settings.model_fields), f"no such settings: {set(overrides) - set(Settings.model_fields)}"
    settings = Settings(host="127.0.0.1", port=0, preset="tiny", device="cpu",
                        data_dir=data_dir).model_copy(update=overrides)
    app = create_app(settings, engine)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, settings.host, 0, ssl_context=ssl_context).start()
    return LiveServer(runner, app, tls=ssl_context is not None)
