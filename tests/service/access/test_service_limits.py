"""Limits, each with its own error: rate per key, sessions per key, job disk quota, retention,
and a failed audio write."""

from __future__ import annotations

import json
import shutil

import aiohttp
import pytest
import websockets
from conftest import start_server, wait_until

from clients.client import StreamvoxClient


async def post_status(http, url, headers=None):
    async with http.post(url + "/v1/jobs", json={"input": ""}, headers=headers) as response:
        body = await response.json()
        return response.status, body["error"]["code"], response.headers.get("Retry-After")


async def test_rate_limit_per_key(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", api_keys=("key-a", "key-b"), rate_limit=0.5, rate_burst=2)
    try:
        a = {"Authorization": "Bearer key-a"}
        async with aiohttp.ClientSession() as http:
            # Validation errors still cost a token: the limit is on attempts, not successes.
            assert (await post_status(http, live.url, a))[:2] == (400, "invalid_field")
            assert (await post_status(http, live.url, a))[:2] == (400, "invalid_field")
            status, code, retry_after = await post_status(http, live.url, a)
            assert (status, code) == (429, "rate_limited") and int(retry_after) >= 1
            # Another key has its own bucket.
            assert (await post_status(http, live.url, {"Authorization": "Bearer key-b"}))[:2] == (400, "invalid_field")
            async with http.get(live.url + "/readyz") as response:
                assert response.status == 200  # probes are never limited
    finally:
        await live.stop()


async def test_concurrent_sessions_per_key(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", max_sessions_per_key=1)
    try:
        first = await websockets.connect(live.ws_url)
        assert json.loads(await first.recv())["type"] == "session.created"
        async with websockets.connect(live.ws_url) as second:
            reply = json.loads(await second.recv())
            assert (reply["type"], reply["code"]) == ("error", "too_many_sessions")
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await second.recv()
            assert closed.value.rcvd.code == 1008
        await first.close()

        async def slot_free():
            async with websockets.connect(live.ws_url) as third:
                return json.loads(await third.recv())["type"] == "session.created"

        await wait_until(slot_free)
    finally:
        await live.stop()


@pytest.mark.parametrize("jobs_db", ["sqlite", "postgresql"])
async def test_job_disk_quota_and_retention(engine, tmp_path, request, jobs_db):
    """The quota counts what the jobs keep where it is stored (audio files and the database, or the
    database's chunks and records): a server restarted with a quota below what a finished job holds
    refuses new jobs until retention frees it."""
    shared = {"jobs_db": request.getfixturevalue("pg_url")} if jobs_db == "postgresql" else {}
    live = await start_server(engine, tmp_path / "data", **shared)
    try:
        async with StreamvoxClient(live.url) as client:
            job = await client.wait_job((await client.submit_job("Fills the quota."))["id"])
            assert job["status"] == "succeeded"
            audio = len(await client.fetch_audio(job["id"]))
        kept = await live.state.jobs.store.stored_bytes()
    finally:
        await live.stop()
    quota_mb = (kept - audio // 2) / 2**20  # under what is kept, over what is kept without the audio
    live = await start_server(engine, tmp_path / "data", jobs_disk_quota_mb=quota_mb, job_ttl_hours=0.5 / 3600,
                              **shared)
    try:
        async with StreamvoxClient(live.url) as client:
            async with aiohttp.ClientSession() as http:
                async with http.post(live.url + "/v1/jobs", json={"input": "No room."}) as response:
                    assert response.status == 507
                    assert (await response.json())["error"]["code"] == "storage_full"

                async def expired():
                    async with http.get(live.url + f"/v1/jobs/{job['id']}") as response:
                        return response.status == 404

                await wait_until(expired)  # retention removed the record and its audio
            assert await live.state.jobs.store.audio_bytes() == 0
            if jobs_db == "sqlite":
                assert not list((tmp_path / "data" / "audio").iterdir())
            assert (await client.submit_job("Room again."))["status"] == "queued"
    finally:
        await live.stop()


async def test_failed_audio_write_fails_the_job_with_a_reason(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data")
    try:
        audio_dir = tmp_path / "data" / "audio"
        shutil.rmtree(audio_dir)
        audio_dir.write_text("not a directory")  # every write below it now fails in the OS
        async with StreamvoxClient(live.url) as client:
            job = await client.wait_job((await client.submit_job("Nowhere to go."))["id"])
            assert job["status"] == "failed"
            assert job["error"].startswith("could not write audio")
            assert await client.ready()
    finally:
        await live.stop()
