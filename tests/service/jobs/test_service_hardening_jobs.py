"""Hardening of jobs and identity: cancel is atomic with completion,
jobs belong to the key that made them, identity with auth off is the address (not a
presented token), and undecodable Authorization bytes get a 4xx, never a 5xx."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from urllib.parse import urlsplit

import aiohttp
import pytest
import websockets
from conftest import make_engine, start_server, wait_until
from yarl import URL

SHORT = "Hello there."
TEXT = " ".join(f"Paragraph sentence {i} is read aloud by the batch queue." for i in range(4))


# -- item 4: DELETE racing the end of a job ------------------------------------------------------

@pytest.mark.parametrize("jobs_db", ["sqlite", "postgresql"])
async def test_delete_as_the_audio_is_written_never_ends_succeeded(engine, tmp_path, request, jobs_db):
    """Drive the race deterministically: the runner has stored the audio and is recording
    the success; DELETE lands right then. Run 20 times (10 on PostgreSQL); every job must
    stay cancelled, with no audio left behind."""
    overrides = {"jobs_db": request.getfixturevalue("pg_url")} if jobs_db == "postgresql" else {}
    live = await start_server(engine, tmp_path / "data", **overrides)
    runner = live.state.jobs
    store = runner.store
    real_finish = store.finish
    finishing = asyncio.Event()
    release = asyncio.Event()

    async def finish_when_released(job_id, token, status, **kwargs):
        if status == "succeeded":
            finishing.set()
            await asyncio.wait_for(release.wait(), 30)
        return await real_finish(job_id, token, status, **kwargs)

    store.finish = finish_when_released
    try:
        async with aiohttp.ClientSession() as http:
            for attempt in range(20 if jobs_db == "sqlite" else 10):
                finishing.clear()
                release.clear()
                async with http.post(live.url + "/v1/jobs", json={"input": SHORT, "seed": attempt}) as response:
                    assert response.status == 202
                    job_id = (await response.json())["id"]
                await asyncio.wait_for(finishing.wait(), 60)
                async with http.delete(f"{live.url}/v1/jobs/{job_id}") as response:
                    assert response.status == 200
                    assert (await response.json())["status"] == "cancelled"
                release.set()

                async def runner_done():
                    return job_id not in runner.running

                await wait_until(runner_done)
                async with http.get(f"{live.url}/v1/jobs/{job_id}") as response:
                    job = await response.json()
                assert job["status"] == "cancelled", f"attempt {attempt}: DELETE said cancelled, job ended {job}"
                assert "audio_url" not in job
                async with http.get(f"{live.url}/v1/jobs/{job_id}/audio") as response:
                    assert response.status == 409
                if jobs_db == "sqlite":
                    assert not [name for name in os.listdir(store.audio_dir) if job_id in name]
                else:
                    assert not await store.put_audio(job_id, "any", 0, b"")
                    assert [b async for b in store.read_audio(await store.get(job_id))] == []
    finally:
        release.set()
        store.finish = real_finish
        await live.stop()


async def test_delete_after_success_is_409_and_keeps_the_audio(server):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/jobs", json={"input": SHORT}) as response:
            job_id = (await response.json())["id"]

        async def succeeded():
            async with http.get(f"{server.url}/v1/jobs/{job_id}") as response:
                return (await response.json())["status"] == "succeeded"

        await wait_until(succeeded)
        async with http.delete(f"{server.url}/v1/jobs/{job_id}") as response:
            assert response.status == 409 and (await response.json())["error"]["code"] == "job_finished"
        async with http.get(f"{server.url}/v1/jobs/{job_id}/audio") as response:
            assert response.status == 200 and len(await response.read()) > 44


# -- item 9: jobs belong to the key that made them -----------------------------------------------

async def test_a_key_cannot_see_or_cancel_another_keys_job(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", api_keys=("key-a", "key-b", "admin.root"))
    a = {"Authorization": "Bearer key-a"}
    b = {"Authorization": "Bearer key-b"}
    admin = {"Authorization": "Bearer admin.root"}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(live.url + "/v1/jobs", json={"input": SHORT}, headers=a) as response:
                assert response.status == 202
                job_id = (await response.json())["id"]
            async with http.post(live.url + "/v1/jobs", json={"input": SHORT}, headers=b) as response:
                b_job = (await response.json())["id"]
            url = f"{live.url}/v1/jobs/{job_id}"

            async def a_job_done():
                async with http.get(url, headers=a) as response:
                    return (await response.json())["status"] in ("succeeded", "failed", "cancelled")

            await wait_until(a_job_done)
            for method, path in (("GET", ""), ("GET", "/audio"), ("DELETE", "")):
                async with http.request(method, url + path, headers=b) as response:
                    assert response.status == 404, (method, path)
                    assert (await response.json())["error"]["code"] == "not_found"
            async with http.get(live.url + "/v1/jobs", headers=b) as response:
                assert [job["id"] for job in (await response.json())["data"]] == [b_job]
            async with http.get(live.url + "/v1/jobs", headers=a) as response:
                assert [job["id"] for job in (await response.json())["data"]] == [job_id]
            async with http.get(url + "/audio", headers=a) as response:
                assert response.status == 200
            # The admin key sees everyone's jobs.
            async with http.get(url, headers=admin) as response:
                assert response.status == 200 and (await response.json())["id"] == job_id
            async with http.get(live.url + "/v1/jobs", headers=admin) as response:
                assert {job["id"] for job in (await response.json())["data"]} == {job_id, b_job}
    finally:
        await live.stop()


async def test_with_auth_off_every_client_is_one_owner(server):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/jobs", json={"input": SHORT},
                             headers={"Authorization": "Bearer whoever"}) as response:
            job_id = (await response.json())["id"]
        async with http.get(f"{server.url}/v1/jobs/{job_id}") as response:
            assert response.status == 200
        async with http.get(f"{server.url}/v1/jobs", headers={"Authorization": "Bearer someone-else"}) as response:
            assert job_id in [job["id"] for job in (await response.json())["data"]]


# -- item 5: with auth off, identity is the address, not a presented token -----------------------

async def test_fake_token_rotation_with_auth_off_is_rate_limited(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", rate_limit=0.5, rate_burst=2)
    try:
        statuses = []
        async with aiohttp.ClientSession() as http:
            for n in range(10):
                async with http.post(live.url + "/v1/jobs", json={"input": ""},
                                     headers={"Authorization": f"Bearer fake{n}"}) as response:
                    statuses.append(response.status)
        assert statuses[:2] == [400, 400]
        assert statuses[2:] == [429] * 8, statuses
    finally:
        await live.stop()


async def test_fake_token_rotation_with_auth_off_hits_the_session_cap(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", max_sessions_per_key=1)
    try:
        async with websockets.connect(live.ws_url + "?token=fake0") as first:
            assert json.loads(await first.recv())["type"] == "session.created"
            for n in range(1, 4):
                async with websockets.connect(f"{live.ws_url}?token=fake{n}",
                                              additional_headers={"Authorization": f"Bearer other{n}"}) as ws:
                    reply = json.loads(await ws.recv())
                    assert (reply["type"], reply.get("code")) == ("error", "too_many_sessions")
    finally:
        await live.stop()


# -- item 3: Authorization bytes that are not UTF-8 ------------------------------------------------

async def raw_exchange(url: str, request: bytes, read_s: float = 5.0) -> bytes:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(request)
        await writer.drain()
        data = b""
        try:
            while True:
                chunk = await asyncio.wait_for(reader.read(65536), read_s)
                if not chunk:
                    break
                data += chunk
                if b"\r\n\r\n" in data and (data.startswith(b"HTTP/1.1 101") or b"Content-Length" in data):
                    head, _, body = data.partition(b"\r\n\r\n")
                    if data.startswith(b"HTTP/1.1 101") and len(body) >= 2:
                        break
                    length = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
                    if length and len(body) >= int(length[0].split(b":")[1]):
                        break
        except asyncio.TimeoutError:
            pass
        return data
    finally:
        writer.close()


def http_request(method: str, path: str, auth: bytes, body: bytes = b"") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n").encode() + \
        b"Authorization: " + auth + b"\r\n\r\n" + body


BAD_AUTH = [b"Bearer \xff\xfe", b"Bearer k\xc3\x28ey", b"\xff\xfe"]


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def json_body(response: bytes) -> dict:
    return json.loads(response.partition(b"\r\n\r\n")[2])


@pytest.mark.parametrize("auth", BAD_AUTH)
async def test_undecodable_authorization_is_a_4xx_json_with_auth_on(engine, tmp_path, auth):
    live = await start_server(engine, tmp_path / "data", api_keys=("key-a",))
    try:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs")):
            response = await raw_exchange(live.url, http_request(method, path, auth, b'{"input": ""}'
                                                                 if method == "POST" else b""))
            assert status_of(response) in (400, 401), response[:200]
            assert json_body(response)["error"]["code"]
        async with aiohttp.ClientSession() as http:  # the server is unharmed
            async with http.get(live.url + "/v1/models", headers={"Authorization": "Bearer key-a"}) as response:
                assert response.status == 200
    finally:
        await live.stop()


@pytest.mark.parametrize("auth", BAD_AUTH)
async def test_undecodable_authorization_is_not_a_5xx_with_auth_off(server, auth):
    for path in ("/v1/jobs", "/v1/audio/speech"):
        response = await raw_exchange(server.url, http_request("POST", path, auth, b'{"input": ""}'))
        # 400 either way: the front door refuses undecodable header bytes (bad_request, naming the
        # header) before auth or the body are read; never a 5xx
        assert status_of(response) == 400, response[:200]
        assert json_body(response)["error"]["code"] in ("invalid_field", "bad_request")


def ws_upgrade(auth: bytes) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET /v1/stream HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n").encode() + \
        b"Authorization: " + auth + b"\r\n\r\n"


def first_ws_message(response: bytes) -> dict:
    """The first server frame after a 101 (servers do not mask; short text frames)."""
    frame = response.partition(b"\r\n\r\n")[2]
    assert frame[0] & 0x0F == 0x1, f"not a text frame: {response[:300]!r}"
    length, offset = frame[1] & 0x7F, 2
    if length == 126:
        length, offset = int.from_bytes(frame[2:4], "big"), 4
    return json.loads(frame[offset:offset + length])


@pytest.mark.parametrize("keyed", [True, False])
async def test_undecodable_authorization_on_the_ws_upgrade(engine, tmp_path, keyed):
    live = await start_server(engine, tmp_path / "data", api_keys=("key-a",) if keyed else ())
    try:
        response = await raw_exchange(live.url, ws_upgrade(b"Bearer \xff\xfe"))
        assert b"HTTP/1.1 500" not in response and b"500 Internal" not in response, response[:300]
        if response.startswith(b"HTTP/1.1 101"):
            message = first_ws_message(response)
            expected = ("error", "unauthorized") if keyed else ("session.created", None)
            assert (message["type"], message.get("code")) == expected
        else:  # refused before the upgrade: a 4xx with a JSON error
            assert 400 <= status_of(response) < 500 and json_body(response)["error"]["code"]
    finally:
        await live.stop()


# -- item 10 (the part in the jobs API): ids are matched whole --------------------------------------

async def test_a_job_id_with_a_trailing_newline_is_refused(server):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/jobs", json={"input": SHORT}) as response:
            job_id = (await response.json())["id"]
        for suffix in ("%0a", "%0A", "%0d%0a"):
            for method, path in (("GET", ""), ("GET", "/audio"), ("DELETE", "")):
                url = URL(f"{server.url}/v1/jobs/{job_id}{suffix}{path}", encoded=True)
                async with http.request(method, url) as response:
                    assert response.status == 400, (suffix, method, path)
                    assert (await response.json())["error"]["code"] == "invalid_field"


# -- item 7 (jobs): cost-based admission ------------------------------------------------------

async def test_a_job_over_the_work_limit_is_refused_before_any_engine_time(server):
    """A job's own limits (the whole job's): 200,000 emoji pass the character limit but plan
    ~4x the frames of as many letters, and speed 0.25 multiplies them by 4 again; steps 64
    multiply the DiT's work by 8 over the default."""
    heavy = [({"input": "\U0001F600" * 200_000, "speed": 0.25}, "--max-job-audio-frames"),
             ({"input": "A sentence of moderate length. " * 6000, "speed": 0.25, "steps": 64}, "--max-job-frame-steps")]
    async with aiohttp.ClientSession() as http:
        for body, flag in heavy:
            async with http.post(server.url + "/v1/jobs", json=body) as response:
                assert response.status == 413, body.keys()
                error = (await response.json())["error"]
                assert error["code"] == "too_much_work" and flag in error["message"], error
        async with http.get(server.url + "/v1/jobs") as response:
            assert (await response.json())["data"] == []
    assert server.state.engine.stats().active_requests == 0


