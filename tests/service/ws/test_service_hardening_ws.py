"""WebSocket hardening: one socket cannot freeze the server, idle means
no client *message*, and malformed input is a non-fatal error on a socket that keeps working.

Real server on 127.0.0.1 (ephemeral port), real clients. The flooding client is a raw TCP
socket driven from a thread (it writes pre-built frames and never reads), so the test's own
client code never holds the server's event loop.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
import threading
import time

import aiohttp
import numpy as np
import pytest
import websockets
from conftest import metric_value, start_server

from service.settings import from_args

HEALTHZ_BUDGET_S = 0.5


async def connect(url: str, **kwargs):
    ws = await websockets.connect(url, max_size=None, **kwargs)
    created = json.loads(await ws.recv())
    assert created["type"] == "session.created"
    return ws


async def next_json(ws, timeout: float = 10.0) -> dict:
    """The next text message (binary audio frames are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        message = await asyncio.wait_for(ws.recv(), max(0.01, deadline - time.monotonic()))
        if isinstance(message, str):
            return json.loads(message)


async def one_round(ws, text: str = "Hello there.") -> dict:
    await ws.send(json.dumps({"type": "input.text", "text": text}))
    await ws.send(json.dumps({"type": "input.done"}))
    while True:
        event = await next_json(ws, timeout=30.0)
        assert event["type"] != "error", event
        if event["type"] == "session.done":
            return event


# -- a raw WebSocket client that floods and never reads ---------------------------------------

def _frame(payload: bytes) -> bytes:
    """One masked client text frame."""
    mask = os.urandom(4)
    size = len(payload)
    if size < 126:
        header = struct.pack("!BB", 0x81, 0x80 | size)
    elif size < 1 << 16:
        header = struct.pack("!BBH", 0x81, 0x80 | 126, size)
    else:
        header = struct.pack("!BBQ", 0x81, 0x80 | 127, size)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return header + mask + masked


class Flooder(threading.Thread):
    """Handshake, then write ``blob`` (many frames) and never read; stops when the server closes."""

    def __init__(self, url: str, blob: bytes):
        super().__init__(daemon=True)
        self.address = url.split("//", 1)[1].split("/", 1)[0]
        host, port = self.address.split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)  # a client that never reads
        self.sock.settimeout(60.0)
        self.sock.connect((host, int(port)))
        self.blob = blob
        self.sent = 0
        self.upgraded = False

    def run(self) -> None:  # in this thread: the server's loop answers the handshake meanwhile
        key = base64.b64encode(os.urandom(16)).decode()
        try:
            self.sock.sendall((f"GET /v1/stream HTTP/1.1\r\nHost: {self.address}\r\nUpgrade: websocket\r\n"
                               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                               "Sec-WebSocket-Version: 13\r\n\r\n").encode())
            head = b""
            while b"\r\n\r\n" not in head:
                head += self.sock.recv(1)
        except OSError:
            return
        self.upgraded = b" 101 " in head.split(b"\r\n", 1)[0]
        view = memoryview(self.blob)
        try:
            while self.sent < len(view):
                self.sent += self.sock.send(view[self.sent:self.sent + 65536])
        except OSError:
            pass  # the server closed the session

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


async def healthz_latencies(url: str, until, min_s: float = 3.0, max_s: float = 30.0) -> list[float]:
    """/healthz latencies while polling, for at least ``min_s`` and until ``until()`` (inf: timed out)."""
    latencies: list[float] = []
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=5.0)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while time.monotonic() - start < max_s and (time.monotonic() - start < min_s or not until()):
            began = time.monotonic()
            try:
                async with http.get(url + "/healthz") as response:
                    assert response.status == 200
                    await response.read()
                latencies.append(time.monotonic() - began)
            except asyncio.TimeoutError:
                return latencies + [float("inf")]
            await asyncio.sleep(0.05)
    return latencies


async def timed_round(server) -> float:
    began = time.monotonic()
    ws = await connect(server.ws_url)
    try:
        await asyncio.wait_for(one_round(ws), 60.0)
    finally:
        await ws.close()
    return time.monotonic() - began


async def run_flood(server, blob: bytes) -> tuple[list[float], float, float]:
    """(/healthz latencies during the flood, a normal round's time before, during the flood)."""
    baseline = await timed_round(server)
    flooder = Flooder(server.ws_url, blob)
    flooder.start()
    try:
        normal = asyncio.create_task(timed_round(server))
        latencies = await healthz_latencies(server.url, until=lambda: not flooder.is_alive() and normal.done())
        try:
            during = await asyncio.wait_for(normal, 10.0)
        except asyncio.TimeoutError:
            during = float("inf")
    finally:
        flooder.close()
        flooder.join(5.0)
    assert flooder.upgraded
    return latencies, baseline, during


def _cancel_flood() -> bytes:
    return _frame(json.dumps({"type": "response.cancel"}).encode()) * 50_000


def _input_done_flood_then_text() -> bytes:
    done = _frame(json.dumps({"type": "input.done"}).encode())
    text = _frame(json.dumps({"type": "input.text", "text": "a"}).encode())
    return done * 100_000 + text * 2_000


