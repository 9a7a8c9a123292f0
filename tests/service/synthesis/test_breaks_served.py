"""``<break time="500ms"/>`` (ElevenLabs' and Cartesia's pause tag) is that much silence, within one
frame, on every surface: speech, a job, ``/v1/stream`` in sentence mode and with live text (a tag
cut between deltas included), and the ElevenLabs socket; any other tag is read as text. A
malformed or out-of-range tag is a client error on each surface (a 400, or the socket's error
message, and the session goes on), never read aloud; a closing ``</break>`` is not read either.

Real server, real clients, the tiny talker oracle fixture (its random weights speak noise, so
the silence is the longest run of zero samples)."""

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
from testsupport.long_text import Recorded
from ws_helpers import read_until_session_done

from engines.build import build_engine
from engines.config import EngineConfig
from engines.contract import SAMPLES_PER_FRAME
from tests.oracle import talker_fixtures as fx

TEXT = 'Hello there, my friend. <break time="500ms"/> How are you <emphasis>today</emphasis>?'
PAUSE = 12_000  # 500 ms at 24 kHz


@pytest.fixture(scope="module")
def talker():
    engine = build_engine(EngineConfig.for_tests(checkpoint=str(fx.checkpoint_dir("cv_proj")), warmup=False))
    engine.start()
    yield engine
    engine.stop()


def longest_silence(pcm16: np.ndarray) -> int:
    zero = np.concatenate([[0], (pcm16 == 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(zero))
    return int((edges[1::2] - edges[::2]).max(initial=0))


def assert_pause(pcm16: np.ndarray, what: str, samples: int = PAUSE) -> None:
    assert abs(longest_silence(pcm16) - samples) <= SAMPLES_PER_FRAME, (what, longest_silence(pcm16))
    assert np.abs(pcm16).max() > 300, what  # and speech around it


async def test_a_break_is_its_silence_on_every_surface(talker, tmp_path):
    live = await start_server(talker, tmp_path / "data", job_workers=1)
    ws_base = live.url.replace("http://", "ws://")
    try:
        async with aiohttp.ClientSession() as http:
            with Recorded(talker) as recorded:
                async with http.post(live.url + "/v1/audio/speech", json={"input": TEXT, "response_format": "pcm"}) as r:
                    assert r.status == 200, await r.text()
                    assert_pause(np.frombuffer(await r.read(), dtype="<i2"), "speech")
            # the other tag went to the model as text
            assert [r.text for r in recorded.requests] == ["Hello there, my friend.",
                                                          "How are you <emphasis>today</emphasis>?"]
            async with http.post(live.url + "/v1/jobs", json={"input": TEXT, "response_format": "wav"}) as r:
                job_id = (await r.json())["id"]

            async def done():
                async with http.get(f"{live.url}/v1/jobs/{job_id}") as r:
                    return (await r.json())["status"] == "succeeded"

            await wait_until(done, timeout_s=60)
            async with http.get(f"{live.url}/v1/jobs/{job_id}/audio") as r:
                audio, _ = sf.read(io.BytesIO(await r.read()), dtype="int16")
            assert_pause(audio, "job")
        for streaming in (False, True):
            async with websockets.connect(live.ws_url) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                await ws.send(json.dumps({"type": "session.config", "text_streaming": streaming}))
                for piece in (TEXT[:30], TEXT[30:40], TEXT[40:]):  # the tag arrives cut in two
                    await ws.send(json.dumps({"type": "input.text", "text": piece}))
                await ws.send(json.dumps({"type": "input.done"}))
                read = await read_until_session_done(ws, timeout_s=60)
            assert_pause(np.frombuffer(read.audio, dtype="<i2"), f"/v1/stream text_streaming={streaming}")
        url = f"{ws_base}/v1/text-to-speech/default/stream-input?output_format=pcm_24000"
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"text": " "}))
            for piece in (TEXT[:30], TEXT[30:40], TEXT[40:] + " "):
                await ws.send(json.dumps({"text": piece}))
            await ws.send(json.dumps({"text": ""}))
            audio = bytearray()
            while True:
                message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                audio += base64.b64decode(message["audio"]) if message.get("audio") else b""
                if message.get("isFinal"):
                    break
        assert_pause(np.frombuffer(bytes(audio), dtype="<i2"), "elevenlabs")
    finally:
        await live.stop()


MALFORMED = ['<break time="1.5"/>', '<break time="abc"/>', '<break time="-1s"/>', '<break time="1s"',
             '<break strength="loud"/>', '<break time="99s"/>', '<break time="1234567ms"/>', "</break>"]


async def test_a_malformed_break_tag_is_a_client_error_on_every_surface(talker, tmp_path):
    live = await start_server(talker, tmp_path / "data", job_workers=0)
    ws_base = live.url.replace("http://", "ws://")
    try:
        async with aiohttp.ClientSession() as http:
            for tag in MALFORMED:
                for path in ("/v1/audio/speech", "/v1/jobs"):
                    async with http.post(live.url + path, json={"input": f"Hello there. {tag} Bye."}) as r:
                        error = (await r.json())["error"]
                        assert r.status == 400 and error["code"] == "invalid_field", (path, tag, error)
                        assert "the break tag at offset 13" in error["message"], error
            # SSML's other spellings are pauses, and a closing tag is not read
            with Recorded(talker) as recorded:
                for text, samples in (('Hello there. <break time="2s"></break> Bye now.', 48_000),
                                      ("Hello there. <break/> Bye now.", 18_000),
                                      ('Hello there. <break strength="strong"/> Bye now.', 24_000)):
                    async with http.post(live.url + "/v1/audio/speech", json={"input": text, "response_format": "pcm",
                                                                              "temperature": 0}) as r:
                        assert r.status == 200, await r.text()
                        assert_pause(np.frombuffer(await r.read(), dtype="<i2"), text, samples)
            assert {r.text for r in recorded.requests} == {"Hello there.", "Bye now."}
        for streaming in (False, True):  # an error message; the session goes on and speaks the next text
            async with websockets.connect(live.ws_url) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                await ws.send(json.dumps({"type": "session.config", "text_streaming": streaming}))
                await ws.send(json.dumps({"type": "input.text", "text": 'Hi <break time="abc"/> there. '}))
                await ws.send(json.dumps({"type": "input.done"}))
                await ws.send(json.dumps({"type": "input.text", "text": "Hello there. "}))
                await ws.send(json.dumps({"type": "input.done"}))
                events = []
                while sum(e["type"] == "session.done" for e in events) < 2:  # both rounds answered
                    message = await asyncio.wait_for(ws.recv(), 60)
                    if isinstance(message, str):
                        events.append(json.loads(message))
                errors = [e for e in events if e["type"] == "error"]
                assert len(errors) == 1 and errors[0]["code"] == "invalid_field", events
                assert "break tag" in errors[0]["message"], errors
                done = [e for e in events if e["type"] == "audio.done"]
                assert done and done[-1]["samples"] > 0, (streaming, events)  # the next text was spoken
        url = f"{ws_base}/v1/text-to-speech/default/stream-input?output_format=pcm_24000"
        async with websockets.connect(url) as ws:
            for text in (" ", 'Hi <break time="1.5"/> there. ', ""):
                await ws.send(json.dumps({"text": text}))
            message = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert message.get("error") == "invalid_field" and "break tag" in message["message"], message
    finally:
        await live.stop()
