"""--jobs-disk-quota-mb holds while jobs run, not only when they are created: several long jobs
accepted under a small quota together would write several times it; the one whose next chunk
would cross it fails with ``storage_full`` naming the quota, the rest go on, and the stored job
audio never exceeds the quota. Real server, real client, the tiny engine on CPU, SQLite and a
real PostgreSQL."""

from __future__ import annotations

import asyncio

from conftest import start_server

from clients.client import StreamvoxClient

QUOTA_MB = 1.0
LONG = " ".join(["A sentence of a long job."] * 8)  # about 770 KB of WAV on the tiny engine


async def test_the_quota_holds_while_long_jobs_write(engine, store_settings, tmp_path):
    server = await start_server(engine, tmp_path / "data", jobs_disk_quota_mb=QUOTA_MB, job_workers=3,
                                **store_settings)
    limit = int(QUOTA_MB * 1024 * 1024)
    store = server.state.jobs.store
    try:
        async with StreamvoxClient(server.url) as client:
            short = await client.wait_job((await client.submit_job("A short one.", seed=1))["id"])
            assert short["status"] == "succeeded"
            short_audio = await client.fetch_audio(short["id"])
            ids = [(await client.submit_job(LONG, seed=i))["id"] for i in range(4)]  # all accepted: under the quota now
            peak = 0

            async def watch():
                nonlocal peak
                while True:
                    peak = max(peak, await store.audio_bytes())
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            try:
                jobs = [await asyncio.wait_for(client.wait_job(job_id), 300) for job_id in ids]
            finally:
                watcher.cancel()
            failed = [job for job in jobs if job["status"] == "failed"]
            succeeded = [job for job in jobs if job["status"] == "succeeded"]
            assert failed and len(failed) + len(succeeded) == 4, jobs
            for job in failed:
                assert job["error"].startswith("storage_full") and "--jobs-disk-quota-mb" in job["error"], job
            assert peak <= limit and await store.audio_bytes() <= limit, (peak, limit)
            sizes = [len(await client.fetch_audio(job["id"])) for job in succeeded]
            assert len(short_audio) + sum(sizes) <= limit
            assert await client.fetch_audio(short["id"]) == short_audio  # untouched
            after = await client.wait_job((await client.submit_job("Still running.", seed=2))["id"])
            assert after["status"] == "succeeded"  # the runner goes on within what is left
    finally:
        await server.stop()


async def test_kept_segments_count_against_the_quota(engine, store_settings, tmp_path):
    """A job keeps its audio and, while it runs, its finished segments (to resume after them):
    both count. A job whose audio alone fits the quota but whose audio and segment together do
    not fails with ``storage_full`` (before, segments were not counted: float32, twice the audio,
    beside it); what it kept is given back, and the next job runs."""
    probe = await start_server(engine, tmp_path / "probe")
    try:
        async with StreamvoxClient(probe.url) as client:
            alone = await client.wait_job((await client.submit_job(LONG, seed=7))["id"])
            audio = len(await client.fetch_audio(alone["id"]))
    finally:
        await probe.stop()
    quota_mb = 1.5 * audio / 2**20  # the audio fits; the audio and its segment (as much again) do not
    server = await start_server(engine, tmp_path / "data", jobs_disk_quota_mb=quota_mb, **store_settings)
    store = server.state.jobs.store
    try:
        async with StreamvoxClient(server.url) as client:
            job = await client.wait_job((await client.submit_job(LONG, seed=7))["id"])
            assert job["status"] == "failed" and job["error"].startswith("storage_full"), job
            assert "--jobs-disk-quota-mb" in job["error"]
            assert await store.stored_bytes() <= 1.5 * audio
            if store.kind == "sqlite":
                on_disk = sum(p.stat().st_size for p in (tmp_path / "data").rglob("*") if p.is_file())
                assert on_disk <= 1.5 * audio, on_disk
            after = await client.wait_job((await client.submit_job("A short one.", seed=1))["id"])
            assert after["status"] == "succeeded", after
    finally:
        await server.stop()
