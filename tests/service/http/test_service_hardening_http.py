"""HTTP hardening: bad bytes get 4xx JSON (never 5xx), slow or silent sockets are
closed by the read timeouts, one address cannot hold every socket, and a client that
aborts mid-body is not an ``internal_error``. Real server, real clients, raw sockets."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from conftest import metric_value, wait_until

SPEECH = "/v1/audio/speech"


async def start_live(engine, data_dir, **overrides):
    """A server started the way ``service.server.serve`` starts one (its slowloris bounds)."""
    from aiohttp import web

    from service.app import create_app
    from service.settings import Settings

    try:
        from service.server import start_http
    except ImportError:  # the code before the read timeouts: a plain runner, so each test shows what it fixes
        start_http = None
        overrides = {k: v for k, v in overrides.items() if k in Settings.model_fields}
    settings = Settings(host="127.0.0.1", port=0, preset="tiny", device="cpu",
                        data_dir=data_dir).model_copy(update=overrides)
    app = create_app(settings, engine)
    if start_http is not None:
        runner = await start_http(app, settings, port=0)
    else:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, settings.host, 0).start()
    host, port = runner.addresses[0][:2]
    return runner, host, port


@pytest.fixture
async def live(engine, tmp_path):
    runner, host, port = await start_live(engine, tmp_path / "data", http_idle_seconds=1.0, http_body_seconds=1.0,
                                          max_connections_per_address=8)
    yield host, port
    await runner.cleanup()


def url(live, path: str) -> str:
    return f"http://{live[0]}:{live[1]}{path}"


def digits(n: int) -> str:
    return "9" * n


BAD_BODIES = [
    # (body bytes, Content-Type, status, code, a word the message must contain)
    (b"[" * 100_000, "application/json", 400, "invalid_json", "deep"),
    (b"{" * 50_000, "application/json", 400, "invalid_json", ""),
    (('{"input": "Hi.", "seed": ' + digits(5000) + "}").encode(), "application/json", 400, "invalid_field", "seed"),
    (('{"input": "Hi.", "speed": ' + digits(400) + "}").encode(), "application/json", 400, "invalid_field", "speed"),
    (('{"input": "Hi.", "guidance_scale": ' + digits(400) + "}").encode(), "application/json", 400,
     "invalid_field", "guidance_scale"),
    (('{"input": "Hi.", "speed": ' + digits(400) + ".5}").encode(), "application/json", 400, "invalid_field",
     "speed"),
    (('{"input": "Hi.", "steps": -' + digits(400) + "}").encode(), "application/json", 400, "invalid_field",
     "steps"),
    (('{"input": "Hi.", "x": ' + digits(9000) + "}").encode(), "application/json", 400, "invalid_field", "voice"),
    (b'{"input": "Hi."}', "application/json; charset=foo", 415, "unsupported_media_type", "charset"),
    (b'{"input": "Hi."}', "application/json; charset=rot13", 415, "unsupported_media_type", "charset"),
    (b'{"input": "Hi."}', "application/json; charset=zlib", 415, "unsupported_media_type", "charset"),
    (b'{"input": "Hi."}', "application/json; charset=base64", 415, "unsupported_media_type", "charset"),
    (b'{"input": "\xff\xfe"}', "application/json", 400, "invalid_json", "utf"),
    (b'{"input": "hi \\ud800"}', "application/json", 400, "invalid_field", "input"),
    (b'{"input": "hi \\udfff there", "stream_format": "sse"}', "application/json", 400, "invalid_field", "input"),
    (b'{"input": "hi \\ud800", "stream_format": "audio", "response_format": "pcm"}', "application/json", 400,
     "invalid_field", "input"),
    (b'{"input": "Hi.", "voice": "al\\ud800loy"}', "application/json", 400, "invalid_field", "voice"),
    # a valid non-UTF-8 charset is honoured: the body decodes, and the bad voice is what is refused
    ('{"input": "Café.", "voice": "nobody"}'.encode("latin-1"), "application/json; charset=latin-1", 400,
     "invalid_field", "voice"),
]


async def test_bad_bodies_get_4xx_json(live):
    async with aiohttp.ClientSession() as http:
        for path in (SPEECH, "/v1/jobs"):
            for body, content_type, status, code, word in BAD_BODIES:
                if path == "/v1/jobs" and b"stream_format" in body:
                    continue
                # a 9,000-digit number in an ignored field is harmless: refuse the voice instead
                body = body.replace(b'"x": ', b'"voice": "nobody", "x": ')
                async with http.post(url(live, path), data=body, headers={"Content-Type": content_type}) as r:
                    payload = await r.json(content_type=None)
                    assert (r.status, payload["error"]["code"]) == (status, code), (path, body[:60], payload)
                    assert word.lower() in payload["error"]["message"].lower(), (body[:60], payload)
        async with http.get(url(live, "/readyz")) as r:
            assert r.status == 200
        assert await metric_value(url(live, ""), "streamvox_requests_total",
                                  '{endpoint="/v1/audio/speech",outcome="internal_error"}') == 0


# Every route that reads a body, with a body of its kind and its error shape's keys
BODY_ROUTES = [
    (SPEECH, {"input": "Hi."}, {"error"}),
    ("/v1/jobs", {"input": "Hi."}, {"error"}),
    ("/v1/speak", {"text": "Hi."}, {"err_code", "err_msg", "request_id"}),
    ("/tts/bytes", {"transcript": "Hi.", "voice": "default"}, {"error", "title", "message", "error_code",
                                                                "status_code", "request_id"}),
    ("/tts/sse", {"transcript": "Hi.", "voice": "default"}, {"error", "title", "message", "error_code",
                                                              "status_code", "request_id"}),
    ("/v1/text-to-speech/default", {"text": "Hi."}, {"detail"}),
    ("/v1/text-to-speech/default/stream", {"text": "Hi."}, {"detail"}),
    ("/v1/text-to-speech/default/with-timestamps", {"text": "Hi."}, {"detail"}),
    ("/v1/text-to-speech/default/stream/with-timestamps", {"text": "Hi."}, {"detail"}),
]


async def test_a_body_that_is_not_its_content_encoding_is_400_on_every_route(live, caplog):
    """``Content-Encoding: gzip`` / ``deflate`` on bytes that are not: 400 ``invalid_body`` in the
    route's shape (the JSON routes, the vendors' and the multipart voice upload), never a 500, and
    no traceback in the log (aiohttp read the rest of such a body after the answer and logged its
    decoder's error as unhandled); a body that really is gzip is read as before."""
    import gzip
    import zlib

    bogus = [b'{"input": "Hi."}', b"\x1f\x8b\x08\x00garbage after a gzip magic", b"x\x9c garbage after a zlib header"]
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        for path, body, shape in BODY_ROUTES:
            for encoding in ("gzip", "deflate"):
                for data in bogus:
                    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
                    async with http.post(url(live, path), data=data, headers=headers) as r:
                        payload = await r.json(content_type=None)
                        assert r.status == 400 and set(payload) == shape, (path, encoding, r.status, payload)
                        assert "invalid_body" in json.dumps(payload).lower() and encoding in json.dumps(payload), payload
        for encoding in ("gzip", "deflate"):
            form = aiohttp.FormData()
            form.add_field("name", "someone")
            form.add_field("audio_sample", b"RIFF....WAVE", filename="ref.wav", content_type="audio/wav")
            writer = form()
            raw = b"".join([chunk async for chunk in _multipart_bytes(writer)])
            async with http.post(url(live, "/v1/audio/voices"), data=raw,
                                 headers={"Content-Type": writer.content_type, "Content-Encoding": encoding}) as r:
                payload = await r.json()
                assert (r.status, payload["error"]["code"]) == (400, "invalid_body"), payload
        for encoding, pack in (("gzip", gzip.compress), ("deflate", zlib.compress)):  # the real thing still works
            async with http.post(url(live, SPEECH), data=pack(b'{"input": "Hi.", "response_format": "wav"}'),
                                 headers={"Content-Type": "application/json", "Content-Encoding": encoding}) as r:
                assert r.status == 200 and (await r.read())[:4] == b"RIFF"
    for path in [SPEECH, "/v1/jobs", "/v1/audio/voices"] + [p for p, _, _ in BODY_ROUTES[2:]]:
        assert await metric_value(url(live, ""), "streamvox_requests_total",
                                  f'{{endpoint="{path}",outcome="internal_error"}}') == 0, path
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def _multipart_bytes(writer):
    class Sink:
        def __init__(self):
            self.parts = []

        async def write(self, data):
            self.parts.append(bytes(data))

    sink = Sink()
    await writer.write(sink)
    for part in sink.parts:
        yield part


async def raw_request(live, data: bytes, timeout_s: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection(*live)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), timeout_s)
    finally:
        writer.close()


