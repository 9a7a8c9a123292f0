"""Word timestamps reach every client surface of a live server (real sockets, real clients):
/v1/stream ``alignment`` messages, speech SSE, ElevenLabs' sockets and with-timestamps stream,
Cartesia's ``timestamps``; none without an aligner (never invented times).

The aligner is the random official-layout checkpoint tests/oracle/aligner_fixtures.py builds
(tests/fixtures/aligner/tiny): its times are degenerate but real, so the checks are the
plumbing - units are the official word split of the text sent, times non-decreasing and
inside the piece (on the stream's clock), character spans locating each word - not accuracy.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import aiohttp
import pytest
import websockets
from conftest import ALIGNER, start_server

from engines.pipelines.aligner.words import split_words

PIECES = ["Hello there, ", "my friend. How are ", "you today?"]
TEXT = "".join(PIECES)
SENTENCES = ["Hello there, my friend.", "How are you today?"]


@pytest.fixture
async def aligned(aligned_engine, tmp_path):
    server = await start_server(aligned_engine, tmp_path / "data")
    yield server
    await server.stop()


def check_words(words: list[dict], text: str, start_ms: float, end_ms: float) -> None:
    """The official units of ``text``, located in it, non-decreasing inside [start_ms, end_ms]."""
    assert [w["word"] for w in words] == split_words(text, "english")
    last = start_ms
    for w in words:
        assert text[w["char_start"]:w["char_end"]] == w["word"]
        assert last <= w["start_ms"] <= w["end_ms"] <= end_ms + 0.5, (w, start_ms, end_ms)
        last = w["start_ms"]


async def stream_round(url: str, timestamps: bool | None) -> tuple[list[dict], dict[int, int]]:
    """Text in pieces over /v1/stream; the JSON messages and the PCM bytes per utterance."""
    async with websockets.connect(url, max_size=None) as ws:
        json.loads(await ws.recv())
        config = {"type": "session.config", "voice": "default"}
        if timestamps is not None:
            config["timestamps"] = timestamps
        await ws.send(json.dumps(config))
        for piece in PIECES:
            await ws.send(json.dumps({"type": "input.text", "text": piece}))
        await ws.send(json.dumps({"type": "input.done"}))
        events, sizes, current = [], {}, None
        while True:
            message = await asyncio.wait_for(ws.recv(), 120)
            if isinstance(message, bytes):
                sizes[current] = sizes.get(current, 0) + len(message)
                continue
            event = json.loads(message)
            events.append(event)
            if event["type"] == "audio.start":
                current = event["utterance"]
            if event["type"] == "session.done":
                return events, sizes


async def test_stream_alignment_messages(aligned):
    events, sizes = await stream_round(aligned.ws_url, timestamps=True)
    alignments = [e for e in events if e["type"] == "alignment"]
    assert [a["text"] for a in alignments] == SENTENCES
    clock = 0.0
    for a in alignments:
        u = a["utterance"]
        duration = sizes[u] / 2 / 24000 * 1000
        assert a["offset_ms"] == pytest.approx(clock, abs=0.1)  # the session's clock: audio sent before it
        check_words(a["words"], a["text"], clock, clock + duration)
        # after the utterance's audio, before its audio.done
        kinds = [(e["type"], e.get("utterance")) for e in events]
        assert kinds.index(("alignment", u)) + 1 == kinds.index(("audio.done", u))
        clock += duration
    # not asked: no alignment
    events, _ = await stream_round(aligned.ws_url, timestamps=None)
    assert not [e for e in events if e["type"] == "alignment"]


async def test_stream_without_an_aligner_sends_none(server):
    events, sizes = await stream_round(server.ws_url, timestamps=True)
    assert sum(sizes.values()) > 0
    assert not [e for e in events if e["type"] == "alignment"]


async def test_stream_timestamps_must_be_a_bool(aligned):
    async with websockets.connect(aligned.ws_url) as ws:
        json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "session.config", "timestamps": "yes"}))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and "timestamps" in error["message"]


async def test_models_says_whether_timestamps_are_served(aligned, server):
    async with aiohttp.ClientSession() as http:
        async with http.get(aligned.url + "/v1/models") as r:
            on = (await r.json())["data"][0]["timestamps"]
        async with http.get(server.url + "/v1/models") as r:
            off = (await r.json())["data"][0]["timestamps"]
    assert on["available"] is True and on["aligner"] == ALIGNER.name and "english" in on["languages"]
    assert off == {"available": False, "aligner": None, "languages": []}


async def sse_events(url: str, timestamps: bool) -> list[dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/audio/speech", json={"input": TEXT, "stream_format": "sse",
                                                             "response_format": "pcm", "timestamps": timestamps}) as r:
            assert r.status == 200
            body = await r.text()
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]


async def test_sse_alignment_event(aligned, server):
    events = await sse_events(aligned.url, True)
    samples = sum(len(base64.b64decode(e["audio"])) for e in events if e["type"] == "speech.audio.delta") // 2
    (alignment,) = [e for e in events if e["type"] == "speech.audio.alignment"]
    assert alignment["text"] == TEXT
    check_words(alignment["words"], TEXT, 0.0, samples / 24000 * 1000)
    assert [e["type"] for e in events][-2:] == ["speech.audio.alignment", "speech.audio.done"]
    assert not [e for e in await sse_events(aligned.url, False) if e["type"] == "speech.audio.alignment"]
    assert not [e for e in await sse_events(server.url, True) if e["type"] == "speech.audio.alignment"]


def chars_cover(alignment: dict, text: str, duration_ms: float) -> None:
    """ElevenLabs' per-character arrays: the whole text, non-decreasing, inside the audio."""
    assert "".join(alignment["chars"]) == text
    starts, durations = alignment["charStartTimesMs"], alignment["charDurationsMs"]
    assert len(starts) == len(durations) == len(text)
    assert all(a <= b for a, b in zip(starts, starts[1:]))
    assert all(d >= 0 for d in durations) and starts[-1] + durations[-1] <= duration_ms + 1


