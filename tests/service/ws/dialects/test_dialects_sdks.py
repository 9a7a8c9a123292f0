"""Real voice-agent SDKs, unmodified, against a live streamvox: the ``elevenlabs`` SDK's
realtime (stream-input) helper, LiveKit Agents' ElevenLabs / Cartesia / Deepgram TTS streams
and Pipecat's ElevenLabs / Cartesia TTS services in a minimal pipeline, each sending text in
pieces with its base URL pointed at the server.

The SDKs live in their own virtualenv and run as subprocesses (tests/agents_helpers.py).

What each client gets back is compared with the same text spoken over the Cartesia socket
directly: the same number of samples (the tiny DiT engine is deterministic, seed 0)."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import subprocess
import sys

import pytest
import websockets
from agents_helpers import KEY, TEXT, needs_agents, run_client
from conftest import start_server

pytestmark = needs_agents


async def reference_samples(url: str) -> int:
    """``TEXT`` at 24 kHz over the Cartesia socket (samples of int16)."""
    async with websockets.connect(f"{url}/tts/websocket", additional_headers={"X-API-Key": KEY}) as ws:
        await ws.send(json.dumps({"transcript": TEXT, "context_id": "ref", "continue": False,
                                  "voice": {"mode": "id", "id": "default"},
                                  "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}))
        size = 0
        while (message := json.loads(await asyncio.wait_for(ws.recv(), 60)))["type"] != "done":
            if message["type"] == "chunk":
                size += len(base64.b64decode(message["data"]))
        return size // 2


@pytest.fixture
async def live(engine, tmp_path):
    server = await start_server(engine, tmp_path / "data", api_keys=(KEY,))
    yield server
    await server.stop()


@pytest.mark.parametrize("kind", ["livekit-elevenlabs", "livekit-cartesia", "livekit-deepgram",
                                  "pipecat-elevenlabs", "pipecat-cartesia"])
async def test_agent_sdk_gets_the_audio(live, kind):
    result = await run_client(kind, live.url, voice="default")
    assert result["sample_rate"] == 24000 and result["peak"] > 0.01
    # every sample, as spoken alone (LiveKit's Deepgram plugin may pad the end of a segment)
    expected = await reference_samples(live.url.replace("http", "ws", 1))
    assert result["bytes"] // 2 == expected, result
    if kind.startswith("pipecat"):
        assert {"TTSStartedFrame", "TTSAudioRawFrame", "TTSStoppedFrame"} <= set(result["events"])


async def test_elevenlabs_sdk_realtime_helper(engine, tmp_path, tls_files):
    cert, key = tls_files
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = await start_server(engine, tmp_path / "data", ssl_context=context, api_keys=(KEY,))
    try:
        result = await run_client("elevenlabs-sdk", server.url, cert)
        trust = ssl.create_default_context(cafile=str(cert))
        async with websockets.connect(f"{server.ws_url.rsplit('/v1', 1)[0]}/tts/websocket",
                                      additional_headers={"X-API-Key": KEY}, ssl=trust) as ws:
            await ws.send(json.dumps({"transcript": TEXT, "context_id": "ref", "continue": False,
                                      "voice": {"mode": "id", "id": "default"},
                                      "output_format": {"container": "raw", "encoding": "pcm_s16le",
                                                        "sample_rate": 24000}}))
            size = 0
            while (message := json.loads(await asyncio.wait_for(ws.recv(), 60)))["type"] != "done":
                size += len(base64.b64decode(message.get("data") or ""))
        assert result["peak"] > 0.01 and result["bytes"] == size
    finally:
        await server.stop()


def test_agents_venv_keeps_its_own_packages():
    """The SDKs did not leak into the project's venv (they pin their own aiohttp and protobuf)."""
    project = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                              "print(u.find_spec('livekit') is None and u.find_spec('pipecat') is None)"],
                             capture_output=True, text=True, timeout=60)
    assert project.stdout.strip() == "True"




@pytest.mark.parametrize("kind", ["livekit-elevenlabs", "livekit-cartesia", "pipecat-elevenlabs", "pipecat-cartesia"])
async def test_agent_sdk_gets_word_timestamps(aligned_engine, engine, tmp_path, kind):
    """With an aligner each SDK whose protocol has timestamps turns ours into its own timed
    words: the words of the text it sent, in order, at non-decreasing times; without one, none."""
    from engines.pipelines.aligner.words import split_words

    server = await start_server(aligned_engine, tmp_path / "aligned", api_keys=(KEY,))
    try:
        result = await run_client(kind, server.url, voice="default")
    finally:
        await server.stop()
    assert result["peak"] > 0.01
    words = [w.strip() for w, _ in result["timed"] if w.strip()]
    assert [split_words(w, "english")[0] for w in words if split_words(w, "english")] == split_words(TEXT, "english"), result["timed"]
    starts = [s for _, s in result["timed"] if s is not None]
    if kind != "livekit-elevenlabs":  # (it reads ElevenLabs' per-message times as the context's: see docs/API.md)
        assert starts == sorted(starts)
    plain = await start_server(engine, tmp_path / "plain", api_keys=(KEY,))
    try:
        assert not (await run_client(kind, plain.url, voice="default"))["timed"]
    finally:
        await plain.stop()
