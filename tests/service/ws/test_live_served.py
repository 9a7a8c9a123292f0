"""Live text over the WebSocket, served end to end: the fixture talker checkpoint,
the real server, a real websockets client.

Exactness: one message, one character per message, and random deltas with random delays give
byte-identical PCM, equal to the official ``generate()`` in streaming-text mode for that text
(the oracle fixture's codes, decoded by our decoder: 2 LSB of PCM16 quantization, as in
test_talker_served.py). Earliness: at ~20 tokens/s the first audio arrives before the first
sentence has finished arriving; in sentence mode (``text_streaming: false``) it does not.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import numpy as np
import pytest
import torch
import websockets
from conftest import start_server, wait_until

from tests.oracle import talker_fixtures as fx

pytestmark = pytest.mark.parity
LSB = 1 / 32768
CASE = "p0_vivian_auto_stream"  # official generate(non_streaming_mode=False), greedy


async def speak(url: str, deltas: list[str], config: dict, delays: list[float] | None = None,
                done: bool = True) -> dict:
    """Send the deltas (with delays), then input.done; -> pcm, events, timings."""
    events, pcm = [], bytearray()
    t_first_audio = None
    async with websockets.connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.config", "temperature": 0, **config}))  # greedy: exact

        async def reader():
            nonlocal t_first_audio
            async for msg in ws:
                if isinstance(msg, bytes):
                    if t_first_audio is None:
                        t_first_audio = time.monotonic()
                    pcm.extend(msg)
                    continue
                event = json.loads(msg)
                events.append(event)
                if event["type"] == "session.done":
                    return

        task = asyncio.create_task(reader())
        t0 = time.monotonic()
        for i, d in enumerate(deltas):
            await ws.send(json.dumps({"type": "input.text", "text": d}))
            if delays:
                await asyncio.sleep(delays[i])
        t_sent = time.monotonic()
        if done:
            await ws.send(json.dumps({"type": "input.done"}))
        await asyncio.wait_for(task, 60)
    return {"pcm": bytes(pcm), "events": events, "t0": t0, "t_sent": t_sent, "t_first_audio": t_first_audio}


def official_pcm(engine) -> np.ndarray:
    codes = fx.references("cv_proj")[f"case/{CASE}/codes"]
    with torch.no_grad():
        return engine.models.decoder(codes.T[None])[0].numpy()


async def test_any_split_and_delay_gives_the_official_streaming_text_audio(talker_engine, tmp_path):
    c = fx.cases("cv_proj")[CASE]
    text, config = c["prompt"], {"voice": c["speaker"], "language": c["language"]}
    rng = random.Random(16)
    server = await start_server(talker_engine, tmp_path / "data")
    try:
        whole = await speak(server.ws_url, [text], config)
        chars = await speak(server.ws_url, list(text), config)
        parts, i = [], 0
        while i < len(text):
            k = rng.randint(1, 7)
            parts.append(text[i:i + k])
            i += k
        jittered = await speak(server.ws_url, parts, config, delays=[rng.uniform(0, 0.05) for _ in parts])
    finally:
        await server.stop()
    for run in (whole, chars, jittered):
        assert not [e for e in run["events"] if e["type"] == "error"], run["events"]
        starts = [e for e in run["events"] if e["type"] == "audio.start"]
        dones = [e for e in run["events"] if e["type"] == "audio.done"]
        assert len(starts) == len(dones) == 1 and starts[0]["live"] is True
        # The text the utterance had received when it ended (this tiny model ends by EOS early,
        # as generate() does on the whole text: later text of the utterance is not spoken).
        assert text.startswith(dones[0]["text"]) and dones[0]["text_start"] == 0
        assert dones[0]["text_end"] == len(dones[0]["text"])
    # The codes decide the audio; chunk sizes follow the engine's load (engines/core/scheduler.py), and
    # the codec decoder's float math in other chunk sizes may move a PCM16 sample by a rounding step.
    pcm = [np.frombuffer(run["pcm"], dtype="<i2").astype(np.int32) for run in (whole, chars, jittered)]
    assert all(p.shape == pcm[0].shape and np.abs(p - pcm[0]).max() <= 2 for p in pcm)
    audio = np.frombuffer(whole["pcm"], dtype="<i2").astype(np.float32) / 32768
    expected = official_pcm(talker_engine)
    assert len(audio) == len(expected) > 0
    np.testing.assert_allclose(audio, expected, atol=2 * LSB, rtol=0)


async def test_first_audio_before_the_first_sentence_has_arrived(talker_engine, tmp_path):
    """~20 tokens/s (one word every 50 ms): live mode speaks before the sentence's last word
    was sent; sentence mode cannot (it waits for the sentence end)."""
    words = ("Hello world, this is a small test of streaming speech, and it keeps going for a while "
             "before the sentence finally ends.").split(" ")
    deltas = [w if i == 0 else " " + w for i, w in enumerate(words)]
    delays = [0.05] * len(deltas)
    config = {"voice": "Vivian"}
    server = await start_server(talker_engine, tmp_path / "data")
    try:
        live = await speak(server.ws_url, deltas, config, delays=delays)
        sentence = await speak(server.ws_url, deltas, {**config, "text_streaming": False}, delays=delays)
    finally:
        await server.stop()
    assert live["t_first_audio"] is not None and live["t_first_audio"] < live["t_sent"], \
        (live["t_first_audio"] - live["t0"], live["t_sent"] - live["t0"])
    assert sentence["t_first_audio"] is not None and sentence["t_first_audio"] > sentence["t_sent"]
    assert [e.get("live") for e in sentence["events"] if e["type"] == "audio.start"] == [None]


def _utterances(run: dict) -> list[dict]:
    return [e for e in run["events"] if e["type"] == "audio.done"]


async def test_utterance_boundaries_and_rounds(talker_engine, tmp_path):
    """Past --ws-live-utterance-chars a live utterance ends at the next sentence end; the next
    one starts with the following text. Text after input.done opens the next round's utterance
    and never reaches the finished one."""
    first = fx.cases("cv_proj")[CASE]["prompt"]  # "Hello world, this is a test."
    text = f"{first}  Streaming speech, 2026 camelCase! Tail words"
    rng = random.Random(3)
    parts, i = [], 0
    while i < len(text):
        k = rng.randint(1, 5)
        parts.append(text[i:i + k])
        i += k
    server = await start_server(talker_engine, tmp_path / "data", ws_live_utterance_chars=20)
    try:
        run = await speak(server.ws_url, parts, {"voice": "Vivian"})
        # Round 1 ends with input.done; the text after it is round 2's.
        events, pcm_by_round = [], []
        async with websockets.connect(server.ws_url) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.config", "voice": "Vivian", "temperature": 0}))
            for msg in ({"type": "input.text", "text": first}, {"type": "input.done"},
                        {"type": "input.text", "text": "More text"}, {"type": "input.done"}):
                await ws.send(json.dumps(msg))
            pcm = bytearray()
            async for msg in ws:
                if isinstance(msg, bytes):
                    pcm.extend(msg)
                    continue
                events.append(json.loads(msg))
                if events[-1]["type"] == "audio.done":
                    pcm_by_round.append(bytes(pcm))
                    pcm.clear()
                if sum(e["type"] == "session.done" for e in events) == 2:
                    break
    finally:
        await server.stop()
    done = _utterances(run)
    assert [d["text"] for d in done] == [first, "Streaming speech, 2026 camelCase!", "Tail words"]
    for d in done:
        assert text[d["text_start"]:d["text_end"]] == d["text"]
    assert [e["utterances"] for e in run["events"] if e["type"] == "session.done"] == [3]
    # Utterance 1 of the long text is the official streaming-text audio of its sentence.
    audio = np.frombuffer(pcm_by_round[0], dtype="<i2").astype(np.float32) / 32768
    np.testing.assert_allclose(audio, official_pcm(talker_engine), atol=2 * LSB, rtol=0)
    assert [d["text"] for d in events if d["type"] == "audio.done"] == [first, "More text"]
    assert [e["utterances"] for e in events if e["type"] == "session.done"] == [1, 1]


async def test_bad_input_cancel_idle_and_disconnect(talker_engine, tmp_path):
    server = await start_server(talker_engine, tmp_path / "data", max_input_chars=64, ws_idle_timeout_s=0.6)
    try:
        async with websockets.connect(server.ws_url) as ws:
            await ws.recv()
            # An oversize delta: an error, nothing queued, the session keeps working.
            await ws.send(json.dumps({"type": "input.text", "text": "x" * 100}))
            assert json.loads(await ws.recv())["code"] == "text_too_long"
            # Cancel a live utterance while its text is still arriving.
            await ws.send(json.dumps({"type": "input.text", "text": "Hello world, this is"}))
            while json.loads(await ws.recv())["type"] != "audio.start":
                pass
            await ws.send(json.dumps({"type": "response.cancel"}))
            seen = []
            while True:
                msg = await ws.recv()
                if isinstance(msg, str):
                    seen.append(json.loads(msg))
                    if seen[-1]["type"] == "session.done":
                        break
            done = [x for x in seen if x["type"] == "audio.done"]
            assert done and done[0].get("cancelled") is True
            # Text, then silence without input.done: input_idle ends the utterance, its audio follows,
            # then the idle session closes as before (idle_timeout).
            await ws.send(json.dumps({"type": "input.text", "text": "Hello world, this is"}))
            events, samples = [], 0
            async for msg in ws:
                if isinstance(msg, bytes):
                    samples += len(msg) // 2
                    continue
                events.append(json.loads(msg))
            kinds = [(x["type"], x.get("code")) for x in events]
            assert ("error", "input_idle") in kinds and ("error", "idle_timeout") in kinds, kinds
            done = [x for x in events if x["type"] == "audio.done"]
            assert done[0]["text"] == "Hello world, this is" and done[0]["samples"] == samples > 0
        # A client that leaves mid-utterance: its request ends, the next session is served.
        async with websockets.connect(server.ws_url) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "input.text", "text": "Hello world, this"}))
            await wait_until(lambda: talker_engine.stats().active_requests == 1)  # it leaves mid-utterance
        await wait_until(lambda: talker_engine.stats().active_requests == 0, timeout_s=5)
        run = await speak(server.ws_url, ["Hello world."], {"voice": "Vivian"})
        assert _utterances(run)[0]["samples"] > 0
    finally:
        await server.stop()


async def test_client_async_iterator_and_say_stdin(talker_engine, tmp_path):
    """Text in as it comes, audio out as it is made: the Python client's ``stream_speech``
    yields audio before its text iterator is exhausted; ``streamvox say --stdin`` (a real
    subprocess reading a pipe that is written slowly) speaks the same text to the same audio."""
    import sys
    from pathlib import Path

    import soundfile as sf

    from clients.client import StreamvoxClient

    c = fx.cases("cv_proj")[CASE]
    words = [w if i == 0 else " " + w for i, w in enumerate(c["prompt"].split(" "))]
    server = await start_server(talker_engine, tmp_path / "data")
    try:
        sent, audio_while_sending = [], []

        async def text():
            for w in words:
                sent.append(w)
                yield w
                await asyncio.sleep(0.15)

        pcm = bytearray()
        async with StreamvoxClient(server.url) as client:
            async for piece in client.stream_speech(text(), voice=c["speaker"], temperature=0):
                if len(sent) < len(words):
                    audio_while_sending.append(len(piece))
                pcm.extend(piece)
        assert audio_while_sending, "audio arrived while the text was still being produced"
        audio = np.frombuffer(bytes(pcm), dtype="<i2").astype(np.float32) / 32768
        np.testing.assert_allclose(audio, official_pcm(talker_engine), atol=2 * LSB, rtol=0)

        out = tmp_path / "stdin.wav"
        repo = Path(__file__).resolve().parents[3]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "clients.cli", "say", "--stdin", "--voice", c["speaker"], "--temperature", "0", "--out", str(out),
            "--url", server.url, cwd=repo, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        for w in words:
            proc.stdin.write(w.encode())
            await proc.stdin.drain()
            await asyncio.sleep(0.05)
        proc.stdin.close()
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, stderr.decode()
        assert "after the first text" in stdout.decode()
        data, rate = sf.read(str(out), dtype="int16")
        # the same codes; chunk sizes follow the engine's load, which may move a sample by a rounding step
        first = np.frombuffer(bytes(pcm), dtype="<i2").astype(np.int32)
        assert rate == 24000 and data.shape == first.shape and np.abs(data.astype(np.int32) - first).max() <= 2
    finally:
        await server.stop()


async def test_a_row_waiting_for_text_does_not_spin_the_worker(talker_engine, tmp_path):
    """While every live row waits for text the worker sleeps until text arrives (TextFeed wakes
    it, or its 50 ms poll while requests are active): tens of idle ticks a second at most, not a
    busy loop (a spinning worker makes thousands). "A b" commits one text id ("b" may still
    grow): the row is prefilled and waits at decode step 0 for text id 1."""
    server = await start_server(talker_engine, tmp_path / "data")
    try:
        async with websockets.connect(server.ws_url) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.config", "voice": "Ryan", "language": "English", "temperature": 0}))
            await ws.send(json.dumps({"type": "input.text", "text": "A b"}))
            await wait_until(lambda: talker_engine.stats().active_requests == 1)  # admitted, waiting for text
            before = talker_engine.stats().ticks
            await asyncio.sleep(1.0)
            idle_ticks = talker_engine.stats().ticks - before
            assert talker_engine.stats().active_requests == 1
            await ws.send(json.dumps({"type": "input.text", "text": "c."}))
            await ws.send(json.dumps({"type": "input.done"}))
            while True:
                msg = await ws.recv()
                if isinstance(msg, str) and json.loads(msg)["type"] == "session.done":
                    break
        assert idle_ticks <= 50, idle_ticks
    finally:
        await server.stop()


async def test_text_streaming_config_is_checked(server):
    """``text_streaming`` must be a boolean; true on a DiT server is refused (the DiT pipeline
    keeps sentence utterances); a refused config changes nothing and the session keeps working."""
    async with websockets.connect(server.ws_url) as ws:
        await ws.recv()
        for bad in ({"text_streaming": "yes"}, {"text_streaming": True}, {"text_streaming": "yes", "seed": 9}):
            await ws.send(json.dumps({"type": "session.config", **bad}))
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and error["code"] == "invalid_field" and "text_streaming" in error["message"]
        await ws.send(json.dumps({"type": "input.text", "text": "Hi there."}))
        await ws.send(json.dumps({"type": "input.done"}))
        events = []
        while not events or events[-1]["type"] != "session.done":
            msg = await ws.recv()
            if isinstance(msg, str):
                events.append(json.loads(msg))
        start = next(e for e in events if e["type"] == "audio.start")
        assert start["text"] == "Hi there." and "live" not in start
