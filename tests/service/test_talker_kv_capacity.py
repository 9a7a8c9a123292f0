"""When the talker's KV pool runs out mid-request the request is refused for capacity (503
``overloaded`` with ``Retry-After``; on sockets and SSE an ``overloaded`` error), never a
500 ``synthesis_failed``.

A pool of 3 blocks of 16 positions holds the tiny talker fixture's ~17-position prompt (so the
request is admitted) but not a stream that speaks past 48 positions: seed 1 does. Real server,
real HTTP and WebSocket clients.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
import websockets
from conftest import finished_job, start_server

from engines.build import build_engine
from engines.config import EngineConfig
from tests.oracle import talker_fixtures as fx

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x positions x KV heads x head dim x fp32
BODY = {"input": "Hello there.", "max_new_tokens": 200, "seed": 1}


@pytest.fixture(scope="module")
def small_pool_engine():
    engine = build_engine(EngineConfig.for_tests(checkpoint=str(fx.checkpoint_dir("cv_proj")), warmup=False,
                                                 kv_cache_gb=4 * BLOCK_BYTES / 2**30))  # 3 blocks + the null block
    engine.start()
    yield engine
    engine.stop()


async def test_a_request_that_outgrows_the_kv_pool_is_a_503_with_retry_after(small_pool_engine, tmp_path):
    live = await start_server(small_pool_engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(live.url + "/v1/audio/speech", json={**BODY, "stream": False}) as response:
                body = await response.json()
                assert response.status == 503, body
                assert body["error"]["code"] == "overloaded" and int(response.headers["Retry-After"]) >= 1
            # SSE: the audio had started (status 200 sent), the failure comes as an error event.
            async with http.post(live.url + "/v1/audio/speech", json={**BODY, "stream_format": "sse"}) as response:
                assert response.status == 200
                events = [json.loads(line[6:]) for line in (await response.text()).splitlines()
                          if line.startswith("data: ")]
            errors = [e for e in events if e["type"] == "error"]
            assert len(errors) == 1 and errors[0]["error"]["code"] == "overloaded", events[-1]
            # A short request still speaks (the pool is free again).
            async with http.post(live.url + "/v1/audio/speech",
                                 json={**BODY, "seed": 0, "stream": False}) as response:
                assert response.status == 200, await response.text()
    finally:
        await live.stop()


async def test_on_a_websocket_the_utterance_ends_with_an_overloaded_error(small_pool_engine, tmp_path):
    live = await start_server(small_pool_engine, tmp_path / "data")
    try:
        async with websockets.connect(live.ws_url, max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.config", "max_new_tokens": 200, "seed": 1,
                                      "text_streaming": False}))
            await ws.send(json.dumps({"type": "input.text", "text": BODY["input"]}))
            await ws.send(json.dumps({"type": "input.done"}))
            events = []
            while not events or events[-1]["type"] != "session.done":
                message = await ws.recv()
                if isinstance(message, str):
                    events.append(json.loads(message))
        [done] = [e for e in events if e["type"] == "audio.done"]
        assert done.get("error") == "overloaded", done
    finally:
        await live.stop()


async def test_a_job_that_outgrows_the_kv_pool_is_queued_again_then_fails_with_the_reason(small_pool_engine, tmp_path):
    """A job is not a client waiting on a socket: running out of KV cache gives it back to the
    queue for another turn, a bounded number of times (this one can never fit: it then fails,
    naming the cache), and the runner goes on with the next job."""
    from service.jobs.runner import CAPACITY_ATTEMPTS

    live = await start_server(small_pool_engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(live.url + "/v1/jobs", json=BODY) as response:
                assert response.status == 202, await response.text()
                job_id = (await response.json())["id"]
            async with http.post(live.url + "/v1/jobs", json={**BODY, "seed": 0}) as response:
                short_id = (await response.json())["id"]
            job = await finished_job(http, f"{live.url}/v1/jobs/{job_id}")
            assert job["status"] == "failed" and "kv_cache_exhausted" in job["error"], job
            stored = await live.state.jobs.store.get(job_id)
            assert stored.attempts == CAPACITY_ATTEMPTS, stored.attempts
            short = await finished_job(http, f"{live.url}/v1/jobs/{short_id}")
            assert short["status"] == "succeeded", short
    finally:
        await live.stop()
