"""/metrics exposes where the worker thread's time goes, per loop stage."""

from __future__ import annotations

import aiohttp
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
