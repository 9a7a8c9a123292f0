"""The one submit recipe (service/synthesis/submit.py) on a talker checkpoint, through every entry
point with real clients:

* ``speed`` is the service's time-stretch on the talker, the same on a REST job as on
  ``/v1/audio/speech``: speed 1.5 audio is 1/1.5 as long as speed 1 (within 5 %, atempo's
  look-ahead and frame rounding), and the job succeeds instead of failing after its 202;
* a request's prompt text is tokenized once (at validation; the ids travel with the request),
  counted at the talker's prompt builder, on speech, ``/v1/stream`` (sentence and live text) and jobs.
"""

from __future__ import annotations

import io
import json

import aiohttp
import numpy as np
import pytest
import soundfile as sf
import websockets
from conftest import finished_job, start_server

from engines.pipelines.talker.prompt import PromptBuilder

TEXT = "Hello world, this is a small test of streaming speech."
# Greedy and seeded: speed 1 and speed 1.5 generate the same codes, so only the stretch differs.
SAME_CODES = {"temperature": 0, "seed": 7, "voice": "default"}


@pytest.fixture
def prompt_tokenizations(monkeypatch):
    """Calls of the talker's prompt tokenization (the wrapped text's ids), by text."""
    calls: list[str] = []
    original = PromptBuilder.tokenize_assistant

    def counted(self, text: str) -> list[int]:
        calls.append(text)
        return original(self, text)

    monkeypatch.setattr(PromptBuilder, "tokenize_assistant", counted)
    return calls


def wav_samples(data: bytes) -> np.ndarray:
    audio, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == 24000
    return audio


async def speech(http: aiohttp.ClientSession, url: str, **fields) -> np.ndarray:
    async with http.post(url + "/v1/audio/speech", json={"input": TEXT, "response_format": "wav", **fields}) as r:
        assert r.status == 200, await r.text()
        return wav_samples(await r.read())


async def job(http: aiohttp.ClientSession, url: str, **fields) -> np.ndarray:
    async with http.post(url + "/v1/jobs", json={"input": TEXT, "response_format": "wav", **fields}) as r:
        assert r.status == 202, await r.text()
        location = r.headers["Location"]
    state = await finished_job(http, url + location)
    assert state["status"] == "succeeded", state
    async with http.get(url + location + "/audio") as r:
        assert r.status == 200
        return wav_samples(await r.read())


async def test_a_job_with_speed_is_stretched_like_speech(unwarmed_talker_engine, tmp_path):
    assert not unwarmed_talker_engine.capabilities.honours("speed")  # the talker: the service stretches
    server = await start_server(unwarmed_talker_engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            lengths = {}
            for name, run in (("speech", speech), ("job", job)):
                for speed in (1.0, 1.5):
                    lengths[name, speed] = len(await run(http, server.url, speed=speed, **SAME_CODES))
        assert lengths["job", 1.0] == lengths["speech", 1.0] > 24000 // 2
        for name in ("speech", "job"):
            ratio = lengths[name, 1.5] / lengths[name, 1.0]
            assert abs(ratio - 1 / 1.5) <= 0.05 / 1.5, (name, ratio)
        assert lengths["job", 1.5] == lengths["speech", 1.5]  # one recipe: the same stretch
    finally:
        await server.stop()


async def test_a_request_is_tokenized_once_on_every_entry_point(unwarmed_talker_engine, tmp_path, prompt_tokenizations):
    server = await start_server(unwarmed_talker_engine, tmp_path / "data")
    calls = prompt_tokenizations
    try:
        async with aiohttp.ClientSession() as http:
            await speech(http, server.url, **SAME_CODES)
            assert calls == [TEXT], calls
            calls.clear()
            await job(http, server.url, **SAME_CODES)
            assert calls == [TEXT], calls
            calls.clear()
        for live in (False, True):
            async with websockets.connect(server.ws_url) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                await ws.send(json.dumps({"type": "session.config", "text_streaming": live, **SAME_CODES}))
                await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
                await ws.send(json.dumps({"type": "input.done"}))
                while True:
                    message = await ws.recv()
                    if isinstance(message, str):
                        event = json.loads(message)
                        assert event["type"] != "error", event
                        if event["type"] == "session.done":
                            break
            # Sentence mode: one request, its text. Live text: one request whose prompt starts empty
            # (its text arrives through the incremental tokenizer, engines/pipelines/talker/stable_tokens.py).
            assert calls == ["" if live else TEXT], (live, calls)
            calls.clear()
    finally:
        await server.stop()
