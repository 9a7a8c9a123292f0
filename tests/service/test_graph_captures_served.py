"""Serving never captures a CUDA graph after start: every bucket a request can reach is captured
before /readyz, since a capture while streams play stalls all of them (on an H200, 330-900 ms each).

On this CPU the talker step runs through the same static buckets eagerly
(``STREAMVOX_STATIC_STEP_ON_CPU``), and the graph cache keeps the same books: a key first used
after start is what a GPU would have captured then, counted in
``streamvox_graph_captures_after_start_total``. 50 requests of mixed lengths, batch sizes and
sampling modes leave it at 0; a moved step buffer (which drops every graph) shows it counting.
Real server, real HTTP clients.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from conftest import start_server
from prometheus_client.parser import text_string_to_metric_families

from engines.build import build_engine
from engines.config import EngineConfig, RuntimeSwitches
from engines.runtime.graphed_talker import GraphedTalkerStep
from tests.oracle import talker_fixtures as fx

WORDS = "the quick brown fox jumps over a lazy dog while every stream keeps playing".split()


@pytest.fixture(scope="module")
def static_step_engine():
    engine = build_engine(EngineConfig.for_tests(checkpoint=str(fx.checkpoint_dir("cv_proj")), warmup=False,
                                                 max_slots=8, switches=RuntimeSwitches(static_step_on_cpu=True)))
    engine.start()
    yield engine
    engine.stop()


async def captures_after_start(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    [value] = [s.value for f in text_string_to_metric_families(text) if f.name == "streamvox_graph_captures_after_start"
               for s in f.samples if s.name.endswith("_total")]
    return value


def mixed_requests(n: int) -> list[dict]:
    rng = random.Random(0)
    bodies = []
    for i in range(n):
        body = {"input": " ".join(rng.choices(WORDS, k=rng.randint(1, 40))) + ".", "seed": i, "stream": False,
                "max_new_tokens": rng.randint(2, 90), "response_format": "pcm"}
        mode = i % 3  # greedy, sampled, sampled with top-p: the three step modes
        body.update({0: {"temperature": 0}, 1: {}, 2: {"top_p": 0.8}}[mode])
        bodies.append(body)
    return bodies


async def test_fifty_mixed_requests_capture_no_graph_after_start(static_step_engine, tmp_path):
    runner = static_step_engine.pipeline.source.step_runner
    assert isinstance(runner, GraphedTalkerStep), "the CPU step should run through the static buckets"
    live = await start_server(static_step_engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            assert await captures_after_start(http, live.url) == 0
            sem = asyncio.Semaphore(12)  # more than the 8 slots: rows buckets from 1 to 8 all occur

            async def speak(body: dict) -> int:
                async with sem, http.post(live.url + "/v1/audio/speech", json=body) as response:
                    assert response.status == 200, await response.text()
                    return len(await response.read())

            sizes = await asyncio.gather(*(speak(b) for b in mixed_requests(50)))
            assert all(sizes), "every request spoke"
            assert await captures_after_start(http, live.url) == 0

            # The books can count: a moved step buffer drops every graph (a GPU captures each again).
            source = static_step_engine.pipeline.source
            source.state.ensure_trail(source.state.trail.shape[1] * 2)
            await speak({"input": "Hello again.", "max_new_tokens": 4, "temperature": 0})
            assert await captures_after_start(http, live.url) >= 1
    finally:
        await live.stop()