@pytest.mark.parametrize("flood", [_cancel_flood, _input_done_flood_then_text], ids=["cancel", "input_done_then_text"])
async def test_a_flood_on_one_socket_does_not_freeze_the_server(engine, tmp_path, flood):
    server = await start_server(engine, tmp_path / "data")
    try:
        latencies, baseline, during = await run_flood(server, flood())
        # The bug froze /healthz for 12-34 s (every poll slow). The budget holds for 90 % of the
        # polls and no poll may exceed 4x it: one scheduling hiccup of the shared 2-core CI box
        # (the engine thread, the flooder and the client share this process) is not a freeze.
        typical = float(np.quantile(latencies, 0.9))
        assert typical < HEALTHZ_BUDGET_S, f"/healthz p90 {typical:.2f} s during the flood"
        assert max(latencies) < 4 * HEALTHZ_BUDGET_S, f"/healthz took {max(latencies):.2f} s during the flood"
        assert during < 2 * baseline + 1.0, f"a normal round took {during:.2f} s (baseline {baseline:.2f} s)"
        outcome = '{endpoint="/v1/stream",outcome="too_many_rounds"}'
        assert await metric_value(server.url, "streamvox_requests_total", outcome) == 1
    finally:
        await server.stop()


async def test_a_reading_client_may_end_many_rounds(server):
    """The rounds bound counts only unanswered rounds: a client that reads is never cut off."""
    ws = await connect(server.ws_url)
    try:
        for _ in range(3):
            for _ in range(40):
                await ws.send(json.dumps({"type": "response.cancel"}))
            for _ in range(40):
                assert (await next_json(ws))["type"] == "session.done"
        assert (await one_round(ws))["utterances"] == 1
    finally:
        await ws.close()


async def test_idle_timeout_fires_for_a_client_that_answers_and_sends_pings(engine, tmp_path):
    server = await start_server(engine, tmp_path / "data", ws_idle_timeout_s=1.5)
    try:
        # websockets pings every 0.3 s and answers the server's pings: control frames, not messages.
        ws = await connect(server.ws_url, ping_interval=0.3, ping_timeout=5.0)
        await ws.send(json.dumps({"type": "session.config", "seed": 1}))
        began = time.monotonic()
        event = await next_json(ws, timeout=6.0)
        assert event["type"] == "error" and event["code"] == "idle_timeout", event
        assert 1.0 < time.monotonic() - began < 4.0
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5.0)
        assert ws.close_code == 1000
    finally:
        await server.stop()


def test_ws_idle_seconds_flag_and_environment():
    import argparse

    from service.settings import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_args(parser.parse_args(["--ws-idle-seconds", "7.5"]), env={}).ws_idle_timeout_s == 7.5
    assert from_args(None, env={"STREAMVOX_WS_IDLE_SECONDS": "3"}).ws_idle_timeout_s == 3.0
    assert from_args(None, env={}).ws_idle_timeout_s == 60.0
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(ValueError, match="--ws-idle-seconds"):
            from_args(None, env={"STREAMVOX_WS_IDLE_SECONDS": bad})


BAD_MESSAGES = {
    "seed_5000_digits": '{"type":"session.config","seed":' + "9" * 5000 + "}",
    "speed_400_digits": '{"type":"session.config","speed":' + "9" * 400 + "}",
    "guidance_400_digit_float": '{"type":"session.config","guidance_scale":' + "9" * 400 + ".5}",
    "text_lone_surrogate": '{"type":"input.text","text":"hi \\ud800."}',
    "config_lone_surrogate": '{"type":"session.config","voice":"\\udfff"}',
    "nested_100000": "[" * 100_000,
    "nested_object": '{"type":"input.text","text":' + '{"a":' * 5000 + "1" + "}" * 5001,
}


@pytest.mark.parametrize("name", sorted(BAD_MESSAGES))
async def test_bad_ws_input_is_a_non_fatal_error(server, name):
    ws = await connect(server.ws_url)
    try:
        await ws.send(BAD_MESSAGES[name])
        await ws.send(json.dumps({"type": "input.done"}))  # old code failed only once the text was spoken
        event = await next_json(ws)
        assert event["type"] == "error", event
        assert event["code"] in ("invalid_json", "invalid_field"), event
        assert "\ud800" not in event["message"] and len(event["message"]) < 500
        assert (await next_json(ws))["type"] == "session.done"  # the input.done's round (nothing spoken)
        # The socket is open and usable.
        assert (await one_round(ws))["utterances"] == 1
    finally:
        await ws.close()


# -- item 7 on WebSocket: the work limit ----------------------------------------------------------

async def test_an_utterance_over_the_work_limit_is_an_error_before_any_engine_time(engine, tmp_path):
    """Each utterance is checked against --max-work-frame-steps (after speed and steps) when
    it would be submitted: over it, one ``error`` naming the limit, no engine request, and the
    session goes on (the next utterance is spoken, the round still ends with session.done)."""
    live = await start_server(engine, tmp_path / "data", max_work_frame_steps=1000)
    submitted = []
    real_submit = engine.submit

    def counting_submit(request, deliver):
        submitted.append(request.text)
        return real_submit(request, deliver)

    engine.submit = counting_submit
    try:
        ws = await connect(live.ws_url)
        try:
            await ws.send(json.dumps({"type": "session.config", "steps": 16}))  # 100 letters plan 90 x 16 frame-steps
            await ws.send(json.dumps({"type": "input.text", "text": "x" * 100 + "."}))
            await ws.send(json.dumps({"type": "input.done"}))
            events = []
            while not events or events[-1]["type"] != "session.done":
                events.append(await next_json(ws, timeout=30.0))
            errors = [e for e in events if e["type"] == "error"]
            assert len(errors) == 1 and errors[0]["code"] == "too_much_work" and "1000" in errors[0]["message"]
            assert not [e for e in events if e["type"] == "audio.start"]
            assert submitted == []  # refused before any engine time
            await ws.send(json.dumps({"type": "session.config", "steps": 8}))
            done = await one_round(ws, "Short one.")  # same socket, within the limit: spoken
            assert done["utterances"] == 1 and submitted == ["Short one."]
        finally:
            await ws.close()
    finally:
        engine.submit = real_submit
        await live.stop()
