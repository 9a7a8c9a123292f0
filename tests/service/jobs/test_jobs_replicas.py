"""Two real ``streamvox serve`` processes on one PostgreSQL database: any replica serves any job.

A job submitted to one replica is listed, polled and downloaded through the other; 40 jobs
submitted across both succeed exactly once (counted by the audio each replica wrote into the
store, not only by status); DELETE on one replica stops the job where it runs; ``kill -9`` of
the replica running a job hands it to the other once its lease expires, and the audio that
comes out is whole.

The replicas run with a 3 s lease so that a takeover happens within the test's time.
"""

from __future__ import annotations

import asyncio
import io
import time

import aiohttp
import asyncpg
import numpy as np
import pytest
import soundfile as sf
from conftest import ServerProcess, metric_value, wait_until

from clients.client import StreamvoxClient
from engines.contract import SAMPLE_RATE, SAMPLES_PER_FRAME

LEASE_SECONDS = 3
LONG = " ".join(f"Sentence number {i} keeps this job busy for a while." for i in range(40))


class Replica:
    def __init__(self, process: ServerProcess):
        self.process = process
        self.url = process.url

    @property
    def pid(self) -> int:
        return self.process.proc.pid

    async def metric(self, name: str) -> float:
        return await metric_value(self.url, name)


@pytest.fixture(scope="module")
def db_url(postgres) -> str:
    return postgres.create_database()


def start_replica(db_url: str, data_dir) -> Replica:
    process = ServerProcess(data_dir, "--job-lease-seconds", str(LEASE_SECONDS), "--drain-seconds", "1",
                            env={"STREAMVOX_JOBS_DB": db_url})
    try:
        process.wait_listening()
    except BaseException:
        process.kill()
        raise
    return Replica(process)


@pytest.fixture(scope="module")
def replicas(db_url, tmp_path_factory):
    """Replicas A and B, each with its own data directory (nothing shared but the database).
    A test may replace one (the list is the fixture's); every process in it is killed at the end."""
    started: list[Replica] = []
    try:
        for name in "ab":
            started.append(start_replica(db_url, tmp_path_factory.mktemp(f"replica-{name}")))
        yield started
    finally:
        for replica in started:
            replica.process.kill()


def assert_valid_wav(data: bytes) -> np.ndarray:
    audio, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == SAMPLE_RATE and audio.size > 0 and np.abs(audio).max() > 1e-3
    return audio


async def lease_owner_pid(db_url: str, job_id: str) -> int | None:
    """The pid of the replica holding the job's lease (the worker id is host-pid-random)."""
    conn = await asyncpg.connect(db_url)
    try:
        owner = await conn.fetchval("SELECT lease_owner FROM jobs WHERE id = $1 AND status = 'running'", job_id)
    finally:
        await conn.close()
    return int(owner.split("-")[-2]) if owner else None


async def running_on(db_url: str, replicas: list[Replica], job_id: str) -> tuple[Replica, Replica]:
    """(the replica running the job, the other one), once a replica has claimed it."""
    pids: list[int | None] = [None]

    async def claimed():
        pids[0] = await lease_owner_pid(db_url, job_id)
        return pids[0] is not None

    await wait_until(claimed, timeout_s=60)
    runner = next(r for r in replicas if r.pid == pids[0])
    return runner, next(r for r in replicas if r is not runner)


async def test_a_job_submitted_to_a_is_listed_polled_and_downloaded_through_b(replicas):
    a, b = replicas
    async with StreamvoxClient(a.url) as on_a, StreamvoxClient(b.url) as on_b:
        job = await on_a.submit_job("Submitted here, fetched there.", seed=3)
        assert job["id"] in [listed["id"] for listed in await on_b.list_jobs()]
        done = await on_b.wait_job(job["id"])
        assert done["status"] == "succeeded", done
        from_b = await on_b.fetch_audio(job["id"])
        assert from_b == await on_a.fetch_audio(job["id"])  # the same bytes from either replica
        assert_valid_wav(from_b)


