"""OpenAI and vllm-omni conformance of POST /v1/audio/speech, through the official openai
SDK and plain HTTP on a real server: streamed by default, ``stream``, OpenAI usage names,
aac, ``voice`` as an object, model names, ``sample_rate``."""

from __future__ import annotations

import base64
import io
import json
import math
import time

import aiohttp
import av
import numpy as np
import pytest
import soundfile as sf
from conftest import start_server
from openai import AsyncOpenAI

SHORT = "Hello there. How are you today?"
LONG = " ".join(f"This is sentence number {i} of a long reading." for i in range(40))
SPEECH = "/v1/audio/speech"


def client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """Any container FFmpeg reads (mp3, ogg/opus, adts/aac), as float32 mono and its rate."""
    with av.open(io.BytesIO(data)) as container:
        rate = container.streams.audio[0].rate
        frames = [frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)]
    return np.concatenate(frames).astype(np.float32), rate


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768


async def test_openai_sdk_streams_by_default_without_extra_arguments(server):
    """The README's snippet: no stream_format, default format (mp3). The first bytes come
    while the engine is still generating, long before the last."""
    engine = server.state.engine
    arrivals: list[tuple[float, int]] = []
    body = bytearray()
    start = time.monotonic()
    first_while_generating = None
    async with client(server.url).audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=LONG) as response:
        assert response.headers["content-type"] == "audio/mpeg"
        async for piece in response.iter_bytes():
            if first_while_generating is None:
                first_while_generating = engine.stats().active_requests >= 1
            arrivals.append((time.monotonic() - start, len(piece)))
            body.extend(piece)
    assert first_while_generating, "the first bytes arrived only after generation had finished"
    assert len(arrivals) >= 3
    first, last = arrivals[0][0], arrivals[-1][0]
    assert first < 0.5 * last, (first, last)  # a long text: the first bytes well before the last
    audio, rate = decode(bytes(body))
    assert rate == 24000 and audio.size > 24000 and float(np.abs(audio).max()) > 1e-3


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac"])
async def test_streamed_compressed_formats_decode_to_the_same_length(server, fmt):
    reference = await client(server.url).audio.speech.create(model="streamvox", voice="default", input=SHORT,
                                                             response_format="pcm")
    samples = pcm16(reference.content).size
    response = await client(server.url).audio.speech.create(model="streamvox", voice="default", input=SHORT,
                                                            response_format=fmt)
    audio, rate = decode(response.content)
    assert rate in (24000, 48000)
    expected = samples * rate // 24000
    # encoder priming and padding: mp3 ~1,105 samples, aac 1,024 per side, opus 312 at 48 kHz; 2,400 bounds them
    assert abs(audio.size - expected) <= 2400 * rate // 24000, (audio.size, expected)
    if fmt != "aac":
        assert sf.info(io.BytesIO(response.content)).samplerate in (24000, 48000)  # libsndfile reads it too


async def test_sse_done_carries_openai_usage_names(server):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + SPEECH, json={"input": SHORT, "response_format": "pcm", "stream": True}) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            events = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    done = events[-1]
    assert done["type"] == "speech.audio.done" and deltas
    samples = sum(len(base64.b64decode(e["audio"])) for e in deltas) // 2
    usage = done["usage"]
    assert usage["input_tokens"] == len(SHORT)
    assert usage["output_tokens"] == math.ceil(samples / 1920)  # codec frames, 12.5 per second
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


async def test_stream_false_is_one_whole_file_and_flac_is_never_chunked(server):
    async with aiohttp.ClientSession() as http:
        for body in ({"input": SHORT, "response_format": "wav", "stream": False}, {"input": SHORT, "response_format": "flac"}):
            async with http.post(server.url + SPEECH, json=body) as r:
                assert r.status == 200
                assert "Content-Length" in r.headers and r.headers.get("Transfer-Encoding") is None
                audio, rate = sf.read(io.BytesIO(await r.read()))
                assert rate == 24000 and audio.size > 4800
        async with http.post(server.url + SPEECH, json={"input": SHORT, "response_format": "wav"}) as r:
            assert r.headers.get("Transfer-Encoding") == "chunked"  # OpenAI's default: streamed


async def test_voice_as_an_object_is_the_same_voice(server):
    sdk = client(server.url)
    named = await sdk.audio.speech.create(model="tts-1", voice="default", input=SHORT, response_format="pcm")
    by_id = await sdk.audio.speech.create(model="tts-1", voice={"id": "default"}, input=SHORT, response_format="pcm")
    assert by_id.content == named.content and len(named.content) > 9600  # greedy: the same audio


async def test_sample_rate_resamples_with_soxr(server):
    async with aiohttp.ClientSession() as http:
        lengths = {}
        for rate in (24000, 16000, 8000, 48000):
            async with http.post(server.url + SPEECH, json={"input": SHORT, "response_format": "wav", "stream": False,
                                                            "sample_rate": rate}) as r:
                audio, got = sf.read(io.BytesIO(await r.read()))
            assert got == rate
            lengths[rate] = audio.size
    for rate in (16000, 8000, 48000):
        assert abs(lengths[rate] - lengths[24000] * rate / 24000) <= 2  # the same audio, resampled


async def test_model_accepts_openai_and_served_names(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", checkpoint="/models/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    try:
        async with aiohttp.ClientSession() as http:
            for model in ("tts-1", "gpt-4o-mini-tts", "Qwen3-TTS-12Hz-0.6B-CustomVoice",
                          "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"):
                async with http.post(live.url + SPEECH, json={"input": "Hi.", "model": model, "response_format": "pcm"}) as r:
                    assert r.status == 200, (model, await r.text())
                    await r.read()
            async with http.post(live.url + SPEECH, json={"input": "Hi.", "model": "gpt-5"}) as r:
                error = (await r.json())["error"]
                status = r.status
            async with http.get(live.url + "/v1/models") as models:
                names = (await models.json())["data"][0]["names"]
        assert "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice" in names and "tts-1" in names
        assert status == 400 and error["code"] == "invalid_field"
        assert "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice" in error["message"] and "tts-1" in error["message"]
    finally:
        await live.stop()
