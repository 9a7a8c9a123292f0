"""`streamvox migrate-store`: an embedded store's saved voices and REST jobs move into PostgreSQL,
and a server on the database serves them as the embedded one did (same ids, same audio bytes).
Run as the real command (a subprocess) against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import numpy as np
from conftest import REPO, start_server

from clients.client import StreamvoxClient
from service.voices.store import FileVoiceStore, SavedVoice


async def migrate(data_dir, url: str, *extra: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "clients.cli", "migrate-store", "--data-dir", str(data_dir), "--jobs-db", url, *extra,
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode, out.decode(), err.decode()


async def test_migrate_store_moves_voices_and_jobs_into_postgres(engine, tmp_path, pg_url):
    data_dir = tmp_path / "embedded"
    embedded = await start_server(engine, data_dir)
    try:
        async with StreamvoxClient(embedded.url) as client:
            done = await client.wait_job((await client.submit_job("Moved with its audio.", seed=5))["id"])
            flac = await client.wait_job((await client.submit_job("A flac one.", response_format="flac"))["id"])
            cancelled = await client.submit_job(" ".join(["A long one that is cancelled."] * 30))
            await client.cancel_job(cancelled["id"])
            audio = {job["id"]: await client.fetch_audio(job["id"]) for job in (done, flac)}
            before = {job["id"]: job for job in await client.list_jobs()}
    finally:
        await embedded.stop()
    rng = np.random.default_rng(1)
    await FileVoiceStore(data_dir / "voices").add(SavedVoice(
        name="alice", xvector=rng.standard_normal(16).astype(np.float32), codes=rng.integers(0, 64, (5, 4)),
        ref_text="Hello.", consent="yes"))

    code, out, err = await migrate(data_dir, pg_url)
    assert code == 0, err
    assert "voices: 1 copied, 0 already there; jobs: 3 copied, 0 already there" in out, out
    code, out, err = await migrate(data_dir, pg_url)  # again: nothing twice
    assert code == 0 and "voices: 0 copied, 1 already there; jobs: 0 copied, 3 already there" in out, (out, err)

    shared = await start_server(engine, tmp_path / "replica", jobs_db=pg_url, job_workers=0)
    try:
        async with StreamvoxClient(shared.url) as client:
            after = {job["id"]: job for job in await client.list_jobs()}
            assert after == before  # the same ids, statuses, times, progress and errors
            for job_id, data in audio.items():
                assert await client.fetch_audio(job_id) == data
        async with aiohttp.ClientSession() as http:
            async with http.get(shared.url + "/v1/audio/voices") as response:
                voices = (await response.json())["uploaded_voices"]
        assert [(v["name"], v["ref_text"], v["reference_frames"]) for v in voices] == [("alice", "Hello.", 5)]
    finally:
        await shared.stop()


async def test_migrate_store_refuses_what_it_cannot_use(tmp_path, postgres):
    code, _, err = await migrate(tmp_path / "nothing-here", postgres.url())
    assert code == 2 and "holds no job store" in err
    (tmp_path / "voices").mkdir()
    code, _, err = await migrate(tmp_path, "postgresql://u:secret@127.0.0.1:1/db")
    assert code == 2 and "no password on the command line" in err and "secret" not in err
    code, _, err = await migrate(tmp_path, f"postgresql://streamvox@127.0.0.1:{postgres.port + 1}/postgres")
    assert code == 1 and "unreachable" in err