async def test_forty_jobs_across_both_replicas_succeed_exactly_once(replicas):
    stored = "streamvox_job_audio_stored_total"
    before = [await r.metric(stored) for r in replicas]
    succeeded_before = [await r.metric("streamvox_jobs_succeeded_total") for r in replicas]
    async with StreamvoxClient(replicas[0].url) as on_a, StreamvoxClient(replicas[1].url) as on_b:
        clients = (on_a, on_b)
        jobs = await asyncio.gather(*(clients[i % 2].submit_job(f"Job number {i} reads one short line.", seed=i)
                                      for i in range(40)))
        finished = await asyncio.gather(*(clients[(i + 1) % 2].wait_job(job["id"]) for i, job in enumerate(jobs)))
        assert [job["status"] for job in finished] == ["succeeded"] * 40
        for job in jobs[::8]:  # a sample of the downloads, through the replica that did not take it
            assert_valid_wav(await on_b.fetch_audio(job["id"]))
    writes = [await r.metric(stored) - b for r, b in zip(replicas, before)]
    successes = [await r.metric("streamvox_jobs_succeeded_total") - b for r, b in zip(replicas, succeeded_before)]
    assert sum(writes) == 40, f"audio written {writes} times per replica for 40 jobs"
    assert sum(successes) == 40
    assert all(count > 0 for count in writes), f"one replica did every job: {writes}"


async def test_delete_through_one_replica_cancels_the_job_running_on_the_other(replicas, db_url):
    async with aiohttp.ClientSession() as http:
        async with http.post(replicas[0].url + "/v1/jobs", json={"input": LONG}) as response:
            job_id = (await response.json())["id"]
        runner, other = await running_on(db_url, replicas, job_id)
        await wait_until(lambda: _active(runner, 1), timeout_s=30)
        asked = time.monotonic()
        async with http.delete(f"{other.url}/v1/jobs/{job_id}") as response:
            assert response.status == 200
            assert (await response.json())["status"] == "cancelled"
        # the engine work stops on the replica running it (it heard the cancel by NOTIFY)
        await wait_until(lambda: _active(runner, 0), timeout_s=5)
        print(f"engine work stopped {time.monotonic() - asked:.2f} s after the DELETE on the other replica")
        async with http.get(f"{runner.url}/v1/jobs/{job_id}") as response:
            assert (await response.json())["status"] == "cancelled"
        async with http.get(f"{runner.url}/v1/jobs/{job_id}/audio") as response:
            assert response.status == 409


async def _active(replica: Replica, count: int) -> bool:
    return await replica.metric("streamvox_active_requests") == count


async def test_a_replica_shutting_down_gives_its_job_back_at_once(replicas, db_url, tmp_path):
    """SIGTERM (a rolling update, a scale-down): after its drain the replica releases the job it
    was running, and the other claims it as a queued job, with no lease to wait out."""
    async with aiohttp.ClientSession() as http:
        async with http.post(replicas[0].url + "/v1/jobs", json={"input": LONG}) as response:
            job_id = (await response.json())["id"]
        leaving, staying = await running_on(db_url, replicas, job_id)
        first = await metric_value(staying.url, "streamvox_job_claims_total", '{kind="first"}')
        leaving.process.terminate()
        assert await asyncio.to_thread(leaving.process.wait_exit) == 0

        async def reclaimed():
            return await lease_owner_pid(db_url, job_id) == staying.pid

        await wait_until(reclaimed, timeout_s=30)
        assert await metric_value(staying.url, "streamvox_job_claims_total", '{kind="first"}') == first + 1
        assert await metric_value(staying.url, "streamvox_job_claims_total", '{kind="takeover"}') == 0
        async with http.delete(f"{staying.url}/v1/jobs/{job_id}") as response:
            assert response.status == 200  # no need to spend CPU finishing it
    replicas[replicas.index(leaving)] = start_replica(db_url, tmp_path / "replacement")


