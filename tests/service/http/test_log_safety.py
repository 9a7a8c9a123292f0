"""Logs nobody can forge or flood, on ``streamvox serve`` as it runs (a subprocess, its real
log configuration): a request path carrying ``%0a`` / ``%0d`` (and a fake timestamp and level
after them) leaves exactly one log line; 500 connections past the per-address cap are refused
with a 503 and no traceback, and the log grows by less than 50 KB."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from conftest import ServerProcess, wait_until

CAP = 4
REFUSED = 500
LOG_GROWTH_LIMIT = 50_000  # bytes of log for all the refusals together


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("data"), "--max-connections-per-address", str(CAP),
                           "--http-idle-seconds", "120")
    try:
        server.wait_listening()
        yield server
    finally:
        server.stop()


def address(served) -> tuple[str, int]:
    host, port = served.url.split("//", 1)[1].split(":")
    return host, int(port)


async def logged_through(served, marker: str) -> None:
    """Make a request and wait for its access line: every line logged before it is in ``served.log``."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{served.url}/healthz?{marker}") as response:
            assert response.status == 200

    async def seen() -> bool:
        return f"request {response.headers['X-Request-Id']})" in served.log

    await wait_until(seen, timeout_s=10)


async def raw_request(served, head: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(*address(served))
    writer.write(head)
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return reply


async def test_a_path_with_line_breaks_leaves_one_log_line(served):
    fake = b"%0d%0a2026-01-01%2000:00:00,000%20ERROR%20streamvox.server:%20FORGED%20line%0a"
    reply = await raw_request(served, b"GET /nothing" + fake + b"x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 404")
    await logged_through(served, "after-forging")
    lines = [line for line in served.log.splitlines() if "FORGED" in line]
    assert len(lines) == 1, lines
    assert "\\n" in lines[0] and "\\r" in lines[0] and lines[0].split(" ", 2)[2].startswith("INFO streamvox.http:")


async def test_a_request_line_aiohttp_cannot_parse_is_one_line_not_a_traceback(served):
    """Raw UTF-8 in a request line ("²" where a number goes, as a careless client writes it) or a
    header name with a space: aiohttp answers 400 and logged the parser's traceback at ERROR, every
    time (five a minute past the repeat filter); now it is one INFO line each, naming the problem."""
    heads = [b"GET /v1/speak?sample_rate=\xc2\xb2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
             b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header: y\r\nConnection: close\r\n\r\n"]
    before = len(served.log)
    for head in heads * 3:
        assert (await raw_request(served, head)).split(b" ", 2)[1] == b"400"  # (aiohttp's own answer, HTTP/1.0)
    await logged_through(served, "after-malformed")
    logged = served.log[before:]
    assert "Traceback" not in logged and "ERROR" not in logged, logged[-2000:]
    lines = [line for line in logged.splitlines() if "a malformed request, answered 400" in line]
    assert len(lines) == 6 and all(" INFO aiohttp.server: " in line for line in lines), lines


async def test_connections_past_the_cap_are_refused_cleanly_and_briefly(served):
    held = [await asyncio.open_connection(*address(served)) for _ in range(CAP)]
    before = len(served.log.encode())
    statuses: list[bytes] = []

    async def refused(batch: int) -> None:
        for _ in range(REFUSED // 25):
            reader, writer = await asyncio.open_connection(*address(served))
            reply = await asyncio.wait_for(reader.read(), 10)
            statuses.append(reply[:12])
            writer.close()

    try:
        await asyncio.gather(*(refused(b) for b in range(25)))
    finally:
        for _, writer in held:
            writer.close()
    assert statuses == [b"HTTP/1.1 503"] * REFUSED
    await wait_until(lambda: _healthy(served), timeout_s=10)  # the held sockets' slots are free again
    await logged_through(served, "after-refusals")
    grown = served.log.encode()[before:]
    assert len(grown) < LOG_GROWTH_LIMIT, len(grown)
    assert b"Traceback" not in grown and b"never retrieved" not in grown
    assert b"more like this left out of the log" in grown or grown.count(b"refusing connections") < 10


async def _healthy(served) -> bool:
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{served.url}/healthz") as response:
                return response.status == 200
    except aiohttp.ClientError:
        return False


def test_every_line_breaker_a_client_can_send_is_escaped():
    """Header values, names and paths reach log lines through this one function (and the
    formatter applies it to every message): nothing in them can end a line or move the cursor."""
    import io
    import logging

    from service.http.log_safety import SafeFormatter, escape_controls

    hostile = "a\nb\rc\x1b[2Jd\u2028e\u2029f\x85g\x00h\ud800i\tj"
    escaped = escape_controls(hostile)
    assert escaped == "a\\nb\\rc\\x1b[2Jd\\u2028e\\u2029f\\x85g\\x00h\\ud800i\\tj"
    assert escaped.encode("utf-8") and escaped.isprintable()
    assert escape_controls("plain ascii / é ü 中文") == "plain ascii / é ü 中文"
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(SafeFormatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("streamvox.test.escape")
    logger.addHandler(handler)
    try:
        logger.warning("voice %s saved (header %s)", "x\nERROR forged", "ua\r\nX: y")
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue().count("\n") == 1 and "\\nERROR forged" in stream.getvalue()


def test_repeated_errors_are_written_a_few_times_then_counted():
    import logging

    from service.http.log_safety import RepeatFilter

    repeat = RepeatFilter(window_s=3600, burst=5)
    records = [logging.LogRecord("asyncio", logging.ERROR, __file__, 1, f"Task-{i} exception at 0x{i:x}", None, None)
               for i in range(500)]
    assert sum(repeat.filter(r) for r in records) == 5  # numbers aside, one message
    info = logging.LogRecord("streamvox.http", logging.INFO, __file__, 1, "GET / -> 200", None, None)
    assert all(repeat.filter(info) for _ in range(50))  # the access log is never thinned
    repeat.window_s = 0.0  # the window has passed: the next one says how many were left out
    record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task-9 exception at 0x9", None, None)
    assert repeat.filter(record) and "495 more like this left out" in record.getMessage()


async def test_a_log_nobody_reads_never_holds_the_server(tmp_path):
    """The server's stderr is a pipe its reader stopped reading (a stuck log collector): after
    ~64 KiB of lines a write to it blocks. Lines are written by a thread of their own, so the
    server keeps answering (it froze at the first blocked access line before), and once the pipe
    is read again every line that was waiting comes out."""
    server = ServerProcess(tmp_path / "data", reader=False)
    try:
        url = server.wait_listening()
        padding = "x" * 2000  # each access line carries the path: ~35 of them fill the pipe
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            for i in range(200):
                async with http.get(f"{url}/nothing-{i}-{padding}") as response:
                    assert response.status == 404
                    last = response.headers["X-Request-Id"]
        server.read_stderr()

        async def drained() -> bool:
            return f"request {last})" in server.log

        await wait_until(drained, timeout_s=30)
        assert sum("/nothing-" in line for line in server.lines) == 200
    finally:
        server.stop()
