"""The Qwen3-TTS talker source served end to end: a fixture checkpoint in the
official layout, the real server, real WebSocket and HTTP clients.

The reference is the plain one-utterance loop (``bundle.generate_codes``, itself checked
against the official ``generate_custom_voice`` in test_talker_parity.py) decoded in one
shot; the server's audio must equal it up to PCM16 quantization (2 LSB).
"""

from __future__ import annotations

import json

import aiohttp
import numpy as np
import torch
import websockets
from conftest import start_server
from ws_helpers import read_until_session_done

from engines.checkpoints.qwen3_tts import has_talker_weights
from tests.oracle import talker_fixtures as fx

TEXT = "Hello world, this is a small test of streaming speech."
LSB = 1 / 32768


def reference_pcm(engine, path, voice: str) -> np.ndarray:
    from engines.pipelines.talker.reference import TalkerBundle

    bundle = TalkerBundle.from_checkpoint(path, "cpu", torch.float32, predictor=engine.models.code_predictor)
    with torch.no_grad():
        codes = bundle.generate_codes(TEXT, voice, greedy=True)  # [T, G]
        return engine.models.decoder(codes.T[None])[0].numpy()


async def test_talker_is_the_default_source_and_reports_no_random_weights(talker_engine, tmp_path):
    engine, path = talker_engine, fx.checkpoint_dir("cv_proj")
    assert has_talker_weights(path)
    assert engine.info.source == "talker" and engine.info.random_components == ()
    # Serving the talker never builds (random-initialises) the DiT side.
    assert engine.models.dit is None and engine.models.encoder is None and engine.models.duration is None
    server = await start_server(engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.url}/v1/voices") as r:
                body = json.dumps(await r.json())
            for speaker in engine.info.voices:
                assert speaker in body
            async with http.post(f"{server.url}/v1/audio/speech",
                                 json={"model": "streamvox", "input": TEXT, "voice": "default",
                                       "language": "Klingon"}) as r:
                assert r.status == 400 and "language" in (await r.text())
    finally:
        await server.stop()


async def test_talker_speaks_over_websocket_and_openai_endpoint(talker_engine, tmp_path):
    engine, path = talker_engine, fx.checkpoint_dir("cv_proj")
    speaker = engine.info.voices[1]
    expected = reference_pcm(engine, path, speaker)
    server = await start_server(engine, tmp_path / "data")
    try:
        async with websockets.connect(server.ws_url) as ws:
            created = json.loads(await ws.recv())
            assert created["sample_rate"] == 24000
            await ws.send(json.dumps({"type": "session.config", "voice": speaker, "temperature": 0,
                                      "text_streaming": False}))  # sentence mode: the non-streaming reference
            await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            await ws.send(json.dumps({"type": "input.done"}))
            read = await read_until_session_done(ws)
        done = read.last("audio.done")
        ws_audio = np.frombuffer(read.audio, dtype="<i2").astype(np.float32) / 32768
        assert done["samples"] == len(ws_audio) == len(expected)
        np.testing.assert_allclose(ws_audio, expected, atol=2 * LSB, rtol=0)

        async with aiohttp.ClientSession() as http:
            async with http.post(f"{server.url}/v1/audio/speech",
                                 json={"model": "streamvox", "input": TEXT, "voice": speaker,
                                       "response_format": "pcm", "temperature": 0}) as r:
                assert r.status == 200, await r.text()
                http_pcm = await r.read()
        # both endpoints deliver the same greedy audio (chunk sizes follow the engine's load: the codec
        # decoder's float math in other chunk sizes may move a sample by a rounding step)
        http_audio = np.frombuffer(http_pcm, dtype="<i2").astype(np.float32) / 32768
        assert http_audio.shape == ws_audio.shape
        np.testing.assert_allclose(http_audio, ws_audio, atol=2 * LSB, rtol=0)
        assert np.abs(ws_audio).max() > 1e-3
    finally:
        await server.stop()

