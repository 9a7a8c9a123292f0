"""Fault injection with the real engine's fault hook: one failing request, then a dead worker."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from conftest import start_server

FAIL_ONE = "fail-this-request"
KILL_WORKER = "kill-the-worker"

# The injected SystemExit ends the worker thread on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def faulty_hook(request_id: str, stage: str) -> None:
    if request_id.startswith(FAIL_ONE):
        raise RuntimeError("injected fault in one request")
    if request_id.startswith(KILL_WORKER):
        raise SystemExit("injected worker death")  # not an Exception: escapes the per-request guard


def faulty_engine():
    from engines.build import build_engine
    from engines.config import EngineConfig

    engine = build_engine(EngineConfig.for_tests(), faulty_hook)
    engine.start()
    return engine


async def speak(http, url, request_id):
    async with http.post(url + "/v1/audio/speech", json={"input": "Fault tolerance.", "response_format": "pcm", "stream": False},
                         headers={"X-Request-Id": request_id}) as response:
        return response.status, response.headers.get("X-Request-Id"), await response.read()


async def test_request_fault_fails_that_request_only_and_dead_worker_turns_readyz_false(tmp_path):
    engine = await asyncio.to_thread(faulty_engine)
    server = await start_server(engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            results = await asyncio.gather(*(speak(http, server.url, rid) for rid in (FAIL_ONE, "ok-1", "ok-2")))
            failed, *healthy = results
            assert (failed[0], failed[1]) == (500, FAIL_ONE) and b"synthesis_failed" in failed[2]
            assert [r[0] for r in healthy] == [200, 200] and all(len(r[2]) > 0 for r in healthy)
            async with http.get(server.url + "/readyz") as response:
                assert response.status == 200

            status, _, body = await speak(http, server.url, KILL_WORKER)
            assert status == 500 and b"synthesis_failed" in body  # answered, not left hanging
            async with http.get(server.url + "/readyz") as response:
                assert response.status == 503
            status, _, body = await speak(http, server.url, "after-death")
            assert status == 503 and b"unavailable" in body
            async with http.get(server.url + "/healthz") as response:
                assert response.status == 200  # the process is alive; the orchestrator restarts it
    finally:
        await server.stop()
        await asyncio.to_thread(engine.stop)


async def test_serve_exits_1_when_the_worker_dies(tmp_path):
    from service.server import serve
    from service.settings import Settings

    engine = await asyncio.to_thread(faulty_engine)
    settings = Settings(host="127.0.0.1", port=0, data_dir=tmp_path / "data", drain_seconds=5)
    listening = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(settings, engine=engine, stop=asyncio.Event(), listening=listening))
    url = await asyncio.wait_for(listening, 60)
    async with aiohttp.ClientSession() as http:
        try:
            await speak(http, url, KILL_WORKER)
        except aiohttp.ClientError:
            pass  # the server may already be going down
    assert await asyncio.wait_for(server, 60) == 1
