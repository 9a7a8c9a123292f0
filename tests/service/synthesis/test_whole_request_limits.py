"""The work limits hold for the whole request, however its text is cut: the frames of every
utterance (after ``speed``) and of every ``<break>`` pause count together against
``--max-work-audio-frames`` (a job: ``--max-job-audio-frames``), refused with 413
``too_much_work`` (a socket's error message) before any engine time, on every surface that takes
text: speech (streamed, SSE, one file), ``/v1/stream``, the vllm-omni socket, the ElevenLabs,
Cartesia and Deepgram sockets and HTTP calls, and jobs.

Real servers on 127.0.0.1 and real clients (aiohttp, websockets); ``engine.submit`` is wrapped
only to record that nothing reached the engine (testsupport/long_text.py ``Recorded``).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import websockets
from conftest import start_server
from dialect_helpers import CARTESIA_PATH, cartesia_request

from testsupport.long_text import Recorded, long_text

# Each piece alone is under the 49,152 frames a request may plan by default; together they are not.
EMOJI = "\U0001F600" * 1000  # 4,000 UTF-8 bytes: ~3,600 frames at speed 1, ~14,400 at 0.25
JOINED_BY_BREAKS = {"input": '<break time="0ms"/>'.join([EMOJI] * 4), "speed": 0.25, "steps": 1}
# Pauses are audio: 200 x 10 s of silence is 25,000 frames, from 3.8 KB of text.
PAUSES = "Hi." + '<break time="10s"/>' * 200
SURFACES = ["speech", "speech-sse", "speech-file", "stream", "omni", "elevenlabs", "cartesia", "deepgram",
            "elevenlabs-http", "cartesia-http", "deepgram-http"]
OMNI = "/v1/audio/speech/stream"


async def next_json(ws, timeout: float = 60.0) -> dict:
    """The next text message (audio before it fails the test: nothing may be spoken)."""
    message = await asyncio.wait_for(ws.recv(), timeout)
    assert isinstance(message, str), "audio came before the refusal"
    return json.loads(message)


async def refusal(url: str, surface: str, text: str, params: dict) -> str:
    """The error ``surface`` answers ``text`` with (its message, as JSON text), before any audio."""
    ws_url = url.replace("http://", "ws://")
    if surface.startswith("speech"):
        extra = {"speech": {"response_format": "pcm", "stream_format": "audio"},
                 "speech-sse": {"response_format": "pcm", "stream_format": "sse"},
                 "speech-file": {"response_format": "wav"}}[surface]
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/audio/speech", json={"input": text, **params, **extra}) as response:
                assert response.status == 413, (surface, response.status, await response.text())
                return await response.text()
    if surface in ("stream", "omni"):
        async with websockets.connect(ws_url + ("/v1/stream" if surface == "stream" else OMNI)) as ws:
            if surface == "stream":
                assert (await next_json(ws))["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.config", **params}))
            await ws.send(json.dumps({"type": "input.text", "text": text}))
            await ws.send(json.dumps({"type": "input.done"}))
            while (message := await next_json(ws))["type"] != "error":
                assert message["type"] not in ("audio.start", "audio.done"), message
            return json.dumps(message)
    if surface == "elevenlabs":
        async with websockets.connect(ws_url + "/v1/text-to-speech/default/stream-input?output_format=pcm_24000") as ws:
            await ws.send(json.dumps({"text": " "}))
            await ws.send(json.dumps({"text": text, "flush": True}))
            while "error" not in (message := await next_json(ws)):
                assert not message.get("audio"), "audio came before the refusal"
            return json.dumps(message)
    if surface == "cartesia":
        async with websockets.connect(ws_url + CARTESIA_PATH) as ws:
            await ws.send(cartesia_request("turn", text, more=False))
            while (message := await next_json(ws))["type"] != "error":
                assert message["type"] != "chunk", message
            return json.dumps(message)
    if surface == "deepgram":
        async with websockets.connect(ws_url + "/v1/speak?model=aura-2-default-en&encoding=linear16") as ws:
            assert (await next_json(ws))["type"] == "Metadata"
            await ws.send(json.dumps({"type": "Speak", "text": text}))
            await ws.send(json.dumps({"type": "Flush"}))
            while (message := await next_json(ws))["type"] != "Error":
                pass
            return json.dumps(message)
    path, body = {"elevenlabs-http": ("/v1/text-to-speech/default", {"text": text}),
                  "cartesia-http": ("/tts/bytes", {"transcript": text, "voice": "default", "output_format": {
                      "container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}),
                  "deepgram-http": ("/v1/speak?model=default", {"text": text})}[surface]
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body) as response:
            assert response.status == 413, (surface, response.status, await response.text())
            return await response.text()


@pytest.mark.parametrize("surface", SURFACES)
async def test_pauses_count_as_audio_on_every_surface(engine, tmp_path, surface):
    """200 ten-second breaks are 2,000 s of audio from 3.8 KB of text: over a limit of 16,384 frames
    (the default is larger: a 4,096-character Chinese text plans ~30,000) as a whole."""
    live = await start_server(engine, tmp_path / "data", job_workers=0, max_work_audio_frames=16_384)
    try:
        with Recorded(engine) as submitted:
            answer = await refusal(live.url, surface, PAUSES, {})
        assert "too_much_work" in answer.lower() and "--max-work-audio-frames" in answer, answer
        assert "25000 of pauses" in answer, answer
        assert submitted.requests == []
    finally:
        await live.stop()


@pytest.mark.parametrize("surface", ["speech", "speech-sse", "speech-file", "stream", "omni"])
async def test_text_cut_by_breaks_is_limited_as_a_whole(engine, tmp_path, surface):
    """Four pieces of 1,000 emoji at speed 0.25 plan ~14,400 frames each, 57,600 together:
    refused as one request, whether joined by a 0 ms break or not."""
    live = await start_server(engine, tmp_path / "data", job_workers=0)
    params = {"speed": 0.25, "steps": 1}
    try:
        with Recorded(engine) as submitted:
            for text in (JOINED_BY_BREAKS["input"], EMOJI * 4):
                answer = await refusal(live.url, surface, text, params)
                assert "audio frames" in answer and "--max-work-audio-frames" in answer, answer
        assert submitted.requests == []
    finally:
        await live.stop()


async def test_a_job_is_limited_as_a_whole_by_its_own_limit(engine, tmp_path):
    """A job may plan more than a request (``--max-job-audio-frames``: ~22 h; 200,000 characters
    on the default DiT), as utterances that each fit one request, and not more: its pauses and the text between them count together. A
    WAV job stops where a WAV file's 32-bit sizes do, whatever the limit."""
    pauses = "<break time=10s>" * 12_000  # 192,000 characters: 1,500,000 frames of silence
    joined = '<break time="0ms"/>'.join([EMOJI] * 100)  # 100 pieces of ~14,400 frames at speed 0.25
    live = await start_server(engine, tmp_path / "data", job_workers=0)
    try:
        async with aiohttp.ClientSession() as http:
            for body in ({"input": pauses}, {**JOINED_BY_BREAKS, "input": joined}):
                async with http.post(live.url + "/v1/jobs", json=body) as response:
                    answer = await response.json()
                    assert response.status == 413, answer
                    assert answer["error"]["code"] == "too_much_work", answer
                    assert "--max-job-audio-frames" in answer["error"]["message"], answer
            async with http.post(live.url + "/v1/jobs", json=JOINED_BY_BREAKS) as response:  # 57,600 frames
                assert response.status == 202, await response.text()
            # the documented longest job (~180,000 frames on the DiT: 25 requests' worth) is taken
            async with http.post(live.url + "/v1/jobs", json={"input": long_text(200_000)}) as response:
                assert response.status == 202, await response.text()
    finally:
        await live.stop()
    live = await start_server(engine, tmp_path / "data2", job_workers=0, max_job_audio_frames=0)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(live.url + "/v1/jobs", json={"input": pauses}) as response:
                answer = await response.json()
                assert response.status == 413 and "a WAV file holds at most" in answer["error"]["message"], answer
            async with http.post(live.url + "/v1/jobs", json={"input": pauses, "response_format": "flac"}) as response:
                assert response.status == 202, await response.text()
    finally:
        await live.stop()


async def test_a_talker_request_is_limited_over_all_its_utterances(talker_engine, tmp_path):
    """4,096 emoji with max_new_tokens 16384 are cut into utterances that each fit (1,024 frames),
    258,560 frames in all: refused as a whole. An ordinary sentence with a released checkpoint's
    max_new_tokens (8192) is served: its budget comes from its text."""
    text = "\U0001F600" * 4096
    live = await start_server(talker_engine, tmp_path / "data", job_workers=0)
    try:
        with Recorded(talker_engine) as submitted:
            for surface in ("speech", "speech-file", "stream", "omni"):
                params = {"max_new_tokens": 16384, **({"text_streaming": False} if surface == "stream" else {})}
                answer = await refusal(live.url, surface, text, params)
                assert "--max-work-audio-frames" in answer, answer
            assert submitted.requests == []
            async with aiohttp.ClientSession() as http:
                async with http.post(live.url + "/v1/audio/speech", json={
                        "input": "Hello there.", "response_format": "pcm", "max_new_tokens": 8192}) as response:
                    assert response.status == 200, await response.text()
                    assert len(await response.read()) > 0
    finally:
        await live.stop()
