"""``GET /`` and ``/playground``: the browser playground, one self-contained page
(``service/http/static/playground.html``: no build step, nothing fetched from elsewhere). It
speaks the WebSocket protocol of ``/v1/stream`` and plays through an AudioWorklet."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

PAGE = Path(__file__).with_name("static") / "playground.html"
PATHS = ("/", "/playground")


async def playground(request: web.Request) -> web.Response:
    # read per request: a small file, and an edited page shows up without a restart
    return web.Response(body=PAGE.read_bytes(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-cache",
                                 # only this origin: the page, its inline script and its own worklet blob
                                 "Content-Security-Policy": "default-src 'self'; script-src 'self' 'unsafe-inline' "
                                 "blob:; style-src 'unsafe-inline'; connect-src 'self' ws: wss:; img-src data:"})


def add_routes(app: web.Application) -> None:
    for path in PATHS:
        app.router.add_get(path, playground)
