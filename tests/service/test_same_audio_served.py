"""The same request and seed give the same audio under the default flags (the codec decoder in its
default precision: bf16 on a CPU with native bf16), sent alone or in a crowd of 16 concurrent
requests, whose load changes the chunks each stream is decoded in: within 1 LSB of 16-bit PCM.
The scheduler sizes chunks by the step period it measures; the tiny model steps fast even in a
crowd, so the test sets the period the scheduler sees: a quiet machine's alone (chunks double from
1 frame), a loaded one's in the crowd (chunks stay at the first chunk's 4 frames, or more).

Real server (the engine built from default settings, as `streamvox serve --model DIR` builds it),
real HTTP client, the tiny talker fixture in the official layout."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from conftest import same_pcm16, start_server

from engines.hardware.cpu_features import has_native_bf16
from service.server import build_engine_for
from service.settings import Settings
from tests.oracle import talker_fixtures as fx

TEXT = "Hello world, this is a small test of streaming speech."
OTHERS = ["Numbers 2026 and 42.", "the quick brown fox jumps over the lazy dog", "Hello there.", "a small test"]


@pytest.fixture(scope="module")
def engine():
    engine = build_engine_for(Settings(checkpoint=str(fx.checkpoint_dir("cv_proj")), device="cpu", max_slots=16))
    engine.start()
    yield engine
    engine.stop()


def step_period(engine, seconds: float) -> None:
    """The scheduler sees one step every ``seconds`` from now on (its chunk sizes follow)."""
    scheduler = engine.worker.scheduler
    observe = getattr(scheduler, "real_observe", scheduler.observe)
    clock = [0.0]

    def paced(frames_produced: int, now: float | None = None) -> None:
        clock[0] += seconds
        observe(frames_produced, clock[0])

    scheduler.real_observe, scheduler.observe, scheduler.step_period = observe, paced, seconds


async def speech(http, url: str, **fields) -> bytes:
    async with http.post(url + "/v1/audio/speech", json={"input": TEXT, "response_format": "pcm", **fields}) as r:
        assert r.status == 200, await r.text()
        return await r.read()


@pytest.mark.parametrize("fields", [{"temperature": 0}, {"seed": 7}], ids=["greedy", "seeded"])
async def test_the_same_request_alone_and_in_a_crowd_of_16(engine, tmp_path, fields):
    assert engine.info.codec_dtype == ("bfloat16" if has_native_bf16() else "float32")  # the default: auto
    server = await start_server(engine, tmp_path / "data", max_streams_per_key=0)  # 16 streams from one address
    try:
        async with aiohttp.ClientSession() as http:
            step_period(engine, 0.01)  # quiet
            alone = await speech(http, server.url, **fields)
            step_period(engine, 0.12)  # loaded
            crowd = await asyncio.gather(speech(http, server.url, **fields), *(
                speech(http, server.url, seed=100 + i, input=OTHERS[i % len(OTHERS)], temperature=0.5 + i / 10)
                for i in range(15)))
            step_period(engine, 0.05)
            again = await speech(http, server.url, **fields)
    finally:
        step_period(engine, 0.05)
        await server.stop()
    assert len(alone) > 20 * 1920
    assert same_pcm16(crowd[0], alone)
    assert same_pcm16(again, alone)
