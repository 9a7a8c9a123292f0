"""``streamvox serve --max-slots 64`` on a talker checkpoint: 64 concurrent WebSocket
sessions are served, the worker batches more than 8 of them in one tick (the old talker
default), as ``/metrics`` and ``/v1/models`` show, and the paged KV pool is empty again
after. With a pool too small for them all (``--kv-cache-gb``), requests wait for blocks
(the admission-wait counter moves) and still all finish.

The server is the real one (``service.server.serve``, settings parsed from the flags),
in-process on an ephemeral port, on the tiny random talker fixture (official layout)."""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
import pytest
import websockets
from conftest import wait_until
from ws_helpers import read_until_session_done

from service.server import serve
from service.settings import add_arguments, from_args
from tests.oracle import talker_fixtures as fx

SESSIONS = 64
TEXT = "Hello there."
# No sentence end: a live utterance speaks what it has (a frame per text id, so ~40 positions:
# 3 of the pool's 8 blocks) and then waits for the rest, holding its blocks.
OPEN_TEXT = "Hello there, and then we talked about the weather, the news, the trains and the long way home and"


def settings_from_flags(*flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(list(flags)), env={})


async def one_session(url: str, go: asyncio.Event, created: list, release: asyncio.Event | None = None) -> dict:
    """``release``: the text stays open (live text: the utterance keeps its row and KV blocks
    while it waits for more) until it is set."""
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/stream", max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        created.append(1)
        await go.wait()  # every session submits at once
        await ws.send(json.dumps({"type": "input.text", "text": TEXT if release is None else OPEN_TEXT}))
        if release is not None:
            await release.wait()
        await ws.send(json.dumps({"type": "input.done"}))
        read = await read_until_session_done(ws, timeout_s=240)
        return {"done": read.last("audio.done"), "audio_bytes": len(read.audio)}


def metric(metrics: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " "))


async def run_sessions(sessions: int, *flags: str, tmp_path, hold_until_waits: bool = False) -> tuple[str, dict]:
    """Serve the tiny talker with ``flags``; ``sessions`` WebSocket sessions submit at once and
    must all finish with audio; -> the /metrics text after, and /v1/models' model.
    ``hold_until_waits``: the sessions' text stays open until the KV pool has made a request
    wait (polled on /metrics), so the pool is full however slowly the machine runs."""
    checkpoint = fx.checkpoint_dir("cv_proj")
    settings = settings_from_flags("--preset", "tiny", "--device", "cpu", "--checkpoint", str(checkpoint),
                                   "--host", "127.0.0.1", "--port", "0", "--data-dir", str(tmp_path / "data"),
                                   "--log-level", "warning", *flags)
    stop = asyncio.Event()
    listening = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(settings, stop=stop, listening=listening))
    try:
        url = await asyncio.wait_for(asyncio.shield(listening), timeout=300)
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/v1/models") as response:
                model = (await response.json())["data"][0]
            go, created = asyncio.Event(), []
            release = asyncio.Event() if hold_until_waits else None
            tasks = [asyncio.create_task(one_session(url, go, created, release)) for _ in range(sessions)]

            def check_tasks():
                for task in tasks:
                    if task.done():
                        task.result()  # a failed session fails the test now

            def all_created() -> bool:
                check_tasks()
                return len(created) >= sessions

            async def a_request_waited() -> bool:
                check_tasks()
                async with http.get(url + "/metrics") as response:
                    return metric(await response.text(), "streamvox_kv_cache_admission_waits_total") > 0

            await wait_until(all_created, timeout_s=240, every_s=0.02)
            go.set()
            if release is not None:
                await wait_until(a_request_waited, timeout_s=120, every_s=0.1)
                release.set()
            results = await asyncio.gather(*tasks)
            for result in results:
                assert result["done"] is not None and "error" not in result["done"]
                assert result["done"]["samples"] > 0 and result["audio_bytes"] == 2 * result["done"]["samples"]
            async with http.get(url + "/metrics") as response:
                metrics = await response.text()
        return metrics, model
    finally:
        stop.set()
        assert await asyncio.wait_for(server, timeout=120) == 0


@pytest.mark.timeout(600)
async def test_max_slots_64_batches_more_than_8_talker_sessions(tmp_path):
    metrics, model = await run_sessions(SESSIONS, "--max-slots", str(SESSIONS), tmp_path=tmp_path)
    assert (model["pipeline"], model["slots"], model["backend"]) == ("talker", SESSIONS, "torch")
    most_rows = metric(metrics, "streamvox_tick_batch_rows_max")
    over_8 = [line for line in metrics.splitlines() if line.startswith("streamvox_tick_batch_rows_bucket")]
    le_8 = next(float(line.split()[-1]) for line in over_8 if 'le="8.0"' in line)
    total = next(float(line.split()[-1]) for line in over_8 if 'le="+Inf"' in line)
    assert most_rows > 8, metrics
    assert total > le_8  # the histogram agrees: some tick had more than 8 rows
    assert most_rows <= SESSIONS
    assert metric(metrics, 'streamvox_kv_cache_blocks{state="used"}') == 0, "every block went back to the pool"
    assert metric(metrics, 'streamvox_kv_cache_blocks{state="total"}') > 0


@pytest.mark.timeout(600)
async def test_a_full_kv_pool_queues_requests_instead_of_failing_them(tmp_path):
    """9 blocks of 16 positions (8 usable, 8 KiB each in the fixture's fp32 talker): a session
    takes 2-3 blocks plus growth, so 8 rows cannot all run; they wait and all finish."""
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K+V x layers x positions x kv heads x head dim x fp32
    gb = 9 * block_bytes / 2**30
    metrics, _ = await run_sessions(8, "--max-slots", "8", "--kv-cache-gb", f"{gb:.12f}", tmp_path=tmp_path,
                                    hold_until_waits=True)
    assert metric(metrics, 'streamvox_kv_cache_blocks{state="total"}') == 8
    assert metric(metrics, "streamvox_kv_cache_admission_waits_total") > 0
    assert metric(metrics, "streamvox_tick_batch_rows_max") < 8, "the pool, not the rows, bounded the batch"
    assert metric(metrics, 'streamvox_kv_cache_blocks{state="used"}') == 0