def status_and_json(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


@pytest.mark.parametrize("path", ["/v1/voices", "/v1/stream", "/healthz"])
async def test_undecodable_header_bytes_get_400(live, path):
    for header in (b"Authorization: Bearer \xff\xfe", b"X-Anything: \xc3\x28", b"Origin: http://\xff"):
        request = (b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + header
                   + b"\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                   + b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        status, payload = status_and_json(await raw_request(live, request))
        assert (status, payload["error"]["code"]) == (400, "bad_request"), (path, header, payload)


async def wait_closed(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the socket (fails on timeout)."""
    data = b""
    async with asyncio.timeout(timeout_s):
        while chunk := await reader.read(65536):
            data += chunk
    return data


async def test_silent_and_slow_sockets_are_closed(live):
    sends = [
        b"",  # nothing at all
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n",  # a request head that never ends
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{\"input\": ",  # a body that never ends
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",  # one request, then an idle keep-alive connection
    ]
    sockets = []
    for data in sends:
        reader, writer = await asyncio.open_connection(*live)
        writer.write(data)
        sockets.append((reader, writer))
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with aiohttp.ClientSession() as http:  # normal requests keep working meanwhile
            async with http.get(url(live, "/healthz")) as r:
                assert r.status == 200
        replies = await asyncio.gather(*(wait_closed(reader, 6.0) for reader, _ in sockets))
        assert loop.time() - started < 6.0
        assert b"408" in replies[2].split(b"\r\n")[0] and b"body_timeout" in replies[2]
        assert replies[3].startswith(b"HTTP/1.1 200")
    finally:
        for _, writer in sockets:
            writer.close()
    async with aiohttp.ClientSession() as http:
        async with http.get(url(live, "/readyz")) as r:
            assert r.status == 200


async def test_300_silent_sockets_are_closed_by_the_read_timeouts(engine, tmp_path):
    """The issue's reproduction: 300 sockets sending nothing, a request head that never ends
    or a body that never ends. The per-address cap is off here, so it is the read timeouts
    (1 s) that reclaim them; normal requests are served while they are open and after."""
    import os

    runner, host, port = await start_live(engine, tmp_path / "data", http_idle_seconds=1.0, http_body_seconds=1.0,
                                          max_connections_per_address=0)
    live = (host, port)
    partial = [
        b"",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ",
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 5000\r\n\r\n{\"input\": \"",
    ]
    fds_before = len(os.listdir("/proc/self/fd"))
    sockets = []
    try:
        for i in range(300):
            reader, writer = await asyncio.open_connection(*live)
            writer.write(partial[i % 3])
            sockets.append((reader, writer))
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with aiohttp.ClientSession() as http:
            async with http.get(url(live, "/healthz")) as r:  # served while all 300 are open
                assert r.status == 200
            async with http.post(url(live, SPEECH), json={"input": "Hello there.", "response_format": "pcm"}) as r:
                assert r.status == 200 and len(await r.read()) > 0
        replies = await asyncio.gather(*(wait_closed(reader, 8.0) for reader, _ in sockets))
        assert loop.time() - started < 8.0
        bodies = replies[2::3]
        assert all(b"408" in reply.split(b"\r\n")[0] for reply in bodies)  # each body timeout said so
        assert not any(b" 5" in reply.split(b"\r\n")[0] for reply in replies)
    finally:
        for _, writer in sockets:
            writer.close()
    # the server holds none of them any more: this process's descriptors are back
    await wait_until(lambda: len(os.listdir("/proc/self/fd")) <= fds_before + 5, timeout_s=5)
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            async with http.get(url(live, "/readyz")) as r:
                assert r.status == 200
    await runner.cleanup()


async def test_connections_per_address_are_capped(live):
    sockets = [await asyncio.open_connection(*live) for _ in range(8)]  # the cap (silent sockets)
    try:
        reader, writer = await asyncio.open_connection(*live)
        reply = await wait_closed(reader, 5.0)
        writer.close()
        status, payload = status_and_json(reply)
        assert (status, payload["error"]["code"]) == (503, "too_many_connections")
    finally:
        for _, w in sockets:
            w.close()

    async def ok():
        async with aiohttp.ClientSession() as http:
            async with http.get(url(live, "/healthz")) as r:
                return r.status == 200

    await wait_until(ok, timeout_s=5)  # the closed sockets no longer count against the address


async def test_client_abort_mid_body_is_not_an_internal_error(live, caplog):
    outcome = '{endpoint="/v1/audio/speech",outcome="internal_error"}'
    for _ in range(3):
        reader, writer = await asyncio.open_connection(*live)
        writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"input\": \"" + b"a" * 5000)
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.transport.abort()

    async def counted() -> bool:
        return await metric_value(url(live, ""), "streamvox_requests_total",
                                  '{endpoint="/v1/audio/speech",outcome="client_closed"}') == 3

    await wait_until(counted, timeout_s=10)
    assert await metric_value(url(live, ""), "streamvox_requests_total", outcome) == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR" and r.name.startswith("streamvox")]


async def test_idle_timeout_spares_websockets_and_working_requests(live):
    """The request-head timeout (1 s here) closes idle connections, never an upgraded
    WebSocket that is quiet for longer, nor the request it carries."""
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url(live, "/v1/stream")) as ws:
            assert (await ws.receive_json(timeout=10))["type"] == "session.created"
            await asyncio.sleep(2.5)
            await ws.send_json({"type": "input.text", "text": "Still here."})
            await ws.send_json({"type": "input.done"})
            kinds = []
            while not kinds or kinds[-1] != "session.done":
                message = await ws.receive(timeout=60)
                assert message.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY), message
                if message.type == aiohttp.WSMsgType.TEXT:
                    kinds.append(json.loads(message.data)["type"])
            assert kinds[-1] == "session.done" and "audio.done" in kinds
