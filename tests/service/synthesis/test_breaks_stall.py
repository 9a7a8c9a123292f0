"""Break tags never hold the server's event loop: a ``<break`` that never reaches ``>`` (what a
backtracking pattern took seconds over) is refused at once on every surface that takes text,
and minutes of pauses in mp3 are sent in pieces, encoded off the loop.

A real ``streamvox serve`` process (the tiny preset; the attacks need no engine work), real
clients; a thread of the test polls ``/healthz`` all along on a connection of its own and keeps
its longest wait. The bound is generous (a second, for a loaded machine): before the fix these stalls were tens of
seconds long (ReDoS) and seconds long (the pauses here); after it they are milliseconds."""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import threading
import time

import aiohttp
import av
import numpy as np
import pytest
from conftest import ServerProcess

from engines.contract import SAMPLE_RATE
from service.synthesis.breaks import Pause
from service.synthesis.params import SynthesisParams
from service.synthesis.plan import RequestPlan
from service.synthesis.sequence import UtteranceSequence

STALL_BOUND_S = 1.0
REDOS = "Hello. <break time=1s" + " " * 4000 + "and on."  # no ">": the old pattern backtracked cubically
PAUSES = 45  # x 10 s of silence per request: 450 s of mp3 (before: a stall of ~3 s for each)
PAUSED_TEXT = '<break time="10s"/>' * PAUSES
VOICE = {"mode": "id", "id": "default"}


class HealthProbe:
    """``GET /healthz`` in a loop on a thread (not the test's event loop): its longest answer."""

    def __init__(self, url: str):
        self.host, self.port = url.split("//", 1)[1].rsplit(":", 1)
        self.longest = 0.0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        connection = http.client.HTTPConnection(self.host, int(self.port), timeout=120)
        while not self._stop.is_set():
            start = time.monotonic()
            connection.request("GET", "/healthz")
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            self.longest = max(self.longest, time.monotonic() - start)
            self.answers += 1
            self._stop.wait(0.005)
        connection.close()

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(130)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("stall"), "--job-workers", "0")
    try:
        yield process.wait_listening()
    finally:
        process.stop()


async def http_answer(http: aiohttp.ClientSession, url: str, path: str, body: dict) -> tuple[int, str]:
    async with http.post(url + path, json=body) as r:
        return r.status, (await r.read()).decode(errors="replace")


async def socket_answer(http: aiohttp.ClientSession, url: str, messages: list[dict], is_error) -> tuple[int, str]:
    """Send ``messages`` on the socket at ``url``: (400, the error) once one ``is_error``, or
    (200, "") when the socket speaks instead (audio) and ends."""
    async with http.ws_connect(url, max_msg_size=0) as ws:
        for message in messages:
            await ws.send_json(message)
        async with asyncio.timeout(120):
            async for frame in ws:
                if frame.type == aiohttp.WSMsgType.TEXT:
                    event = json.loads(frame.data)
                    if is_error(event):
                        return 400, frame.data
                    if event.get("type") in ("session.done", "done", "Flushed") or event.get("isFinal"):
                        return 200, ""
    return 200, ""


