"""The job database stops mid-run and comes back.

While it is down: a WebSocket stream keeps working, job endpoints answer 503 with
Retry-After (a JSON body, never a 500), ``/readyz`` reports the database (and
``/readyz?jobs=optional``, the Kubernetes probe, stays ready). When it is back the jobs that
were queued or running finish, each exactly once, with whole audio.

The test has a PostgreSQL server of its own: stopping the session's would break other tests.
"""

from __future__ import annotations

import asyncio
import io
import json

import aiohttp
import numpy as np
import pytest
import soundfile as sf
from conftest import ServerProcess, metric_value, wait_until
from testsupport.postgres import start_postgres

from clients.client import StreamvoxClient
from engines.contract import SAMPLE_RATE

JOBS = 5  # two run at once (the default job workers), the rest wait in the queue
TEXT = " ".join(f"Line {i} of a job that is running when the database goes away." for i in range(6))


@pytest.fixture
def own_postgres():
    server = start_postgres()
    yield server
    server.cleanup()


async def ws_utterance(url: str, text: str) -> tuple[list[str], int]:
    """One WebSocket utterance: the message types seen and the PCM bytes received."""
    kinds, pcm = [], 0
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url.replace("http", "ws") + "/v1/stream") as ws:
            assert (await ws.receive_json(timeout=30))["type"] == "session.created"
            await ws.send_json({"type": "input.text", "text": text})
            await ws.send_json({"type": "input.done"})
            while not kinds or kinds[-1] != "session.done":
                message = await ws.receive(timeout=60)
                assert message.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY), message
                if message.type == aiohttp.WSMsgType.TEXT:
                    kinds.append(json.loads(message.data)["type"])
                else:
                    pcm += len(message.data)
    return kinds, pcm


async def test_database_outage_streams_keep_working_jobs_503_then_resume(own_postgres, tmp_path):
    url_db = own_postgres.create_database()
    replica = ServerProcess(tmp_path / "data", env={"STREAMVOX_JOBS_DB": url_db})
    try:
        url = replica.wait_listening()
        async with StreamvoxClient(url) as client, aiohttp.ClientSession() as http:
            jobs = [await client.submit_job(TEXT, seed=i) for i in range(JOBS)]

            async def one_running():
                return any(job["status"] == "running" for job in await client.list_jobs())

            await wait_until(one_running, timeout_s=60)
            own_postgres.stop()  # "fast" shutdown: every connection is cut now

            kinds, pcm = await ws_utterance(url, "The database is down and this still speaks.")
            assert "audio.done" in kinds and "error" not in kinds and pcm > 0

            for method, path, body in (("GET", "/v1/jobs", None), ("POST", "/v1/jobs", {"input": "New work."}),
                                       ("GET", f"/v1/jobs/{jobs[0]['id']}", None),
                                       ("GET", f"/v1/jobs/{jobs[0]['id']}/audio", None),
                                       ("DELETE", f"/v1/jobs/{jobs[-1]['id']}", None)):
                async with http.request(method, url + path, json=body) as response:
                    assert response.status == 503, (method, path, response.status)
                    assert int(response.headers["Retry-After"]) > 0
                    assert (await response.json())["error"]["code"] == "database_unavailable"
            async with http.get(url + "/readyz") as response:
                assert response.status == 503
                assert (await response.json())["jobs_db"]["reachable"] is False
            async with http.get(url + "/readyz?jobs=optional") as response:
                assert response.status == 200  # the probe: streaming is still served
            async with http.get(url + "/healthz") as response:
                assert response.status == 200

            async def runner_noticed():
                return await metric_value(url, "streamvox_job_store_up") == 0

            await wait_until(runner_noticed, timeout_s=15)

            own_postgres.start()  # the same cluster, the same port
            finished = [await client.wait_job(job["id"]) for job in jobs]
            assert [job["status"] for job in finished] == ["succeeded"] * JOBS, finished
            for job in jobs:
                audio, rate = sf.read(io.BytesIO(await client.fetch_audio(job["id"])), dtype="float32")
                assert rate == SAMPLE_RATE and audio.size > 0 and np.abs(audio).max() > 1e-3
            async with http.get(url + "/readyz") as response:
                assert response.status == 200
                assert (await response.json())["jobs_db"]["reachable"] is True
        assert await metric_value(url, "streamvox_job_audio_stored_total") == JOBS  # each job's audio once
        assert await metric_value(url, "streamvox_job_store_up") == 1
        assert "Traceback" not in replica.log
    finally:
        replica.kill()


async def test_a_database_that_never_answers_does_not_stall_the_probe(engine, tmp_path):
    """A blackholed database (TCP connects, nothing ever answers): the readiness probe's path
    still answers within its 3 s timeout, plain /readyz says the store is unreachable, and a
    job request gets a 503 with Retry-After once the connect timeout passes, never a hang."""
    import socket
    import time

    from conftest import start_server

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel completes handshakes into the backlog; nobody reads or answers
    url_db = f"postgresql://streamvox@127.0.0.1:{silent.getsockname()[1]}/streamvox"
    live = await start_server(engine, tmp_path / "data", jobs_db=url_db)
    try:
        async with aiohttp.ClientSession() as http:
            for path, status in (("/readyz?jobs=optional", 200), ("/readyz", 503)):
                started = time.monotonic()
                async with http.get(live.url + path) as response:
                    assert response.status == status
                    body = await response.json()
                assert time.monotonic() - started < 3.0, path  # the kubelet's probe timeout
                assert body["jobs_db"]["reachable"] is False

            async def list_jobs() -> tuple[int, dict, dict]:
                async with http.get(live.url + "/v1/jobs", timeout=aiohttp.ClientTimeout(total=60)) as response:
                    return response.status, dict(response.headers), await response.json()

            started = time.monotonic()
            answers = await asyncio.gather(*(list_jobs() for _ in range(6)))
            for status, headers, body in answers:
                assert status == 503 and headers["Retry-After"] and body["error"]["code"] == "database_unavailable"
            # one connect timeout (5 s) for them all: callers queued behind a failed try fail at once
            assert time.monotonic() - started < 15.0
    finally:
        await live.stop()
        silent.close()