async def elevenlabs_messages(base: str) -> list[dict]:
    url = base.replace("http", "ws", 1) + "/v1/text-to-speech/default/stream-input?output_format=pcm_24000"
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"text": " "}))
        for piece in PIECES:
            await ws.send(json.dumps({"text": piece}))
        await ws.send(json.dumps({"text": ""}))
        messages = []
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 120))
            messages.append(message)
            if message.get("isFinal"):
                return messages


async def test_elevenlabs_socket_alignment(aligned, server):
    messages = await elevenlabs_messages(aligned.url)
    sizes, aligned_texts = [], []
    size = 0
    for m in messages:
        if m.get("audio"):
            size += len(base64.b64decode(m["audio"]))
        if m.get("alignment"):
            assert m["normalizedAlignment"] == m["alignment"]
            assert m["alignment"]["chars"][-1] == " "  # the space between utterances, restored
            text = "".join(m["alignment"]["chars"])[:-1]
            m["alignment"] = {k: v[:-1] for k, v in m["alignment"].items()}
            # times restart at zero in every message (ElevenLabs): inside this utterance's audio
            chars_cover(m["alignment"], text, size / 2 / 24000 * 1000)
            aligned_texts.append(text)
            sizes.append(size)
            size = 0
    assert aligned_texts == SENTENCES
    off = await elevenlabs_messages(server.url)
    assert all(m.get("alignment") is None and m.get("normalizedAlignment") is None for m in off)


async def test_elevenlabs_http_with_timestamps(aligned, server):
    async def lines(base):
        async with aiohttp.ClientSession() as http:
            async with http.post(base + "/v1/text-to-speech/default/stream/with-timestamps?output_format=pcm_24000",
                                 json={"text": TEXT}) as r:
                assert r.status == 200
                return [json.loads(line) for line in (await r.text()).splitlines() if line.strip()]
    got = await lines(aligned.url)
    samples = sum(len(base64.b64decode(x["audio_base64"])) for x in got) // 2
    timed = [x["alignment"] for x in got if x["alignment"]]  # one line after each utterance's audio
    assert ["".join(t["characters"]).strip() for t in timed] == SENTENCES
    assert "".join(c for t in timed for c in t["characters"]).strip() == TEXT.strip()
    starts = [s for t in timed for s in t["character_start_times_seconds"]]  # from the start of the response
    ends = [e for t in timed for e in t["character_end_times_seconds"]]
    assert all(a <= b for a, b in zip(starts, starts[1:])) and all(s <= e for s, e in zip(starts, ends))
    assert ends[-1] <= samples / 24000 + 0.001
    assert all(x["alignment"] is None for x in await lines(server.url))