async def test_a_break_tag_that_never_closes_is_refused_at_once_on_every_surface(server):
    ws = server.replace("http://", "ws://", 1)
    cartesia = {"context_id": "c", "transcript": REDOS, "continue": False, "voice": VOICE, "model_id": "sonic-2",
                "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}
    with HealthProbe(server) as probe:
        async with aiohttp.ClientSession() as http:
            answers = [await http_answer(http, server, path, body) for path, body in [
                ("/v1/audio/speech", {"input": REDOS}),
                ("/v1/jobs", {"input": REDOS}),
                ("/v1/text-to-speech/default/stream", {"text": REDOS}),
                ("/tts/bytes", {**cartesia, "output_format": {**cartesia["output_format"], "container": "wav"}}),
                ("/v1/speak?model=default", {"text": REDOS})]]
            answers += [
                await socket_answer(http, ws + "/v1/stream", [{"type": "input.text", "text": REDOS},
                                                              {"type": "input.done"}],
                                    lambda e: e.get("type") == "error"),
                await socket_answer(http, ws + "/v1/audio/speech/stream",
                                    [{"type": "session.config"}, {"type": "input.text", "text": REDOS},
                                     {"type": "input.done"}], lambda e: e.get("type") == "error"),
                await socket_answer(http, ws + "/v1/text-to-speech/default/stream-input",
                                    [{"text": " "}, {"text": REDOS}, {"text": ""}], lambda e: "error" in e),
                await socket_answer(http, ws + "/tts/websocket?cartesia_version=2025-04-16", [cartesia],
                                    lambda e: e.get("type") == "error"),
                await socket_answer(http, ws + "/v1/speak?model=default",
                                    [{"type": "Speak", "text": REDOS}, {"type": "Flush"}],
                                    lambda e: e.get("type") == "Error"),
            ]
    assert probe.answers > 0 and probe.longest < STALL_BOUND_S, probe.longest
    for status, body in answers:  # each refused, naming the tag
        assert status == 400 and "no closing >" in body, (status, body[:300])


def mp3_seconds(data: bytes) -> float:
    with av.open(io.BytesIO(data), format="mp3") as container:
        samples = sum(frame.samples for frame in container.decode(audio=0))
        return samples / container.streams.audio[0].rate


async def test_minutes_of_pauses_in_mp3_never_stall_the_server(server):
    ws = server.replace("http://", "ws://", 1)
    seconds = PAUSES * 10.0
    with HealthProbe(server) as probe:
        async with aiohttp.ClientSession() as http:
            async with http.post(server + "/v1/text-to-speech/default/stream?output_format=mp3_44100_128",
                                 json={"text": PAUSED_TEXT}) as r:
                assert r.status == 200, await r.text()
                elevenlabs_http = await r.read()
            async with http.post(server + "/v1/audio/speech", json={"input": PAUSED_TEXT, "response_format": "mp3",
                                                                   "sample_rate": 44100, "stream_format": "audio"}) as r:
                assert r.status == 200, await r.text()
                openai = await r.read()
            elevenlabs_ws = bytearray()
            async with http.ws_connect(ws + "/v1/text-to-speech/default/stream-input?output_format=mp3_44100_128",
                                       max_msg_size=0) as socket:
                for text in (" ", PAUSED_TEXT, ""):
                    await socket.send_json({"text": text})
                async for frame in socket:
                    message = json.loads(frame.data)
                    elevenlabs_ws += base64.b64decode(message.get("audio") or "")
                    if message.get("isFinal"):
                        break
    assert probe.answers > 0 and probe.longest < STALL_BOUND_S, probe.longest
    for name, data in (("elevenlabs http", elevenlabs_http), ("openai", openai), ("elevenlabs ws", bytes(elevenlabs_ws))):
        assert mp3_seconds(data) == pytest.approx(seconds, abs=0.2), name
    # silence, all of it
    with av.open(io.BytesIO(openai), format="mp3") as container:
        assert max(float(np.abs(frame.to_ndarray()).max()) for frame in container.decode(audio=0)) < 1e-3


async def test_a_pause_goes_out_in_pieces_with_other_work_between_them():
    """Counted, not timed: another task of the loop runs before each piece of silence."""
    turns = 0

    async def other_work() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    parts = (Pause(10.0), Pause(2.5))
    plan = RequestPlan('<break time="10s"/><break time="2.5s"/>', SynthesisParams(), parts)
    sequence = UtteranceSequence(None, list(parts), metrics=None, plan=plan).start()  # pauses need no engine
    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    pieces, samples = 0, 0
    try:
        while True:
            before = turns
            chunk = await sequence.next_chunk()
            assert turns > before, pieces
            pieces, samples = pieces + 1, samples + chunk.pcm.size
            assert chunk.pcm.size <= SAMPLE_RATE and not chunk.pcm.any()
            if chunk.is_final:
                break
    finally:
        task.cancel()
    assert samples == int(12.5 * SAMPLE_RATE) and pieces == 13
