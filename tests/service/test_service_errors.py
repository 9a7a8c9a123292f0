"""Every malformed input gets its documented 4xx / WS error; the server stays ready."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import websockets
from conftest import make_engine, start_server, wait_until

SPEECH = "/v1/audio/speech"
UNKNOWN_JOB = "0" * 32

HTTP_CASES = [
    # (method, path, body (dict -> JSON, bytes -> raw), status, code)
    ("POST", SPEECH, b"{not json", 400, "invalid_json"),
    ("POST", SPEECH, b"[1, 2]", 400, "invalid_json"),
    ("POST", SPEECH, {"voice": "alloy"}, 400, "invalid_field"),
    ("POST", SPEECH, {"input": 123}, 400, "invalid_field"),
    ("POST", SPEECH, {"input": "   "}, 400, "invalid_field"),
    ("POST", SPEECH, {"input": "x" * 101}, 400, "text_too_long"),
    ("POST", SPEECH, {"input": "Hi.", "voice": "nobody"}, 400, "invalid_field"),
    ("POST", SPEECH, {"input": "Hi.", "response_format": "m4a"}, 400, "invalid_field"),
    ("POST", SPEECH, {"input": "Hi.", "sample_rate": 96000}, 400, "invalid_field"),
    ("POST", SPEECH, {"input": "Hi.", "voice": {"name": "x"}}, 400, "invalid_field"),
    ("POST", SPEECH, {"input": "Hi.", "speed": 10}, 400, "invalid_field"),
    ("POST", SPEECH, {"input": "Hi.", "speed": "fast"}, 400, "invalid_field"),
    ("POST", SPEECH, {"input": "Hi.", "seed": -1}, 400, "invalid_field"),
    ("POST", SPEECH, {"input": "Hi.", "seed": 1.5}, 400, "invalid_field"),
    ("POST", SPEECH, {"input": "Hi.", "steps": 0}, 400, "invalid_field"),
    ("POST", SPEECH, b'{"input": "Hi.", "guidance_scale": NaN}', 400, "invalid_field"),
    ("POST", SPEECH, {"input": "Hi.", "stream_format": "video"}, 400, "invalid_field"),
    ("POST", SPEECH, {"input": "Hi.", "model": "gpt-5"}, 400, "invalid_field"),
    ("POST", SPEECH, b'{"input": "' + b"a" * 300_000 + b'"}', 413, "body_too_large"),
    ("GET", SPEECH, None, 405, "method_not_allowed"),
    ("GET", "/v1/nothing-here", None, 404, "not_found"),
    ("POST", "/v1/jobs", {"input": "Hi.", "response_format": "mp3"}, 400, "invalid_field"),
    ("POST", "/v1/jobs", {"input": ""}, 400, "invalid_field"),
    ("GET", "/v1/jobs?status=bogus", None, 400, "invalid_field"),
    ("GET", "/v1/jobs?limit=zero", None, 400, "invalid_field"),
    ("GET", "/v1/jobs/..%2F..%2Fjobs.sqlite3", None, 400, "invalid_field"),
    ("GET", "/v1/jobs/ZZZ/audio", None, 400, "invalid_field"),
    ("GET", f"/v1/jobs/{UNKNOWN_JOB}", None, 404, "not_found"),
    ("GET", f"/v1/jobs/{UNKNOWN_JOB}/audio", None, 404, "not_found"),
    ("DELETE", f"/v1/jobs/{UNKNOWN_JOB}", None, 404, "not_found"),
]

WS_CASES = [
    # (message (str -> text frame, bytes -> binary frame), error code)
    ("not json", "invalid_json"),
    ("[1, 2]", "invalid_json"),
    (json.dumps({"type": "bogus"}), "unknown_type"),
    (json.dumps({"text": "no type"}), "unknown_type"),
    (b"\x00\x01", "binary_not_supported"),
    (json.dumps({"type": "input.text", "text": 5}), "invalid_field"),
    (json.dumps({"type": "input.text", "text": "y" * 101}), "text_too_long"),
    (json.dumps({"type": "session.config", "voice": "nobody"}), "invalid_field"),
    (json.dumps({"type": "session.config", "speed": 99}), "invalid_field"),
    (json.dumps({"type": "session.config", "seed": "seven"}), "invalid_field"),
]


@pytest.fixture
async def strict_server(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", max_input_chars=100, max_body_bytes=256 * 1024,
                              max_ws_message_bytes=4096)
    yield live
    await live.stop()


async def assert_ready_and_serving(server) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/readyz") as response:
            assert response.status == 200

        async def speech_served():
            async with http.post(server.url + SPEECH, json={"input": "Still here.", "response_format": "pcm"}) as r:
                assert r.status in (200, 429)  # 429 only while a burst is still draining
                return r.status == 200 and len(await r.read()) > 0

        await wait_until(speech_served, every_s=0.2)


async def test_http_bad_inputs_get_documented_errors(strict_server):
    async with aiohttp.ClientSession() as http:
        for method, path, body, status, code in HTTP_CASES:
            kwargs = {"json": body} if isinstance(body, dict) else {"data": body}
            async with http.request(method, strict_server.url + path, **kwargs) as response:
                payload = await response.json(content_type=None)
                assert (response.status, payload["error"]["code"]) == (status, code), (method, path, payload)
                assert payload["error"]["message"]
                assert response.headers.get("X-Request-Id")
    await assert_ready_and_serving(strict_server)


async def test_unknown_voice_lists_the_valid_ones(strict_server):
    async with aiohttp.ClientSession() as http:
        async with http.post(strict_server.url + SPEECH, json={"input": "Hi.", "voice": "nobody"}) as response:
            message = (await response.json())["error"]["message"]
    assert "alloy" in message and "default" in message


async def test_ws_bad_messages_are_recoverable(strict_server):
    async with websockets.connect(strict_server.ws_url) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for message, code in WS_CASES:
            await ws.send(message)
            reply = json.loads(await ws.recv())
            assert (reply["type"], reply["code"]) == ("error", code), message
            assert reply["message"]
        # The same socket still works.
        await ws.send(json.dumps({"type": "input.text", "text": "Still working."}))
        await ws.send(json.dumps({"type": "input.done"}))
        kinds = []
        while not kinds or kinds[-1] != "session.done":
            message = await ws.recv()
            if isinstance(message, str) and json.loads(message)["type"] != "stream.behind":  # (a slow machine)
                kinds.append(json.loads(message)["type"])
        assert kinds == ["audio.start", "audio.done", "session.done"]
    await assert_ready_and_serving(strict_server)


async def test_ws_oversized_message_closes_with_1009(strict_server):
    async with websockets.connect(strict_server.ws_url) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "input.text", "text": "z" * 10_000}))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await ws.recv()
        assert closed.value.rcvd.code == 1009
    await assert_ready_and_serving(strict_server)


async def test_overload_answers_429_with_retry_after(tmp_path):
    engine = make_engine(max_queue=1)
    await asyncio.to_thread(engine.start)
    # The engine's queue is the limit under test: the per-key cap on streamed responses (a
    # 429 too_many_streams of its own, tests/service/access/test_service_hardening_fair.py) is off here.
    server = await start_server(engine, tmp_path / "data", max_streams_per_key=0)
    try:
        async with aiohttp.ClientSession() as http:
            async def speak(i):
                async with http.post(server.url + SPEECH, json={"input": f"Request {i}.", "response_format": "pcm"}) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json() if r.status != 200 else None

            results = await asyncio.gather(*(speak(i) for i in range(24)))
        rejected = [r for r in results if r[0] == 429]
        assert rejected, "a burst over max_queue=1 was never rejected"
        assert all(r[0] in (200, 429) for r in results)
        assert all(r[1] and int(r[1]) >= 1 and r[2]["error"]["code"] == "overloaded" for r in rejected)

        async def session(i):
            async with websockets.connect(server.ws_url) as ws:
                await ws.recv()
                await ws.send(json.dumps({"type": "input.text", "text": f"Session {i}. Second part."}))
                await ws.send(json.dumps({"type": "input.done"}))
                try:
                    while True:
                        message = await ws.recv()
                        if isinstance(message, str):
                            event = json.loads(message)
                            if event["type"] == "session.done":
                                return "done"
                            if event["type"] == "error":
                                assert event["code"] == "overloaded"
                except websockets.ConnectionClosed as exc:
                    assert exc.rcvd.code == 1013
                    return "overloaded"

        outcomes = await asyncio.gather(*(session(i) for i in range(12)))
        assert set(outcomes) <= {"done", "overloaded"}
        await assert_ready_and_serving(server)
    finally:
        await server.stop()
        await asyncio.to_thread(engine.stop)


async def test_ws_config_and_idle_timeouts(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", ws_config_timeout_s=0.3, ws_idle_timeout_s=0.3)
    try:
        async with websockets.connect(live.ws_url) as ws:
            await ws.recv()  # session.created, then the client says nothing
            reply = json.loads(await ws.recv())
            assert (reply["type"], reply["code"]) == ("error", "config_timeout")
            with pytest.raises(websockets.ConnectionClosedOK):
                await ws.recv()
        async with websockets.connect(live.ws_url) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "input.text", "text": "Then silence."}))
            await ws.send(json.dumps({"type": "input.done"}))
            codes = []
            with pytest.raises(websockets.ConnectionClosedOK):
                while True:
                    message = await ws.recv()
                    if isinstance(message, str) and json.loads(message)["type"] != "stream.behind":
                        codes.append(json.loads(message).get("code") or json.loads(message)["type"])
            assert codes == ["audio.start", "audio.done", "session.done", "idle_timeout"]
    finally:
        await live.stop()