async def test_kill_9_of_the_replica_running_a_job_hands_it_to_the_other(replicas, db_url):
    """Runs last in this module: it kills one of the two replicas."""
    async with aiohttp.ClientSession() as http:
        async with http.post(replicas[1].url + "/v1/jobs", json={"input": LONG, "seed": 7}) as response:
            job_id = (await response.json())["id"]
        victim, survivor = await running_on(db_url, replicas, job_id)

        async def progressed():
            async with http.get(f"{survivor.url}/v1/jobs/{job_id}") as response:
                return (await response.json())["progress"]["frames_done"] > 0

        await wait_until(progressed, timeout_s=60)  # mid-job: audio has been produced
        victim.process.proc.kill()  # SIGKILL: no release, no cleanup; only the lease's expiry tells
        killed = time.monotonic()
        assert await asyncio.to_thread(victim.process.wait_exit) == -9

        async def taken_over():
            return await lease_owner_pid(db_url, job_id) == survivor.pid

        await wait_until(taken_over, timeout_s=LEASE_SECONDS + 30)
        takeover_s = time.monotonic() - killed
        assert takeover_s >= LEASE_SECONDS - 1  # not before the lease could have expired
        async with StreamvoxClient(survivor.url) as client:
            done = await client.wait_job(job_id)
            assert done["status"] == "succeeded", done
            audio = assert_valid_wav(await client.fetch_audio(job_id))
            # the same job run through on the survivor: the resumed file is its audio (<= 1 LSB)
            again = await client.submit_job(LONG, seed=7)
            assert (await client.wait_job(again["id"]))["status"] == "succeeded"
            uninterrupted = assert_valid_wav(await client.fetch_audio(again["id"]))
    assert audio.shape == uninterrupted.shape
    assert np.abs(audio - uninterrupted).max() <= 1 / 32768
    progress = done["progress"]
    # Whole: every frame the finished attempt produced is in the file, nothing of the dead one.
    assert progress["frames_done"] == progress["frames_total"] > 0
    assert audio.size == progress["frames_done"] * SAMPLES_PER_FRAME
    conn = await asyncpg.connect(db_url)
    try:
        attempts = await conn.fetchval("SELECT attempts FROM jobs WHERE id = $1", job_id)
    finally:
        await conn.close()
    assert attempts == 2
    assert await metric_value(survivor.url, "streamvox_job_claims_total", '{kind="takeover"}') == 1
    print(f"taken over {takeover_s:.1f} s after kill -9 (lease {LEASE_SECONDS} s)")


async def test_one_leader_exports_the_shared_queue_and_a_successor_takes_over(engine, tmp_path, pg_url):
    """The autoscaler averages streamvox_queue_depth over pods: the shared job queue must be
    counted once, by one replica. Replicas with no job workers leave 3 jobs queued."""
    from conftest import start_server

    servers = [await start_server(engine, tmp_path / name, jobs_db=pg_url, job_workers=0) for name in "ab"]
    try:
        async with StreamvoxClient(servers[0].url) as client:
            for i in range(3):
                await client.submit_job(f"Waiting job {i}.")

        async def exported() -> list[float]:
            return [await metric_value(s.url, "streamvox_jobs_queued") for s in servers]

        async def one_leader():
            return sorted(await exported()) == [0, 3]

        await wait_until(one_leader, timeout_s=15)
        leader = next(s for s, value in zip(servers, await exported()) if value == 3)
        assert await metric_value(leader.url, "streamvox_queue_depth") == 3  # the HPA's metric includes it
        follower = next(s for s in servers if s is not leader)
        await leader.stop()
        servers.remove(leader)

        async def successor():
            return await metric_value(follower.url, "streamvox_jobs_queued") == 3

        await wait_until(successor, timeout_s=15)
    finally:
        for server in servers:
            await server.stop()
