"""Official sampling, served: the defaults are the checkpoint's generation_config.json,
every request may override them on all three APIs, and the randomness is counter-based per
(seed, frame, codebook), so a seeded request sounds the same alone or among 15 others.

Real server, real HTTP / WebSocket clients, the tiny talker fixture in the official layout."""

from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import numpy as np
import pytest
import torch
import websockets
from conftest import same_pcm16, start_server
from ws_helpers import read_until_session_done

from engines.build import build_engine
from engines.config import EngineConfig
from engines.contract import SynthesisRequest
from engines.pipelines.talker.source import resolve_settings
from tests.oracle import talker_fixtures as fx

TEXT = "Hello world, this is a small test of streaming speech."
OTHERS = ["Numbers 2026 and 42.", "the quick brown fox", "Hello there.", "a small test"]
LSB = 1 / 32768


@pytest.fixture(scope="module")
def engine():
    engine = build_engine(EngineConfig.for_tests(checkpoint=str(fx.checkpoint_dir("cv_proj")), warmup=False,
                                                 max_slots=16))
    engine.start()
    yield engine
    engine.stop()


async def speech(http, url: str, **fields) -> bytes:
    async with http.post(url + "/v1/audio/speech", json={"input": TEXT, "response_format": "pcm", **fields}) as r:
        assert r.status == 200, await r.text()
        return await r.read()


async def test_same_seed_same_audio_alone_and_among_16(engine, tmp_path):
    server = await start_server(engine, tmp_path / "data", max_streams_per_key=0)  # 16 streams from one address
    try:
        async with aiohttp.ClientSession() as http:
            alone = await speech(http, server.url, seed=7)
            greedy = await speech(http, server.url, seed=7, temperature=0)
            assert alone != greedy, "the default samples (the checkpoint's do_sample)"
            crowd = [speech(http, server.url, seed=7)] + [
                speech(http, server.url, seed=100 + i, input=OTHERS[i % len(OTHERS)], temperature=0.5 + i / 10)
                for i in range(15)]
            results = await asyncio.gather(*crowd)
            assert same_pcm16(results[0], alone)
            assert not same_pcm16(alone, greedy)
            unseeded = await asyncio.gather(speech(http, server.url), speech(http, server.url))
            assert not same_pcm16(*unseeded), "two requests without a seed differ"
    finally:
        await server.stop()