async def test_the_work_limit_is_configurable_and_counts_speed_and_steps(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", max_job_frame_steps=1000)
    text = "x" * 100  # 90 planned frames
    try:
        async with aiohttp.ClientSession() as http:
            for extra, expected in (({}, 202), ({"steps": 16}, 413), ({"speed": 0.5}, 413), ({"speed": 2.0, "steps": 16}, 202)):
                async with http.post(live.url + "/v1/jobs", json={"input": text, **extra}) as response:
                    assert response.status == expected, extra
                    body = await response.json()
                if expected == 202:
                    async with http.delete(f"{live.url}/v1/jobs/{body['id']}") as response:
                        assert response.status in (200, 409)
                else:
                    assert body["error"]["code"] == "too_much_work" and "1000" in body["error"]["message"]
    finally:
        await live.stop()


# -- item 10 (jobs): a bound on unfinished jobs, per key and in total -----------------------------

async def test_unfinished_jobs_are_capped_per_key_and_in_total(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", api_keys=("key-a", "key-b"), job_workers=0,
                              max_queued_jobs_per_key=2, max_queued_jobs=3)
    a = {"Authorization": "Bearer key-a"}
    b = {"Authorization": "Bearer key-b"}

    async def submit(http, headers):
        async with http.post(live.url + "/v1/jobs", json={"input": SHORT}, headers=headers) as response:
            body = await response.json()
            return response.status, body, response.headers.get("Retry-After")

    try:
        async with aiohttp.ClientSession() as http:
            first = (await submit(http, a))[1]["id"]
            assert (await submit(http, a))[0] == 202
            status, body, retry_after = await submit(http, a)
            assert (status, body["error"]["code"]) == (429, "too_many_jobs") and int(retry_after) >= 1
            assert "this key" in body["error"]["message"]
            assert (await submit(http, b))[0] == 202
            status, body, _ = await submit(http, b)  # key-b is under its own cap, the queue is full
            assert (status, body["error"]["code"]) == (429, "too_many_jobs") and "queue is full" in body["error"]["message"]
            async with http.delete(f"{live.url}/v1/jobs/{first}", headers=a) as response:
                assert response.status == 200
            assert (await submit(http, b))[0] == 202  # a finished (cancelled) job frees its place
    finally:
        await live.stop()


async def test_with_auth_off_unfinished_jobs_are_capped_per_address(engine, tmp_path):
    """Auth off: the per-key cap counts the client address (127.0.0.1 vs 127.0.0.2 on the
    loopback), and rotating fake tokens does not reset it."""
    live = await start_server(engine, tmp_path / "data", job_workers=0, max_queued_jobs_per_key=2)

    async def submit(http, token):
        async with http.post(live.url + "/v1/jobs", json={"input": SHORT},
                             headers={"Authorization": f"Bearer {token}"}) as response:
            return response.status, await response.json()

    try:
        async with aiohttp.ClientSession() as first, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as second:
            assert [(await submit(first, f"fake{i}"))[0] for i in range(2)] == [202, 202]
            status, body = await submit(first, "fake9")
            assert (status, body["error"]["code"]) == (429, "too_many_jobs")
            assert (await submit(second, "fake0"))[0] == 202  # another address has its own cap
            async with first.get(live.url + "/v1/jobs") as response:  # everyone still sees every job
                assert len((await response.json())["data"]) == 3
    finally:
        await live.stop()


async def test_a_refusing_engine_is_not_offered_the_same_job_in_a_spin(tmp_path):
    """The engine refuses work (here: never started, EngineUnavailable; under load: a full
    queue, EngineOverloaded): the runner gives the job back and waits before claiming again.
    Giving it back wakes the runner at once (the store's "queued" event), so without the wait
    it would claim and release the job hundreds of times a second."""
    idle = make_engine()  # built, not started: every submit is refused
    live = await start_server(idle, tmp_path / "data")
    try:
        store = live.state.jobs.store
        job = await store.create({"input": "Nobody can take this yet.", "response_format": "wav"})
        live.state.jobs.wake()
        await asyncio.sleep(2.0)
        again = await store.get(job.id)
        assert again.status == "queued"
        assert 1 <= again.attempts <= 10, f"{again.attempts} claims in 2 s"  # one per 0.5 s wait
    finally:
        await live.stop()
