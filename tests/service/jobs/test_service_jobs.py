"""REST jobs: lifecycle, audio read back, cancel, persistence and re-queue across restarts."""

from __future__ import annotations

import io

import aiohttp
import numpy as np
import soundfile as sf
from conftest import start_server, wait_until

from clients.client import StreamvoxClient, StreamvoxError

TEXT = " ".join(f"Paragraph sentence {i} is read aloud by the batch queue." for i in range(4))


def assert_audio(data: bytes, frames_total: int) -> None:
    audio, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == 24000
    assert audio.size == frames_total * 1920
    assert np.all(np.isfinite(audio)) and np.abs(audio).max() > 1e-3


async def test_job_goes_queued_running_succeeded_and_reads_back(server):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/jobs", json={"input": TEXT, "voice": "onyx", "seed": 5}) as response:
            assert response.status == 202
            job = await response.json()
            location = response.headers["Location"]
        assert job["status"] == "queued" and location == f"/v1/jobs/{job['id']}"
        seen = [job["status"]]
        not_ready_checked = False

        async def finished() -> bool:  # every status it passes through is seen (polled every 10 ms)
            nonlocal job, not_ready_checked
            async with http.get(server.url + location) as response:
                job = await response.json()
            if job["status"] != seen[-1]:
                seen.append(job["status"])
            progress = job["progress"]
            assert 0 <= progress["frames_done"] <= max(progress["frames_total"], 0)
            if job["status"] == "running" and not not_ready_checked:
                async with http.get(server.url + location + "/audio") as response:
                    assert response.status == 409
                    assert (await response.json())["error"]["code"] == "job_not_ready"
                not_ready_checked = True
            return seen[-1] in ("succeeded", "failed", "cancelled")

        await wait_until(finished, every_s=0.01)
        assert seen == ["queued", "running", "succeeded"]
        assert job["progress"]["frames_done"] == job["progress"]["frames_total"] > 0
        assert job["created_at"] <= job["started_at"] <= job["finished_at"]
        async with http.get(server.url + location + "/audio") as response:
            assert response.status == 200 and response.headers["Content-Type"] == "audio/wav"
            assert_audio(await response.read(), job["progress"]["frames_total"])
        async with http.get(server.url + "/v1/jobs", params={"status": "succeeded"}) as response:
            assert job["id"] in [j["id"] for j in (await response.json())["data"]]


async def test_cancel_a_job(server):
    async with StreamvoxClient(server.url) as client:
        job = await client.submit_job(TEXT * 3)
        cancelled = await client.cancel_job(job["id"])
        assert cancelled["status"] == "cancelled"
        with_error = None
        try:
            await client.fetch_audio(job["id"])
        except StreamvoxError as exc:
            with_error = exc
        assert with_error is not None and (with_error.status, with_error.code) == (409, "job_not_ready")
        try:
            await client.cancel_job(job["id"])
        except StreamvoxError as exc:
            assert (exc.status, exc.code) == (409, "job_finished")
        else:
            raise AssertionError("cancelling twice must be a 409")

        async def engine_idle():
            return server.state.engine.stats().active_requests == 0

        await wait_until(engine_idle)
        assert (await client.get_job(job["id"]))["status"] == "cancelled"


async def test_jobs_persist_and_interrupted_ones_are_requeued(engine, tmp_path):
    data_dir = tmp_path / "data"
    first = await start_server(engine, data_dir)
    try:
        async with StreamvoxClient(first.url) as client:
            done = await client.wait_job((await client.submit_job("Kept across restarts.", response_format="flac"))["id"])
            assert done["status"] == "succeeded"
    finally:
        await first.stop()
    from service.jobs.store.sqlite import SqliteJobStore

    # A job the next start must pick up: claimed by a runner that died with it (long lease).
    store = SqliteJobStore(data_dir)
    await store.open()
    interrupted = (await store.create({"input": "Interrupted work.", "response_format": "wav"})).to_json()
    assert [job.id for job in await store.claim("dead-replica", 1, 3600.0)] == [interrupted["id"]]
    await store.close()

    second = await start_server(engine, data_dir)
    try:
        async with StreamvoxClient(second.url) as client:
            kept = await client.get_job(done["id"])
            assert kept["status"] == "succeeded"
            assert_audio(await client.fetch_audio(done["id"]), kept["progress"]["frames_total"])
            redone = await client.wait_job(interrupted["id"])
            assert redone["status"] == "succeeded"
            assert_audio(await client.fetch_audio(interrupted["id"]), redone["progress"]["frames_total"])
    finally:
        await second.stop()


async def test_a_dit_jobs_progress_moves_inside_its_one_utterance(server):
    """The DiT speaks a job as one utterance: its progress still moves while it runs (frames, the
    audio made so far, a percentage, the time left), from a plan the first answer already has, and
    the list shows what a poll shows. (Before: 0/0 frames for the first seconds, then ``utterances
    0/1`` and ``audio_seconds 0.0`` until it ended.)"""
    from testsupport.long_text import long_text

    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/jobs", json={"input": long_text(2000), "seed": 3}) as response:
            posted = await response.json()
        assert posted["progress"]["utterances_total"] == 1 and posted["progress"]["frames_total"] > 0
        polls: list[dict] = []

        async def finished() -> bool:
            async with http.get(f"{server.url}/v1/jobs/{posted['id']}") as response:
                polls.append(await response.json())
            return polls[-1]["status"] in ("succeeded", "failed", "cancelled")

        await wait_until(finished, timeout_s=300, every_s=0.05)
        job = polls[-1]
        assert job["status"] == "succeeded", job
        final = job["progress"]
        running = [poll["progress"] for poll in polls if poll["status"] == "running"]
        moving = [p for p in running if 0 < p["frames_done"] < final["frames_done"]]
        assert len({p["frames_done"] for p in moving}) >= 2, running
        assert all(0 < p["audio_seconds"] <= final["audio_seconds"] and 0 < p["percent"] < 100 for p in moving), moving
        assert [p["frames_done"] for p in running] == sorted(p["frames_done"] for p in running)
        assert any(p["seconds_left"] is not None for p in moving)
        assert (final["frames_done"], final["percent"], final["seconds_left"]) == (final["frames_total"], 100.0, 0.0)
        async with http.get(server.url + "/v1/jobs") as response:
            [listed] = [j for j in (await response.json())["data"] if j["id"] == job["id"]]
        assert listed == job
