"""A checkpoint in the official layout with the released values (generation_config.json's
``max_new_tokens`` 8192, sampled; the code predictor's head_dim 128) serves a plain request that
names no ``max_new_tokens``, with default settings, on every surface: speech (streamed bytes,
one file, SSE, the openai SDK), ``/v1/stream``, a job, the vllm-omni socket and the ElevenLabs,
Cartesia and Deepgram sockets. The checkpoint's 8192 is a cap, never the work a request is
charged: each utterance is charged its text's frame budget (engines/pipelines/talker/budget.py).

Real server on 127.0.0.1, real clients; audio read back and checked."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import aiohttp
import numpy as np
import pytest
import soundfile as sf
import websockets
from conftest import start_server, wait_until
from ws_helpers import read_until_json, read_until_session_done

from engines.build import build_engine
from engines.config import EngineConfig
from engines.pipelines.talker.budget import frame_budget
from tests.oracle import talker_fixtures as fx

TEXT = "Hello there."


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    path = fx.released_checkpoint("cv_proj", tmp_path_factory.mktemp("released") / "ckpt")
    engine = build_engine(EngineConfig.for_tests(checkpoint=str(path), warmup=False))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture
async def live(released, tmp_path):
    server = await start_server(released, tmp_path / "data", job_workers=1)
    yield server
    await server.stop()


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2").astype(np.float32) / 32768


def assert_speech(audio: np.ndarray, what: str) -> None:
    assert audio.size >= 1920 and np.abs(audio).max() > 0.01, (what, audio.size)


def test_the_checkpoint_holds_the_released_values(released):
    talker = released.pipeline.source
    assert talker.generation.max_new_tokens == 8192 and talker.generation.do_sample
    assert released.models.code_predictor.cfg.head_dim == fx.RELEASED_PREDICTOR_HEAD_DIM
    # what the work limit is charged: the text's budget, far under --max-work-talker-steps (2048)
    from engines.contract import SynthesisRequest

    work = released.planned_work(SynthesisRequest(id="plan", text=TEXT))
    tokens = talker.prompt.text_tokens(SynthesisRequest(id="plan", text=TEXT))
    assert work.model_steps == frame_budget(tokens) < 2048


async def test_speech_without_max_new_tokens_on_every_http_form(live):
    async with aiohttp.ClientSession() as http:
        for extra in ({"response_format": "pcm"}, {"response_format": "wav"}):
            async with http.post(live.url + "/v1/audio/speech", json={"input": TEXT, **extra}) as response:
                assert response.status == 200, await response.text()
                data = await response.read()
            audio = pcm16(data) if extra["response_format"] == "pcm" else sf.read(io.BytesIO(data), dtype="float32")[0]
            assert_speech(audio, extra)
        async with http.post(live.url + "/v1/audio/speech",
                             json={"input": TEXT, "response_format": "pcm", "stream": True}) as response:
            assert response.status == 200, await response.text()
            events = [json.loads(line[6:]) for line in (await response.text()).splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "speech.audio.done", events[-1]
        audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
        assert_speech(pcm16(audio), "sse")


async def test_the_openai_sdk_speaks_on_it(live):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=live.url + "/v1", api_key="unused")
    response = await client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="pcm")
    assert_speech(pcm16(response.content), "openai sdk")
    await client.close()


async def test_a_job_without_max_new_tokens_succeeds(live):
    async with aiohttp.ClientSession() as http:
        async with http.post(live.url + "/v1/jobs", json={"input": TEXT, "response_format": "wav"}) as response:
            assert response.status == 202, await response.text()
            job_id = (await response.json())["id"]

        async def finished():
            async with http.get(f"{live.url}/v1/jobs/{job_id}") as r:
                return (await r.json())["status"] in ("succeeded", "failed", "cancelled")

        await wait_until(finished, timeout_s=120)
        async with http.get(f"{live.url}/v1/jobs/{job_id}") as r:
            job = await r.json()
        assert job["status"] == "succeeded", job
        async with http.get(f"{live.url}/v1/jobs/{job_id}/audio") as r:
            assert_speech(sf.read(io.BytesIO(await r.read()), dtype="float32")[0], "job")


async def test_the_streamvox_and_vllm_omni_sockets_speak_it(live):
    ws_base = live.url.replace("http://", "ws://")
    for streaming in (False, True):  # sentence mode and live text
        async with websockets.connect(live.ws_url) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.config", "text_streaming": streaming}))
            await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            await ws.send(json.dumps({"type": "input.done"}))
            read = await read_until_session_done(ws, timeout_s=60)
        assert_speech(pcm16(read.audio), f"/v1/stream text_streaming={streaming}")
    async with websockets.connect(ws_base + "/v1/audio/speech/stream") as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "stream_audio": True}))
        await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
        await ws.send(json.dumps({"type": "input.done"}))
        audio, events = bytearray(), []
        while not events or events[-1]["type"] not in ("session.done", "error"):
            message = await asyncio.wait_for(ws.recv(), 60)
            if isinstance(message, bytes):
                audio += message
            else:
                events.append(json.loads(message))
    assert events[-1]["type"] == "session.done" and not [e for e in events if e.get("error")], events
    assert_speech(pcm16(bytes(audio)), "vllm-omni socket")


async def test_the_voice_agent_sockets_speak_it(live):
    ws_base = live.url.replace("http://", "ws://")
    # ElevenLabs stream-input: BOS, text, EOS; audio then isFinal
    url = f"{ws_base}/v1/text-to-speech/default/stream-input?model_id=eleven_flash_v2_5&output_format=pcm_24000"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"text": " "}))
        await ws.send(json.dumps({"text": TEXT + " "}))
        await ws.send(json.dumps({"text": ""}))
        audio, messages = bytearray(), []
        async for raw in ws:
            message = json.loads(raw)
            messages.append(message)
            if message.get("audio"):
                audio += base64.b64decode(message["audio"])
    assert messages[-1] == {"isFinal": True} and not [m for m in messages if "error" in m], messages[-3:]
    assert_speech(pcm16(bytes(audio)), "elevenlabs")
    # Cartesia: one context, not continued
    async with websockets.connect(f"{ws_base}/tts/websocket?api_key=unused") as ws:
        await ws.send(json.dumps({"model_id": "sonic-2", "transcript": TEXT, "context_id": "c", "continue": False,
                                  "voice": {"mode": "id", "id": "default"},
                                  "output_format": {"container": "raw", "encoding": "pcm_s16le",
                                                    "sample_rate": 24000}}))
        audio, types = bytearray(), []
        while "done" not in types and "error" not in types:
            message = json.loads(await asyncio.wait_for(ws.recv(), 60))
            types.append(message["type"])
            if message["type"] == "chunk":
                audio += base64.b64decode(message["data"])
    assert types[-1] == "done", types
    assert_speech(pcm16(bytes(audio)), "cartesia")
    # Deepgram: Speak, Flush -> audio, Flushed
    async with websockets.connect(f"{ws_base}/v1/speak?model=aura-2-default-en&encoding=linear16&sample_rate=24000") as ws:
        assert json.loads(await ws.recv())["type"] == "Metadata"
        await ws.send(json.dumps({"type": "Speak", "text": TEXT}))
        await ws.send(json.dumps({"type": "Flush"}))
        audio, reply = await read_until_json(ws)
    assert reply["type"] == "Flushed", reply
    assert_speech(pcm16(audio), "deepgram")
