"""A third pipeline is an adapter and one registry line (engines/pipelines/registry.py): a toy one,
defined here, registered with one line, is built by ``build_engine`` (its config naming it) and serves a
request end to end - the real server, a real HTTP client, its code frames through the real
vocoder - with its own profile's voices, rules and planned work. Nothing in the engine names it.
The server's own path serves it too: ``--source toy`` parsed as ``streamvox serve`` parses its
flags, the engine built from those settings; an unknown ``--source`` fails ``streamvox serve``
with the registered names."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from conftest import start_server

from engines.build import build_engine
from engines.config import EngineConfig, get_preset
from engines.contract import EngineCapabilities, InvalidRequest, PlannedWork, SynthesisRequest
from engines.pipelines.base import Capacity, Chunking, Prepared, Produced, StepPlan
from engines.pipelines.dit.weights import build_models
from engines.pipelines.profile import Adapter, Loaded, PipelineSetup, Profile, Registration
from engines.pipelines.registry import PIPELINES
from service.server import serve
from service.settings import add_arguments, from_args

LSB = 1 / 32768


def toy_codes(text: str, groups: int, codebook: int) -> torch.Tensor:
    """The toy's frames for ``text``: one per character, each character's byte in every group."""
    ids = torch.tensor(list(text.encode()), dtype=torch.int64) % codebook
    return ids[:, None].expand(-1, groups).contiguous()


class ToyPipeline:
    """One frame per character per step, one row per request."""

    name = "toy"
    graphed = ()
    chunking = Chunking(4, 4)

    def __init__(self, slots: int, groups: int, codebook: int):
        self.slots, self.groups, self.codebook = slots, groups, codebook
        self.codes: dict[str, torch.Tensor] = {}
        self.done: dict[str, int] = {}  # in a slot: frames emitted
        self.last_batch_rows = 0

    def prepare(self, request: SynthesisRequest) -> Prepared:
        self.codes[request.id] = toy_codes(request.text, self.groups, self.codebook)
        return Prepared(frames=len(self.codes[request.id]))

    def prepare_many(self, requests):
        return [self.prepare(r) for r in requests]

    def start(self, request_id: str, prepared: Prepared) -> None:
        self.done[request_id] = 0

    def capacity(self) -> Capacity:
        return Capacity(free_rows=self.slots - len(self.done))

    def tick(self, plan: StepPlan) -> list[Produced]:
        self.last_batch_rows, out = len(self.done), []
        for rid in list(self.done):
            k, codes = self.done[rid], self.codes[rid]
            out.append(Produced(rid, k, k + 1 == len(codes), codes[k:k + 1]))
            self.done[rid] = k + 1
            if k + 1 == len(codes):
                self.drop(rid)
        return out

    def drop(self, request_id: str) -> None:
        self.codes.pop(request_id, None)
        self.done.pop(request_id, None)

    def languages(self) -> None:
        return None

    def tokenize(self, request: SynthesisRequest) -> SynthesisRequest:
        return request

    def capture_graphs(self) -> None:
        pass

    def kv_cache_stats(self) -> dict[str, float]:
        return {}

    @property
    def active_slots(self) -> int:
        return len(self.done)


class ToyProfile(Profile):
    kind = "a toy model"

    def __init__(self, max_slots: int):
        self.capabilities = EngineCapabilities(
            pipeline="toy", task_type=None, voices=("plain",), voice_aliases={"alloy": "plain"}, preset_voices=True,
            languages=None, honoured_fields=frozenset({"text", "voice"}), max_slots=max_slots)

    def validate(self, request: SynthesisRequest, complete: bool) -> None:
        if request.instructions:
            raise InvalidRequest("instructions", "the toy pipeline takes no instructions")

    def planned_work(self, request: SynthesisRequest) -> PlannedWork:
        frames = len(request.text.encode())
        return PlannedWork(frames, frames, "toy frames")


def load_toy(config: EngineConfig) -> Loaded:
    """Its modules: the preset's codec side on random weights (no checkpoint of its own)."""
    return Loaded(build_models(config.sizes(), config.model.seed))


def build_toy(setup: PipelineSetup) -> Adapter:
    cfg = setup.models.config
    return Adapter(ToyPipeline(setup.max_slots, cfg.num_code_groups, cfg.codec_head.codebook_size),
                   ToyProfile(setup.max_slots))


ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setitem(PIPELINES, "toy", Registration(build_toy, load_toy))  # the registry line a new pipeline adds