def _decode(engine, codes: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return engine.models.decoder(codes.T[None])[0].numpy()


OFFICIAL_OTHERWISE = {"do_sample": True, "top_k": 7, "top_p": 0.8, "temperature": 0.55, "repetition_penalty": 1.3,
                      "subtalker_dosample": False, "subtalker_top_k": 3, "subtalker_top_p": 0.5,
                      "subtalker_temperature": 0.4, "max_new_tokens": 9}


async def test_defaults_are_the_checkpoints_generation_config(tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(fx.checkpoint_dir("cv_proj"), path)
    (path / "generation_config.json").write_text(json.dumps(OFFICIAL_OTHERWISE))
    engine = build_engine(EngineConfig.for_tests(checkpoint=str(path), warmup=False))
    engine.start()
    try:
        gen = engine.pipeline.source.generation
        settings = resolve_settings(gen, SynthesisRequest(id="a", text="x"))
        assert (settings.talker.greedy, settings.talker.temperature, settings.talker.top_k, settings.talker.top_p) == (
            False, 0.55, 7, 0.8)
        assert settings.predictor.greedy and settings.repetition_penalty == 1.3
        # max_new_tokens: the frame budget the request is planned with (at most max_new_tokens - 1 frames)
        assert engine.plan(SynthesisRequest(id="a", text="x")).budget[:2] == (9 - 1, "max_new_tokens")
        override = resolve_settings(gen, SynthesisRequest(id="b", text="x", temperature=1.2, top_k=0, top_p=0.9,
                                                          repetition_penalty=1.0, max_new_tokens=3))
        assert (override.talker.temperature, override.talker.top_k, override.talker.top_p,
                override.repetition_penalty) == (1.2, 0, 0.9, 1.0)
        assert engine.plan(SynthesisRequest(id="b", text="x", max_new_tokens=3)).budget[:2] == (3 - 1, "max_new_tokens")
        greedy = resolve_settings(gen, SynthesisRequest(id="c", text="x", temperature=0))
        assert greedy.talker.greedy and greedy.predictor.greedy

        from engines.pipelines.talker.reference import TalkerBundle

        bundle = TalkerBundle.from_checkpoint(path, "cpu", torch.float32, predictor=engine.models.code_predictor)
        voice = engine.capabilities.voices[0]
        want = bundle.generate_codes(TEXT, voice, seed=5)  # every setting from the file
        assert 0 < want.shape[0] <= 8
        server = await start_server(engine, tmp_path / "data")
        try:
            async with aiohttp.ClientSession() as http:
                pcm = await speech(http, server.url, seed=5, voice=voice)
        finally:
            await server.stop()
        got = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768
        expected = _decode(engine, want)
        assert len(got) == len(expected)
        np.testing.assert_allclose(got, expected, atol=2 * LSB, rtol=0)
    finally:
        engine.stop()


BAD = [({"temperature": -1}, "temperature"), ({"top_k": 5000}, "top_k"), ({"top_p": 0}, "top_p"),
       ({"repetition_penalty": 0}, "repetition_penalty"), ({"max_new_tokens": 0}, "max_new_tokens"),
       ({"seed": -1}, "seed"), ({"initial_codec_chunk_frames": 100}, "initial_codec_chunk_frames"),
       ({"temperature": "hot"}, "temperature")]


async def test_bad_sampling_values_are_refused_naming_the_field(engine, tmp_path):
    server = await start_server(engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            for fields, name in BAD:
                for path in ("/v1/audio/speech", "/v1/jobs"):
                    async with http.post(server.url + path, json={"input": "Hi.", **fields}) as r:
                        error = (await r.json())["error"]
                    assert (r.status, error["code"]) == (400, "invalid_field"), (path, fields)
                    assert error["message"].startswith(name + ":"), error
        async with websockets.connect(server.url.replace("http://", "ws://") + "/v1/stream") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            for fields, name in BAD:
                await ws.send(json.dumps({"type": "session.config", **fields}))
                reply = json.loads(await ws.recv())
                assert (reply["type"], reply["code"]) == ("error", "invalid_field") and reply["message"].startswith(
                    name + ":"), reply
    finally:
        await server.stop()


async def ws_chunks(url: str, config: dict) -> list[bytes]:
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/stream") as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.config", **config}))
        await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
        await ws.send(json.dumps({"type": "input.done"}))
        return (await read_until_session_done(ws)).frames


async def test_initial_codec_chunk_frames_sets_the_first_piece(engine, tmp_path):
    """The first PCM leaves after ``initial_codec_chunk_frames`` frames (1,920 samples each);
    the audio as a whole does not change (greedy, same codes)."""
    server = await start_server(engine, tmp_path / "data")
    try:
        default = await ws_chunks(server.url, {"temperature": 0, "seed": 1})
        one = await ws_chunks(server.url, {"temperature": 0, "seed": 1, "initial_codec_chunk_frames": 1})
        two = await ws_chunks(server.url, {"temperature": 0, "seed": 1, "initial_codec_chunk_frames": 2})
    finally:
        await server.stop()
    assert same_pcm16(b"".join(default), b"".join(one)) and same_pcm16(b"".join(default), b"".join(two))
    assert len(one[0]) == 2 * 1920 and len(two[0]) == 2 * 2 * 1920
    # by default the scheduler picks it by load (engines/core/scheduler.py): at most the pipeline's 4 frames
    assert len(default[0]) in [2 * n * 1920 for n in (1, 2, 4)]


async def test_an_input_too_long_for_the_kv_pool_is_a_400(tmp_path):
    """A pool of 4 blocks of 16 positions (8 KiB each in the fixture's fp32 talker) holds a
    ~17-position prompt, not the ~75 of an utterance a 600-character text is planned in (each up
    to --utterance-max-frames of budget, ~64 text ids): that is refused at submission, naming
    ``input`` (never a 5xx, never a request waiting forever), and a short one still speaks."""
    gb = 5 * (2 * 2 * 16 * 2 * 16 * 4) / 2**30
    engine = build_engine(EngineConfig.for_tests(checkpoint=str(fx.checkpoint_dir("cv_proj")), warmup=False,
                                                 kv_cache_gb=gb))
    engine.start()
    server = await start_server(engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/v1/audio/speech", "/v1/jobs"):
                async with http.post(server.url + path, json={"input": "Hello there. " * 50}) as r:
                    error = (await r.json())["error"]
                assert (r.status, error["code"]) == (400, "invalid_field") and error["message"].startswith("input:")
                assert "--kv-cache-gb" in error["message"]
            assert len(await speech(http, server.url, input="Hello there.", temperature=0)) > 0
    finally:
        await server.stop()
        engine.stop()
