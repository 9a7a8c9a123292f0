"""POST /v1/audio/speech through the official openai SDK and plain HTTP, on a real server."""

from __future__ import annotations

import base64
import io
import json

import aiohttp
import numpy as np
import pytest
import soundfile as sf
from conftest import wait_until
from openai import AsyncOpenAI

SHORT = "Hello there. How are you today?"
# Long enough that generation is still running when the first bytes arrive.
LONG = " ".join(f"This is sentence number {i} of a long reading." for i in range(60))


def openai_client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def assert_audible(samples: np.ndarray, min_samples: int = 4800) -> None:
    assert samples.size >= min_samples
    assert np.all(np.isfinite(samples))
    assert float(np.abs(samples).max()) > 1e-3, "audio is silent"


async def test_openai_sdk_returns_a_valid_wav(server):
    response = await openai_client(server).audio.speech.create(model="streamvox", voice="alloy", input=SHORT,
                                                               response_format="wav")
    assert response.response.headers.get("x-request-id")
    audio, rate = sf.read(io.BytesIO(response.content), dtype="float32")
    assert rate == 24000
    assert_audible(audio)


async def test_openai_sdk_streams_pcm_before_generation_finishes(server):
    engine = server.state.engine
    client = openai_client(server)
    received = bytearray()
    async with client.audio.speech.with_streaming_response.create(
            model="streamvox", voice="default", input=LONG, response_format="pcm",
            extra_body={"stream_format": "audio"}) as response:
        assert response.headers.get("x-request-id")
        async for piece in response.iter_bytes():
            received.extend(piece)
            if len(received) >= 4800:
                break
        # The request is still in the engine after the first bytes arrived, so those
        # bytes were sent while generation was in progress (progress < total).
        stats = engine.stats()
        assert stats.active_requests >= 1
    samples = np.frombuffer(bytes(received[: len(received) // 2 * 2]), dtype="<i2").astype(np.float32) / 32768
    assert_audible(samples, min_samples=2400)

    async def request_released():
        return engine.stats().active_requests == 0

    await wait_until(request_released)  # closing the response cancelled the rest of the work


async def test_streamed_pcm_body_is_complete_and_matches_sample_count(server):
    client = openai_client(server)
    async with client.audio.speech.with_streaming_response.create(
            model="streamvox", voice="echo", input=SHORT, response_format="pcm",
            extra_body={"stream_format": "audio", "seed": 3}) as response:
        body = await response.read()
    streamed = np.frombuffer(body, dtype="<i2")
    plain = await client.audio.speech.create(model="streamvox", voice="echo", input=SHORT, response_format="pcm",
                                             extra_body={"seed": 3})
    whole = np.frombuffer(plain.content, dtype="<i2")
    assert streamed.size == whole.size  # same request, same seed: same length streamed or not
    assert_audible(streamed.astype(np.float32) / 32768)


async def test_sse_sends_deltas_then_done_with_usage(server):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/audio/speech",
                             json={"input": SHORT, "response_format": "pcm", "stream_format": "sse"}) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            text = await response.text()
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert events[-1]["usage"]["output_samples"] == len(pcm) // 2
    assert_audible(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768)


@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus"])
async def test_compressed_formats_decode(server, fmt):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/audio/speech", json={"input": "Short one.", "response_format": fmt}) as r:
            assert r.status == 200, await r.text()
            data = await r.read()
    audio, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == 24000
    assert_audible(audio, min_samples=2000)


async def test_ulaw_is_8khz_mulaw(server):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/audio/speech", json={"input": SHORT, "response_format": "ulaw"}) as r:
            ulaw = await r.read()
            assert r.headers["Content-Type"] == "audio/basic"
        async with http.post(server.url + "/v1/audio/speech", json={"input": SHORT, "response_format": "pcm"}) as r:
            pcm = np.frombuffer(await r.read(), dtype="<i2")
    audio, _ = sf.read(io.BytesIO(ulaw), format="RAW", subtype="ULAW", samplerate=8000, channels=1, dtype="float32")
    assert abs(audio.size - pcm.size / 3) <= 16  # 24 kHz -> 8 kHz
    assert_audible(audio, min_samples=1600)
