"""Streaming never underruns silently. A real server whose engine is slower than real time
by construction - the engine's fault hook sleeps 1.2 s before every vocoder piece, and a
piece after the first holds at most 12 frames (0.96 s) of the tiny preset's audio - so
every chunk after the first comes after the listener ran dry, however fast the machine.
WebSocket clients get ``stream.behind`` events and ``audio.done.behind_s``; SSE clients the
same event and ``speech.audio.done.behind_s``; every stream, raw audio included, is counted
on /metrics. The clock itself is checked on given times (no timing in those asserts)."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import aiohttp
import numpy as np
import pytest
import soundfile as sf
import websockets
from conftest import metric_value, start_server

from service.synthesis.chunks import BEHIND_TOLERANCE_S, PlaybackClock

TEXT = "Hello there, this stream is slower than real time."
PIECE_DELAY_S = 1.2  # > 0.96 s, the audio of the largest piece after the first


@pytest.fixture(scope="module")
def slow_engine():
    from engines.build import build_engine
    from engines.config import EngineConfig

    slow = threading.Event()  # off during the warm-up: the engine starts at its own speed

    def slow_vocoder(request_id: str, stage: str) -> None:
        if stage == "vocalize" and slow.is_set():
            time.sleep(PIECE_DELAY_S)

    engine = build_engine(EngineConfig.for_tests(), slow_vocoder)
    engine.start()
    slow.set()
    yield engine
    engine.stop()


async def test_websocket_client_is_told_when_the_stream_falls_behind(slow_engine, tmp_path):
    live = await start_server(slow_engine, tmp_path / "data")
    try:
        async with websockets.connect(live.ws_url, max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            await ws.send(json.dumps({"type": "input.done"}))
            log: list = []  # events and binary frame sizes, in order
            while not (log and isinstance(log[-1], dict) and log[-1]["type"] == "session.done"):
                message = await ws.recv()
                log.append(len(message) if isinstance(message, bytes) else json.loads(message))
        behind = [m for m in log if isinstance(m, dict) and m["type"] == "stream.behind"]
        assert behind, log
        first = log.index(behind[0])
        assert any(isinstance(m, int) for m in log[:first])  # after some audio: an underrun, not a slow start
        assert isinstance(log[first + 1], int)  # the late audio follows at once
        for event in behind:
            assert event["utterance"] == 0 and event["gap_s"] > 0 and event["behind_s"] >= event["gap_s"]
            assert "slower than real time" in event["message"]
        done = next(m for m in log if isinstance(m, dict) and m["type"] == "audio.done")
        assert done["underruns"] == len(behind) and done["behind_s"] == pytest.approx(behind[-1]["behind_s"])
        assert sum(m for m in log if isinstance(m, int)) == 2 * done["samples"]  # every sample still arrives
    finally:
        await live.stop()


async def test_sse_client_is_told_and_raw_audio_is_counted(slow_engine, tmp_path):
    live = await start_server(slow_engine, tmp_path / "data")
    try:
        before = await metric_value(live.url, "streamvox_stream_behind_total")
        async with aiohttp.ClientSession() as http:
            body = {"input": TEXT, "response_format": "wav", "stream_format": "sse"}
            async with http.post(live.url + "/v1/audio/speech", json=body) as response:
                assert response.status == 200 and response.content_type == "text/event-stream"
                events = [json.loads(line[len(b"data: "):]) async for line in response.content
                          if line.startswith(b"data: ")]
            kinds = [e["type"] for e in events]
            assert "stream.behind" in kinds and kinds[-1] == "speech.audio.done", kinds
            first = kinds.index("stream.behind")
            assert "speech.audio.delta" in kinds[:first] and kinds[first + 1] == "speech.audio.delta"
            assert events[-1]["behind_s"] > 0
            wav = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
            audio, rate = sf.read(io.BytesIO(wav), dtype="float32")
            assert rate == 24000 and audio.size > 24000 and np.abs(audio).max() > 0
            after_sse = await metric_value(live.url, "streamvox_stream_behind_total")
            assert after_sse - before == kinds.count("stream.behind")

            body = {"input": TEXT, "response_format": "pcm", "stream_format": "audio"}
            async with http.post(live.url + "/v1/audio/speech", json=body) as response:
                assert response.status == 200
                assert await response.read()
        assert await metric_value(live.url, "streamvox_stream_behind_total") > after_sse
        assert await metric_value(live.url, "streamvox_stream_behind_seconds_total") > 0
    finally:
        await live.stop()


async def test_vllm_omni_dialect_passes_it_on_only_to_streamed_audio(slow_engine, tmp_path):
    live = await start_server(slow_engine, tmp_path / "data")
    try:
        url = live.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
        kinds = {}
        for stream_audio in (True, False):
            async with websockets.connect(url, max_size=None) as ws:
                await ws.send(json.dumps({"type": "session.config", "response_format": "wav",
                                          "stream_audio": stream_audio}))
                await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
                await ws.send(json.dumps({"type": "input.done"}))
                seen = []
                while not seen or seen[-1] != "session.done":
                    message = await ws.recv()
                    seen.append("audio" if isinstance(message, bytes) else json.loads(message)["type"])
                kinds[stream_audio] = seen
        assert "stream.behind" in kinds[True], kinds[True]
        # each sentence as one file: nobody plays it as it is generated, so nothing is behind
        assert kinds[False] == ["audio.start", "audio", "audio.done", "session.done"], kinds[False]
    finally:
        await live.stop()


def test_playback_clock_on_given_times():
    tenth = 2400  # samples: 0.1 s at 24 kHz
    clock = PlaybackClock(24000)
    assert clock.add(tenth, 10.0) == 0.0  # the first audio: time to first audio is no underrun
    assert clock.add(tenth, 10.1) == 0.0  # exactly on time
    assert clock.add(tenth, 10.2 + BEHIND_TOLERANCE_S / 2) == 0.0  # a gap within the tolerance
    assert clock.add(0, 99.0) == 0.0  # an empty (final) chunk plays nothing
    gap = clock.add(tenth, 11.0)
    assert gap == pytest.approx(11.0 - (10.3 + BEHIND_TOLERANCE_S / 2))
    assert clock.underruns == 1 and clock.behind_s == pytest.approx(gap)
    assert clock.add(tenth, 12.0, count=False) == 0.0  # live text still arriving: not the server's gap
    assert clock.underruns == 1 and clock.runs_dry_at == pytest.approx(12.1)
    # Audio prefetched while the previous utterance still plays starts where that one stops.
    prefetched = PlaybackClock(24000, starts_at=20.0)
    assert prefetched.add(tenth, 15.0) == 0.0 and prefetched.runs_dry_at == pytest.approx(20.1)
    assert prefetched.add(tenth, 19.0) == 0.0  # early, not late
    assert prefetched.add(tenth, 20.5) == pytest.approx(0.3)
