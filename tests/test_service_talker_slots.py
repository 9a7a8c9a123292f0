"""``streamvox serve --max-slots 32`` on a talker checkpoint: 32 concurrent WebSocket
sessions are served, and the worker batches more than 8 of them in one tick (the old
talker default), as ``/metrics`` and ``/v1/models`` show.

The server is the real one (``service.server.serve``, settings parsed from the flags),
in-process on an ephemeral port, on the tiny random talker fixture (official layout)."""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
import pytest
import websockets

from service.server import serve
from service.settings import add_arguments, from_args
from tests.oracle import talker_fixtures as fx

SESSIONS = 32
TEXT = "Hello there."


def settings_from_flags(*flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(list(flags)), env={})


async def one_session(url: str, go: asyncio.Event, created: list) -> dict:
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/stream", max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        created.append(1)
        await go.wait()  # every session submits at once
        await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
        await ws.send(json.dumps({"type": "input.done"}))
        done, audio_bytes = None, 0
        while True:
            message = await asyncio.wait_for(ws.recv(), timeout=240)
            if isinstance(message, bytes):
                audio_bytes += len(message)
                continue
            event = json.loads(message)
            assert event["type"] != "error", event
            if event["type"] == "audio.done":
                done = event
            if event["type"] == "session.done":
                return {"done": done, "audio_bytes": audio_bytes}


@pytest.mark.timeout(600)
async def test_max_slots_32_batches_more_than_8_talker_sessions(tmp_path):
    checkpoint = fx.checkpoint_dir("cv_proj")
    settings = settings_from_flags("--preset", "tiny", "--device", "cpu", "--checkpoint", str(checkpoint),
                                   "--max-slots", str(SESSIONS), "--host", "127.0.0.1", "--port", "0",
                                   "--data-dir", str(tmp_path / "data"), "--log-level", "warning")
    stop = asyncio.Event()
    listening = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(settings, stop=stop, listening=listening))
    try:
        url = await asyncio.wait_for(asyncio.shield(listening), timeout=300)
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/v1/models") as response:
                model = (await response.json())["data"][0]
            assert (model["pipeline"], model["slots"], model["backend"]) == ("talker", SESSIONS, "torch")

            go, created = asyncio.Event(), []
            sessions = [asyncio.create_task(one_session(url, go, created)) for _ in range(SESSIONS)]
            while len(created) < SESSIONS:
                await asyncio.sleep(0.02)
                for task in sessions:
                    if task.done():
                        task.result()  # a failed connection fails the test now
            go.set()
            results = await asyncio.gather(*sessions)
            for result in results:
                assert result["done"] is not None and "error" not in result["done"]
                assert result["done"]["samples"] > 0 and result["audio_bytes"] == 2 * result["done"]["samples"]

            async with http.get(url + "/metrics") as response:
                metrics = await response.text()
        most_rows = next(float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith("streamvox_tick_batch_rows_max "))
        over_8 = [line for line in metrics.splitlines() if line.startswith("streamvox_tick_batch_rows_bucket")]
        le_8 = next(float(line.split()[-1]) for line in over_8 if 'le="8.0"' in line)
        total = next(float(line.split()[-1]) for line in over_8 if 'le="+Inf"' in line)
        assert most_rows > 8, metrics
        assert total > le_8  # the histogram agrees: some tick had more than 8 rows
        assert most_rows <= SESSIONS
    finally:
        stop.set()
        assert await asyncio.wait_for(server, timeout=120) == 0
