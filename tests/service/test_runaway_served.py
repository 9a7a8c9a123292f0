"""The runaway guard, served: a talker that never samples EOS stops at its text's frame budget
(not at the released ``max_new_tokens`` of 8192), and one whose code 0 is stuck in a loop stops
within the guard's window; the client is told (``utterance.truncated`` on ``/v1/stream`` and on
speech SSE, ``audio.done.truncated``, the ``X-Streamvox-Truncated`` header of a whole file) and
``streamvox_utterances_truncated_total`` counts it.

Real server, real clients, on copies of the talker oracle fixture with the released values
(tests/oracle/talker_fixtures.py ``released_checkpoint``) whose codec head is edited."""

from __future__ import annotations

import base64
import io
import json

import aiohttp
import numpy as np
import pytest
import soundfile as sf
import torch
import websockets
from conftest import metric_value, start_server
from safetensors.torch import load_file, save_file
from ws_helpers import read_until_session_done

from engines.build import build_engine
from engines.config import EngineConfig
from engines.contract import SAMPLES_PER_FRAME, SynthesisRequest
from engines.pipelines.talker.guard import LOOP_WINDOW
from tests.oracle import talker_fixtures as fx

TEXT = "Hi."  # a budget of 95 frames with the fixture's small tokenizer (3 ids)
LONGER = "Hello there, how are you?"  # 305 frames
METRIC = "streamvox_utterances_truncated_total"


def edit_codec_head(directory, edit) -> None:
    """``edit(weight [V, D], eos_id)`` on the checkpoint's codec head, in place."""
    config = json.loads((directory / "config.json").read_text())
    weights = load_file(str(directory / "model.safetensors"))
    head = weights["talker.codec_head.weight"].clone()
    edit(head, config["talker_config"]["codec_eos_token_id"])
    weights["talker.codec_head.weight"] = head
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def no_eos(head: torch.Tensor, eos: int) -> None:
    head[eos] = 0  # EOS scores 0 against the codebook's random scores: greedy never picks it


def stuck(head: torch.Tensor, eos: int) -> None:
    head.zero_()  # every score 0: greedy takes the first id, code 0 = 0 frame after frame (a loop)


def engine_on(tmp_path_factory, edit):
    path = fx.released_checkpoint("cv_proj", tmp_path_factory.mktemp("runaway") / "ckpt")
    edit_codec_head(path, edit)
    engine = build_engine(EngineConfig.for_tests(checkpoint=str(path), warmup=False))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    engine = engine_on(tmp_path_factory, no_eos)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def looping(tmp_path_factory):
    engine = engine_on(tmp_path_factory, stuck)
    yield engine
    engine.stop()


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def sse_audio(events: list[dict]) -> np.ndarray:
    data = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    return np.frombuffer(data, dtype="<i2")


async def test_an_utterance_that_never_ends_stops_at_its_text_budget_and_says_so(endless, tmp_path):
    budget = endless.planned_work(SynthesisRequest(id="plan", text=TEXT)).model_steps
    assert budget < 8192 - 1  # the text's budget, not the released max_new_tokens
    live = await start_server(endless, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(live.url + "/v1/audio/speech", json={
                    "input": TEXT, "response_format": "pcm", "stream": True, "temperature": 0}) as response:
                assert response.status == 200, await response.text()
                events = sse_events(await response.text())
            kinds = [e["type"] for e in events]
            assert kinds[-1] == "speech.audio.done" and "error" not in kinds, kinds[-3:]
            [truncated] = [e for e in events if e["type"] == "utterance.truncated"]
            assert truncated["reason"] == "budget" and kinds.index("utterance.truncated") > kinds.index(
                "speech.audio.delta")
            assert sse_audio(events).size == budget * SAMPLES_PER_FRAME  # every frame of its budget, no more
            async with http.post(live.url + "/v1/audio/speech", json={
                    "input": TEXT, "response_format": "wav", "stream": False, "temperature": 0}) as response:
                assert response.status == 200 and response.headers["X-Streamvox-Truncated"] == "budget"
                audio, _ = sf.read(io.BytesIO(await response.read()), dtype="float32")
            assert audio.size == budget * SAMPLES_PER_FRAME
        async with websockets.connect(live.ws_url) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.config", "temperature": 0, "text_streaming": False}))
            await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            await ws.send(json.dumps({"type": "input.done"}))
            read = await read_until_session_done(ws, timeout_s=60)
        truncated, done = read.last("utterance.truncated"), read.last("audio.done")
        assert truncated == {"type": "utterance.truncated", "utterance": 0, "reason": "budget",
                             "message": truncated["message"]} and "budget" in truncated["message"]
        assert done["truncated"] == "budget" and done["samples"] == budget * SAMPLES_PER_FRAME
        assert read.events.index(truncated) < read.events.index(done)
        assert await metric_value(live.url, METRIC, '{reason="budget"}') == 3
    finally:
        await live.stop()


async def test_a_request_that_names_max_new_tokens_is_cut_there_not_at_the_budget(endless, tmp_path):
    live = await start_server(endless, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(live.url + "/v1/audio/speech", json={
                    "input": TEXT, "response_format": "pcm", "stream": True, "temperature": 0,
                    "max_new_tokens": 21}) as response:
                events = sse_events(await response.text())
        assert [e["reason"] for e in events if e["type"] == "utterance.truncated"] == ["max_new_tokens"]
        assert sse_audio(events).size == 20 * SAMPLES_PER_FRAME
        assert await metric_value(live.url, METRIC, '{reason="max_new_tokens"}') == 1
    finally:
        await live.stop()


async def test_a_stuck_loop_is_cut_within_the_window(looping, tmp_path):
    budget = looping.planned_work(SynthesisRequest(id="plan", text=LONGER)).model_steps
    assert budget > 2 * LOOP_WINDOW  # the guard, not the budget, ends it
    live = await start_server(looping, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(live.url + "/v1/audio/speech", json={
                    "input": LONGER, "response_format": "pcm", "stream": True, "temperature": 0}) as response:
                events = sse_events(await response.text())
        assert [e["reason"] for e in events if e["type"] == "utterance.truncated"] == ["loop"]
        assert events[-1]["type"] == "speech.audio.done"
        # code 0 repeats from the first frame: cut when the window is full of it
        assert sse_audio(events).size == LOOP_WINDOW * SAMPLES_PER_FRAME
        assert await metric_value(live.url, METRIC, '{reason="loop"}') == 1
    finally:
        await live.stop()