async def cartesia_messages(base: str, add_timestamps: bool) -> list[dict]:
    url = base.replace("http", "ws", 1) + "/tts/websocket"
    fmt = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}
    async with websockets.connect(url, max_size=None) as ws:
        for i, piece in enumerate(PIECES):
            await ws.send(json.dumps({"context_id": "c1", "transcript": piece, "continue": i < len(PIECES) - 1,
                                      "voice": {"mode": "id", "id": "default"}, "output_format": fmt,
                                      "add_timestamps": add_timestamps}))
        messages = []
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 120))
            messages.append(message)
            if message["type"] in ("done", "error"):
                return messages


async def test_cartesia_timestamps(aligned, server):
    messages = await cartesia_messages(aligned.url, True)
    stamps = [m for m in messages if m["type"] == "timestamps"]
    assert len(stamps) == 2
    clock = 0.0
    words = []
    for m in messages:
        if m["type"] == "chunk":
            clock += len(base64.b64decode(m["data"])) / 2 / 24000
        if m["type"] == "timestamps":
            ts = m["word_timestamps"]
            assert m["context_id"] == "c1" and len(ts["words"]) == len(ts["start"]) == len(ts["end"])
            assert all(s <= e <= clock + 0.001 for s, e in zip(ts["start"], ts["end"]))  # the context's clock
            words += ts["words"]
    assert words == split_words(TEXT, "english")
    starts = [s for m in stamps for s in m["word_timestamps"]["start"]]
    assert starts == sorted(starts)
    assert not [m for m in await cartesia_messages(aligned.url, False) if m["type"] == "timestamps"]
    assert not [m for m in await cartesia_messages(server.url, True) if m["type"] == "timestamps"]


def test_slow_alignment_never_delays_first_audio(tmp_path):
    """A request arriving as another's audio ends gets its first audio before that one's (slow)
    alignment runs: the worker aligns only while nobody waits for first audio."""
    from engines.build import build_engine
    from engines.config import EngineConfig
    from engines.contract import SynthesisRequest

    order: list[str] = []
    slow = threading.Event()

    def hook(request_id: str, stage: str) -> None:
        if stage == "align":
            order.append(f"align {request_id}")
            slow.wait(2.0)  # a slow alignment holds the engine thread

    engine = build_engine(EngineConfig.for_tests(aligner=str(ALIGNER), warmup=False), hook)
    engine.start()
    try:
        done = threading.Event()

        def deliver_b(chunk) -> None:
            if chunk.pcm.size and "first audio b" not in order:
                order.append("first audio b")
            if chunk.is_final:
                done.set()

        def deliver_a(chunk) -> None:
            if chunk.is_final:
                order.append("final a")
                assert chunk.alignment is not None and chunk.alignment.words
            elif chunk.frames_done == chunk.frames_total and "submitted b" not in order:
                # a's last audio: b arrives now, in the very step that queues a's alignment
                order.append("submitted b")
                engine.submit(SynthesisRequest(id="b", text="Another sentence arrives now."), deliver_b)

        engine.submit(SynthesisRequest(id="a", text="Hello there, my friend.", timestamps=True), deliver_a)
        assert done.wait(120)
        assert order.index("first audio b") < order.index("align a") < order.index("final a"), order
    finally:
        slow.set()
        engine.stop()


async def test_models_names_the_aligner_without_its_path(aligned):
    """/v1/models says which aligner is loaded by name; the operator's directory appears nowhere."""
    async with aiohttp.ClientSession() as http:
        async with http.get(aligned.url + "/v1/models") as response:
            body = await response.text()
    [model] = json.loads(body)["data"]
    assert model["timestamps"]["aligner"] == ALIGNER.name
    assert str(ALIGNER.parent) not in body and str(ALIGNER.parent).replace("/", "\\/") not in body
