"""The vllm-omni socket sends each sentence as one file: a long sentence's encode (mp3 of a few
minutes takes seconds) runs off the event loop, so ``/healthz`` keeps answering meanwhile.

Real server on 127.0.0.1, real WebSocket and HTTP clients; the audio is read back with soundfile.
"""

from __future__ import annotations

import asyncio
import io
import json
import time

import aiohttp
import soundfile as sf
import websockets
from conftest import start_server
from ws_helpers import read_until_session_done

OMNI = "/v1/audio/speech/stream"
# Generous: both cores may be busy. Encoding on the loop froze /healthz for the whole encode
# (6.5 s for this sentence); scheduler noise on a loaded machine reaches a few hundred ms.
HEALTHZ_BUDGET_S = 1.0
# ~1,260 planned frames (~100 s of audio) in one sentence: its mp3 takes ~3.5 s to encode here.
LONG_SENTENCE = "word " * 280


async def healthz_latencies(url: str, stop: asyncio.Event) -> list[float]:
    """/healthz round trips, one after another, until ``stop`` is set."""
    latencies = []
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/healthz") as response:  # not measured: the client's first connection
            await response.read()
        while not stop.is_set():
            started = time.perf_counter()
            async with http.get(url + "/healthz") as response:
                assert response.status == 200
                await response.read()
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.02)
    return latencies


async def test_a_long_mp3_sentence_leaves_healthz_responsive(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data")
    stop = asyncio.Event()
    probe = asyncio.create_task(healthz_latencies(live.url, stop))
    try:
        async with websockets.connect(live.url.replace("http", "ws") + OMNI, max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.config", "response_format": "mp3", "steps": 1}))
            await ws.send(json.dumps({"type": "input.text", "text": LONG_SENTENCE}))
            await ws.send(json.dumps({"type": "input.done"}))
            read = await read_until_session_done(ws, timeout_s=300)
        stop.set()
        latencies = await probe
    finally:
        stop.set()
        await asyncio.gather(probe, return_exceptions=True)
        await live.stop()
    done, audio = read.last("audio.done"), read.audio
    assert done is not None and not done["error"] and done["total_bytes"] == len(audio)
    samples, rate = sf.read(io.BytesIO(audio))
    assert rate == 24000 and len(samples) / rate > 60, len(samples) / rate  # a long sentence indeed
    assert len(latencies) > 20, latencies
    assert max(latencies) < HEALTHZ_BUDGET_S, sorted(latencies)[-5:]
