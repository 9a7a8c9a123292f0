"""Long text is planned as utterances (service/synthesis/plan.py) and played as one stream
(service/synthesis/sequence.py), on speech and on ``/v1/stream``: a 4,000-character request on
the tiny talker is spoken to its end, one utterance after another, each under its frame budget;
the waveform is continuous at every seam (no click); word times run across the whole text.

Real server, real clients, the talker oracle fixture with the random forced aligner; the engine's
``submit`` is wrapped only to record what reached it (each utterance's text and raw audio)."""

from __future__ import annotations

import base64
import json

import aiohttp
import numpy as np
import websockets
from conftest import start_server
from testsupport.long_text import Recorded, long_text
from ws_helpers import read_until_session_done

from engines.contract import SynthesisRequest
from service.synthesis.sequence import SEAM_FADE_SAMPLES


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768


def check_seams(audio: np.ndarray, parts: list[np.ndarray]) -> list[int]:
    """The audio is the parts back to back, faded at each seam: -> the seams' sample offsets."""
    assert audio.size == sum(p.size for p in parts)  # nothing cut, no gap inserted
    seams = np.cumsum([p.size for p in parts])[:-1]
    for seam in seams:
        # both sides meet at silence: no step in the waveform
        assert abs(audio[seam - 1]) <= 0.01 and abs(audio[seam]) <= 0.01, (seam, audio[seam - 2:seam + 2])
        # and away from the seam the audio is the engine's, untouched
        assert np.allclose(audio[seam + SEAM_FADE_SAMPLES:seam + 2 * SEAM_FADE_SAMPLES],
                           np.concatenate(parts)[seam + SEAM_FADE_SAMPLES:seam + 2 * SEAM_FADE_SAMPLES], atol=2e-4)
    # without the fade the utterances' waveforms would step at some seam (each decoder starts anew)
    steps = [abs(parts[i][-1] - parts[i + 1][0]) for i in range(len(parts) - 1)]
    assert max(steps) > 0.05, steps
    return list(seams)


async def test_a_4000_character_request_is_spoken_to_its_end_as_utterances(aligned_talker, tmp_path):
    text = long_text(4000)
    live = await start_server(aligned_talker, tmp_path / "data")
    try:
        with Recorded(aligned_talker) as recorded:
            async with aiohttp.ClientSession() as http:
                async with http.post(live.url + "/v1/audio/speech", json={
                        "input": text, "response_format": "pcm", "stream": True, "timestamps": True,
                        "temperature": 0}) as response:
                    assert response.status == 200, await response.text()
                    events = [json.loads(line[6:]) for line in (await response.text()).splitlines()
                              if line.startswith("data: ")]
        kinds = [e["type"] for e in events]
        assert kinds[-1] == "speech.audio.done" and "error" not in kinds
        texts = [r.text for r in recorded.requests]
        assert len(texts) >= 10 and " ".join(texts) == text  # in order, every word, nothing dropped
        budgets = [aligned_talker.planned_work(SynthesisRequest(id="p", text=t, max_new_tokens=8192)).model_steps
                   for t in texts]
        assert max(budgets) <= 1024 < aligned_talker.planned_work(SynthesisRequest(id="p", text=text,
                                                                         max_new_tokens=8192)).model_steps
        assert len({r.seed for r in recorded.requests}) == 1 and len({r.voice for r in recorded.requests}) == 1
        audio = pcm16(b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"))
        parts = [recorded.raw(r) for r in recorded.requests]
        assert all(p.size > 0 for p in parts)  # every utterance spoke
        seams = check_seams(audio, parts)
        # word times: across the whole text, each utterance's after the audio before it
        alignment = next(e for e in events if e["type"] == "speech.audio.alignment")
        assert alignment["text"] == text
        words = alignment["words"]
        starts = [w["start_ms"] for w in words]
        assert starts == sorted(starts) and words[-1]["end_ms"] <= audio.size / 24 + 1
        assert words[-1]["char_end"] >= len(text) - len("and so on.")  # times to the last words
        offsets = np.cumsum([0] + [len(t) + 1 for t in texts])
        for i, seam in enumerate(seams, start=1):  # the words of utterance i start after seam i
            later = [w for w in words if w["char_start"] >= offsets[i]]
            assert later and later[0]["start_ms"] >= seam / 24 - 1
    finally:
        await live.stop()


async def test_a_long_unfinished_sentence_on_the_socket_is_one_utterance_of_several_parts(aligned_talker, tmp_path):
    text = long_text(1500, terminators=False)  # no sentence end: input.done flushes it whole
    live = await start_server(aligned_talker, tmp_path / "data")
    try:
        with Recorded(aligned_talker) as recorded:
            async with websockets.connect(live.ws_url) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                await ws.send(json.dumps({"type": "session.config", "text_streaming": False, "temperature": 0,
                                          "timestamps": True}))
                await ws.send(json.dumps({"type": "input.text", "text": text}))
                await ws.send(json.dumps({"type": "input.done"}))
                read = await read_until_session_done(ws, timeout_s=120)
        assert [e["type"] for e in read.events if e["type"].startswith("audio.")] == ["audio.start", "audio.done"]
        texts = [r.text for r in recorded.requests]
        assert len(texts) >= 3 and " ".join(texts) == text
        audio = pcm16(read.audio)
        assert read.last("audio.done")["samples"] == audio.size
        check_seams(audio, [recorded.raw(r) for r in recorded.requests])
        words = read.last("alignment")["words"]
        assert [w["start_ms"] for w in words] == sorted(w["start_ms"] for w in words)
    finally:
        await live.stop()


async def test_a_cancel_stops_a_long_text_in_its_current_utterance(aligned_talker, tmp_path):
    text = long_text(3000, terminators=False)  # one sentence: one socket utterance of many parts
    live = await start_server(aligned_talker, tmp_path / "data")
    try:
        with Recorded(aligned_talker) as recorded:
            async with websockets.connect(live.ws_url) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                await ws.send(json.dumps({"type": "session.config", "text_streaming": False, "temperature": 0}))
                await ws.send(json.dumps({"type": "input.text", "text": text}))
                await ws.send(json.dumps({"type": "input.done"}))
                while not isinstance(await ws.recv(), bytes):  # audio is playing
                    pass
                await ws.send(json.dumps({"type": "response.cancel"}))
                events = []
                while len([e for e in events if e["type"] == "session.done"]) < 2:
                    message = await ws.recv()
                    if isinstance(message, str):
                        events.append(json.loads(message))
        done = next(e for e in events if e["type"] == "audio.done")
        assert done["cancelled"] is True and "error" not in done
        # what was being spoken and the one prepared after it, not the rest of the text
        assert 1 <= len(recorded.requests) <= 3 and len(text) > 3 * len(recorded.requests[0].text)
    finally:
        await live.stop()
