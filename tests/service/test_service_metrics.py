"""/metrics exposes where the worker thread's time goes, per loop stage."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from conftest import start_server
from prometheus_client.parser import text_string_to_metric_families

STAGES = {"deliver", "plan", "admit", "tick", "vocalize", "align", "decode"}


async def stage_seconds(http, url) -> dict[str, float]:
    async with http.get(url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "streamvox_worker_stage_seconds"]
    assert family.type == "counter"
    return {s.labels["stage"]: s.value for s in family.samples if s.name.endswith("_total")}


async def test_worker_stage_seconds_grow_with_work(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            before = await stage_seconds(http, live.url)
            assert set(before) == STAGES
            async with http.post(live.url + "/v1/audio/speech",
                                 json={"model": "streamvox", "input": "Count the stages.", "voice": "alloy",
                                       "response_format": "pcm"}) as response:
                assert response.status == 200 and len(await response.read()) > 0
            after = await stage_seconds(http, live.url)
        for stage in ("plan", "tick", "vocalize", "decode"):
            assert after[stage] > before[stage], stage
        assert all(after[s] >= before[s] for s in STAGES)
    finally:
        await live.stop()


async def test_a_stalled_event_loop_shows_in_its_lag(engine, tmp_path):
    """The server's event loop watches itself: a 0.3 s stall (this test's server shares the test's
    loop, so blocking the test blocks the server) shows in the longest lag /metrics reports."""
    import time

    from conftest import metric_value

    live = await start_server(engine, tmp_path / "data")
    try:
        await asyncio.sleep(0.1)  # the watch is running
        time.sleep(0.3)  # noqa: ASYNC251 - the stall under test
        await asyncio.sleep(0.05)
        # the watch's timer was due at most one period into the stall: at least 0.28 s late
        assert await metric_value(live.url, "streamvox_event_loop_lag_max_seconds") >= 0.28
        assert await metric_value(live.url, "streamvox_event_loop_lag_seconds_count") > 0
    finally:
        await live.stop()


@pytest.mark.parametrize("flag, loop", [((), "uvloop"), (("--event-loop", "asyncio"), "asyncio")])
async def test_serve_runs_its_event_loop_on_uvloop_unless_told_otherwise(tmp_path, flag, loop):
    """uvloop by default (its socket calls keep the GIL: under a flood the loop lagged 108 ms on
    asyncio's loop, 73 ms on uvloop's; benchmarks/RESULTS.md), asyncio's own loop on request; both serve."""
    from conftest import serving

    with serving(tmp_path / "data", *flag) as server:
        async with aiohttp.ClientSession() as http:
            async with http.get(server.url + "/healthz") as response:
                assert response.status == 200
        assert f"(event loop: {loop})" in server.log


async def test_a_serving_process_hands_the_gil_back_within_half_a_millisecond(tmp_path):
    """The event loop gives up the GIL at every socket call and waits to win it back from the
    engine's threads: ``serve`` shortens Python's switch interval (5 ms by default) so that a loop
    turn with hundreds of sockets is not hundreds of 5 ms waits (benchmarks/RESULTS.md)."""
    import sys

    from conftest import make_engine

    from service.server import GIL_SWITCH_INTERVAL_S, serve
    from service.settings import Settings

    default = sys.getswitchinterval()
    engine = await asyncio.to_thread(make_engine)
    await asyncio.to_thread(engine.start)
    stop = asyncio.Event()
    listening = asyncio.get_running_loop().create_future()
    settings = Settings(host="127.0.0.1", port=0, preset="tiny", device="cpu", data_dir=tmp_path / "data")
    server = asyncio.create_task(serve(settings, engine=engine, stop=stop, listening=listening))
    try:
        await asyncio.wait_for(listening, 60)
        assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S <= 0.0005
    finally:
        stop.set()
        assert await asyncio.wait_for(server, 60) == 0
        sys.setswitchinterval(default)
