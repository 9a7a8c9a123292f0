"""`streamvox serve` as a real process: CLI commands, SIGTERM drain, restart on the same data dir."""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
import sys
import time

import aiohttp
import numpy as np
import pytest
import soundfile as sf
import websockets
from conftest import REPO, ServerProcess, wait_until

from clients.client import StreamvoxClient

KEY = "lifecycle-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = " ".join(f"Sentence number {i} keeps this stream busy for a while." for i in range(50))
SECRET_TEXT = "Sentence number 7 keeps"  # must never reach the logs


async def cli(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "clients.cli", *args, cwd=REPO,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode, out.decode(), err.decode()


async def readyz_status(http, url) -> int:
    async with http.get(url + "/readyz") as response:
        return response.status


@pytest.mark.timeout(300)
async def test_cli_drain_on_sigterm_and_restart(tmp_path):
    data_dir = tmp_path / "data"
    first = ServerProcess(data_dir, "--drain-seconds", "2", env={"STREAMVOX_API_KEYS": f"{KEY},spare"})
    try:
        url = await asyncio.to_thread(first.wait_listening)
        async with aiohttp.ClientSession() as http:
            assert await readyz_status(http, url) == 200

        # --- CLI against the live server -------------------------------------------
        code, out, err = await cli("submit", "A job from the command line.", "--wait", "--url", url, "--api-key", KEY)
        assert code == 0, err
        job = json.loads(out)
        assert job["status"] == "succeeded"
        code, out, err = await cli("jobs", "--url", url, "--api-key", KEY, "--status", "succeeded")
        assert code == 0 and job["id"] in out, err
        job_file = tmp_path / "job.wav"
        code, out, err = await cli("fetch", job["id"], "--out", str(job_file), "--url", url, "--api-key", KEY)
        assert code == 0, err
        assert sf.info(str(job_file)).samplerate == 24000
        say_file = tmp_path / "say.wav"
        code, out, err = await cli("say", "Hello from the terminal. Goodbye.", "--out", str(say_file), "--url", url,
                                   "--api-key", KEY)
        assert code == 0, err
        assert "time to first audio" in out and "real-time factor" in out
        audio, rate = sf.read(str(say_file), dtype="float32")
        assert rate == 24000 and audio.size > 4800 and np.abs(audio).max() > 1e-3
        code, _, err = await cli("say", "No key.", "--out", str(tmp_path / "x.wav"), "--url", url)
        assert code == 1 and "needs an API key" in err and "--api-key" in err

        # --- drain: an in-flight stream, a job, then SIGTERM ---------------------------
        async with aiohttp.ClientSession(headers=AUTH) as http:
            async with http.post(url + "/v1/jobs", json={"input": "Interrupted or finished. Either is fine."}) as r:
                drained_job = (await r.json())["id"]
            ws = await websockets.connect(url.replace("http", "ws") + "/v1/stream", additional_headers=AUTH,
                                          max_size=None)
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "input.text", "text": LONG}))
            assert json.loads(await ws.recv())["type"] == "audio.start"
            assert isinstance(await ws.recv(), bytes)
            first.terminate()

            async def not_ready():
                return await readyz_status(http, url) == 503

            await wait_until(not_ready)
            async with http.post(url + "/v1/audio/speech", json={"input": "Too late."}) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "shutting_down"
            with pytest.raises(websockets.InvalidStatus):
                await websockets.connect(url.replace("http", "ws") + "/v1/stream", additional_headers=AUTH)
            # The stream keeps flowing during the grace period, then ends with shutting_down.
            errors = []
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    message = await ws.recv()
                    if isinstance(message, str) and json.loads(message)["type"] == "error":
                        errors.append(json.loads(message)["code"])
            assert errors == ["shutting_down"]
        assert await asyncio.to_thread(first.wait_exit) == 0
        assert "listening on http://127.0.0.1:" in first.log
        assert SECRET_TEXT not in first.log and KEY not in first.log
        with sqlite3.connect(data_dir / "jobs.sqlite3") as db:
            statuses = {row[0] for row in db.execute("SELECT status FROM jobs")}
        assert statuses <= {"queued", "succeeded"}  # nothing left "running"
    finally:
        first.kill()

    # --- restart on the same data dir -------------------------------------------------
    second = ServerProcess(data_dir, "--api-key", KEY)
    try:
        url = await asyncio.to_thread(second.wait_listening)
        async with StreamvoxClient(url, api_key=KEY) as client:
            audio, rate = sf.read(io.BytesIO(await client.fetch_audio(job["id"])), dtype="float32")
            assert rate == 24000 and audio.size > 0
            finished = await client.wait_job(drained_job)
            assert finished["status"] == "succeeded"
            assert len(await client.fetch_audio(drained_job)) > 44
        second.terminate()
        assert await asyncio.to_thread(second.wait_exit) == 0
    finally:
        second.kill()


@pytest.mark.timeout(300)
async def test_kill_9_mid_job_keeps_finished_audio_and_requeues(tmp_path):
    data_dir = tmp_path / "data"
    first = ServerProcess(data_dir)
    try:
        url = await asyncio.to_thread(first.wait_listening)
        async with StreamvoxClient(url) as client:
            finished = await client.wait_job((await client.submit_job("Finished before the crash."))["id"])
            assert finished["status"] == "succeeded"
            kept_audio = await client.fetch_audio(finished["id"])
            busy = await client.submit_job(LONG[:1500])

            async def running():
                return (await client.get_job(busy["id"]))["status"] == "running"

            await wait_until(running)
        killed_at = time.time()
        first.proc.kill()  # SIGKILL: no drain, no cleanup
        assert await asyncio.to_thread(first.wait_exit) == -9
    finally:
        first.kill()
    # Only the finished job's file; a half-written one could only be a hidden ".ID.wav.tmp".
    assert [p.name for p in (data_dir / "audio").iterdir() if not p.name.startswith(".")] == [f"{finished['id']}.wav"]

    second = ServerProcess(data_dir)
    try:
        url = await asyncio.to_thread(second.wait_listening)
        async with StreamvoxClient(url) as client:
            assert await client.fetch_audio(finished["id"]) == kept_audio
            job = await client.get_job(busy["id"])
            # Re-queued at start-up: queued again, or already restarted after the crash (a second
            # attempt); either way it keeps its first start.
            assert job["status"] == "queued" or (job["status"] == "running" and job["attempt"] == 2)
            assert job["started_at"] < killed_at
            await client.cancel_job(busy["id"])  # no need to spend CPU finishing it
        second.terminate()
        assert await asyncio.to_thread(second.wait_exit) == 0
    finally:
        second.kill()