@pytest.fixture
def toy_engine(toy_registered):
    engine = build_engine(EngineConfig.for_tests(pipeline="toy", warmup=False))
    engine.start()
    yield engine
    engine.stop()


def expected_audio(models, text: str) -> np.ndarray:
    """The toy's frames for ``text`` decoded in one shot by ``models``' codec decoder."""
    config = models.config
    with torch.no_grad():
        codes = toy_codes(text, config.num_code_groups, config.codec_head.codebook_size)
        return models.decoder(codes.T[None])[0].numpy()


async def speak(url: str, text: str) -> np.ndarray:
    """``text`` through POST /v1/audio/speech in the toy's voice alias, as float samples."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/audio/speech",
                             json={"model": "streamvox", "input": text, "voice": "alloy",
                                   "response_format": "pcm"}) as r:
            assert r.status == 200, await r.text()
            return np.frombuffer(await r.read(), dtype="<i2").astype(np.float32) / 32768


async def test_a_toy_pipeline_registered_with_one_line_serves_a_request(toy_engine, tmp_path):
    engine, text = toy_engine, "Hello, toy pipeline."
    assert engine.info.source == engine.capabilities.pipeline == "toy" and engine.info.voices == ("plain",)
    expected = expected_audio(engine.models, text)
    server = await start_server(engine, tmp_path / "data")
    try:
        audio = await speak(server.url, text)
        assert len(audio) == len(expected) == len(text) * 1920
        np.testing.assert_allclose(audio, expected, atol=2 * LSB, rtol=0)
        async with aiohttp.ClientSession() as http:
            # its profile's rules: an unknown voice and instructions are the client's errors
            for body, field in (({"voice": "nobody"}, "voice"), ({"voice": "plain", "instructions": "whisper"}, "instructions")):
                async with http.post(f"{server.url}/v1/audio/speech",
                                     json={"model": "streamvox", "input": text, **body}) as r:
                    assert r.status == 400 and field in await r.text()
    finally:
        await server.stop()
    assert engine.planned_work(SynthesisRequest(id="x", text=text)).audio_frames == len(text)


async def test_the_server_serves_a_registered_pipeline_named_by_its_flag(toy_registered, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)  # `streamvox serve`'s flags
    # fp32 codec: the audio is compared with a one-shot fp32 decode to the sample
    settings = from_args(parser.parse_args(["--source", "toy", "--preset", "tiny", "--device", "cpu", "--port", "0",
                                            "--codec-precision", "float32", "--data-dir", str(tmp_path / "data"),
                                            "--log-level", "warning"]), env={})
    assert settings.source == "toy"
    stop, listening = asyncio.Event(), asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(settings, stop=stop, listening=listening))  # builds the engine itself
    try:
        url = await asyncio.wait_for(asyncio.shield(listening), timeout=120)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v1/voices") as r:
                assert (await r.json())["voices"] == ["plain"]  # the toy's profile
            async with http.get(f"{url}/v1/models") as r:
                assert (await r.json())["data"][0]["display_name"] == "streamvox toy pipeline, preset tiny"
        text = "Served by name."
        audio = await speak(url, text)
        # the server's engine: the toy's frames through the tiny preset's codec decoder (seed 0, as served)
        expected = expected_audio(build_models(get_preset("tiny"), 0), text)
        assert len(audio) == len(expected) == len(text) * 1920
        np.testing.assert_allclose(audio, expected, atol=2 * LSB, rtol=0)
    finally:
        stop.set()
        assert await asyncio.wait_for(server, timeout=60) == 0


def test_streamvox_serve_refuses_an_unknown_source_with_the_registered_names(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    # checked before the model is resolved (no download for a name that can never serve): the model
    # named here is not in the cache, and offline that would be the error otherwise
    run = subprocess.run([sys.executable, "-m", "clients.cli", "serve", "--source", "nowhere", "--port", "0",
                          "--model", "nobody/no-such-model", "--data-dir", str(tmp_path / "data")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines()[-1] == "streamvox serve: unknown source 'nowhere'; choose one of dit, talker", \
        run.stderr


def test_an_unknown_pipeline_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown source 'nowhere'"):
        build_engine(EngineConfig.for_tests(pipeline="nowhere", warmup=False))
