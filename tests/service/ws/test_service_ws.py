"""WebSocket /v1/stream: the normative transcript, concurrency, cancel, drops, slow readers."""

from __future__ import annotations

import asyncio
import json
import socket

import numpy as np
import pytest
import websockets
from conftest import metric_value, start_server, wait_until

from clients.client import StreamvoxClient

LONG = " ".join(f"Sentence number {i} keeps this stream busy for a while." for i in range(50))


async def connect(server, **kwargs):
    ws = await websockets.connect(server.ws_url, max_size=None, **kwargs)
    created = json.loads(await ws.recv())
    return ws, created


async def read_round(ws) -> tuple[list[dict], list[tuple[int, int]]]:
    """Messages until session.done; binary frames recorded as (utterance, bytes)."""
    events: list[dict] = []
    frames: list[tuple[int, int]] = []
    current = None
    while True:
        message = await ws.recv()
        if isinstance(message, bytes):
            assert current is not None, "binary frame outside audio.start/audio.done"
            frames.append((current, len(message)))
            continue
        event = json.loads(message)
        if event["type"] == "stream.behind":  # informational (a slow machine): inside its utterance, not counted
            assert current is not None and event["utterance"] == current, event
            continue
        events.append(event)
        if event["type"] == "audio.start":
            assert current is None, "utterances interleave"
            current = event["utterance"]
        elif event["type"] == "audio.done":
            assert event["utterance"] == current
            current = None
        elif event["type"] == "session.done":
            return events, frames


def bytes_of(frames, utterance: int) -> int:
    return sum(size for u, size in frames if u == utterance)


async def test_transcript_exactly(server):
    ws, created = await connect(server)
    assert created["type"] == "session.created"
    assert {k: created[k] for k in ("protocol", "sample_rate", "format", "channels")} == {
        "protocol": 1, "sample_rate": 24000, "format": "pcm_s16le", "channels": 1}
    assert isinstance(created["session_id"], str) and created["session_id"]
    await ws.send(json.dumps({"type": "session.config", "voice": "default", "seed": 7, "steps": 8,
                              "guidance_scale": 2.0, "speed": 1.0}))
    await ws.send(json.dumps({"type": "input.text", "text": "Hello there. How are"}))
    first = json.loads(await ws.recv())
    assert first == {"type": "audio.start", "utterance": 0, "text": "Hello there."}
    await ws.send(json.dumps({"type": "input.text", "text": " you today?"}))
    await ws.send(json.dumps({"type": "input.done"}))
    # Reading resumes inside utterance 0: feed read_round a synthetic start.
    events, frames = await read_round(_Prefixed(ws, json.dumps(first)))
    kinds = [(e["type"], e.get("utterance")) for e in events]
    assert kinds == [("audio.start", 0), ("audio.done", 0), ("audio.start", 1), ("audio.done", 1),
                     ("session.done", None)]
    assert events[2]["text"] == "How are you today?"
    assert events[-1]["utterances"] == 2
    for done in (events[1], events[3]):
        assert done["samples"] > 0
        assert bytes_of(frames, done["utterance"]) == 2 * done["samples"]
        assert done["duration_s"] == pytest.approx(done["samples"] / 24000, abs=1e-3)
    # The socket stays open: another round works and numbering continues.
    await ws.send(json.dumps({"type": "input.text", "text": "One more."}))
    await ws.send(json.dumps({"type": "input.done"}))
    events, frames = await read_round(ws)
    assert [e["type"] for e in events] == ["audio.start", "audio.done", "session.done"]
    assert events[-1]["utterances"] == 1
    await ws.close()


class _Prefixed:
    """A socket whose first recv() returns a message that was already read."""

    def __init__(self, ws, first):
        self._ws, self._first = ws, first

    async def recv(self):
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._ws.recv()


async def test_three_sentences_in_one_message_give_three_utterances(server):
    ws, _ = await connect(server)
    await ws.send(json.dumps({"type": "input.text", "text": "Dr. Smith arrived at 3.5 pm. It rained... Then it stopped!"}))
    await ws.send(json.dumps({"type": "input.done"}))
    events, frames = await read_round(ws)
    starts = [e["text"] for e in events if e["type"] == "audio.start"]
    assert starts == ["Dr. Smith arrived at 3.5 pm.", "It rained...", "Then it stopped!"]
    assert events[-1] == {"type": "session.done", "utterances": 3}
    dones = [e for e in events if e["type"] == "audio.done"]
    assert [d["utterance"] for d in dones] == [0, 1, 2]
    assert all(bytes_of(frames, d["utterance"]) == 2 * d["samples"] > 0 for d in dones)
    await ws.close()


async def test_sentence_split_over_messages_is_one_utterance(server):
    ws, _ = await connect(server)
    for piece in ("The quick brown", " fox jumps over", " the lazy dog."):
        await ws.send(json.dumps({"type": "input.text", "text": piece}))
    await ws.send(json.dumps({"type": "input.done"}))
    events, frames = await read_round(ws)
    assert [e["text"] for e in events if e["type"] == "audio.start"] == ["The quick brown fox jumps over the lazy dog."]
    assert events[-1] == {"type": "session.done", "utterances": 1}
    await ws.close()


async def test_cancel_fades_out_and_drops_queued_utterances(server):
    ws, _ = await connect(server)
    await ws.send(json.dumps({"type": "input.text", "text": LONG}))
    first = json.loads(await ws.recv())
    assert first["type"] == "audio.start"
    first_audio = await ws.recv()
    assert isinstance(first_audio, bytes)  # audio is flowing
    await ws.send(json.dumps({"type": "response.cancel"}))
    events, frames = await read_round(_Prefixed(ws, json.dumps(first)))
    kinds = [e["type"] for e in events]
    assert kinds == ["audio.start", "audio.done", "session.done"]  # the queued sentences were dropped
    done = events[1]
    assert done["cancelled"] is True
    assert len(first_audio) + bytes_of(frames, 0) == 2 * done["samples"]  # includes the fade-out ramp
    assert events[-1]["utterances"] == 1
    await ws.close()


async def test_client_library_round_and_realtime_factor(server):
    async with StreamvoxClient(server.url) as client:
        result = await client.say("Good morning. The weather is fine.", voice="nova", seed=1)
    assert [u.text for u in result.utterances] == ["Good morning.", "The weather is fine."]
    assert all(len(u.pcm) == 2 * u.samples for u in result.utterances)
    pcm = result.pcm.astype(np.float32) / 32768
    assert np.abs(pcm).max() > 1e-3
    assert result.time_to_first_audio_s is not None and result.real_time_factor > 0


async def test_eight_concurrent_sessions_share_ticks(server):
    texts = [f"Session {i} says hello. It then says goodbye to everyone here." for i in range(8)]
    sockets = [(await connect(server))[0] for _ in texts]
    # Send everything first so the sessions overlap in the engine.
    for ws, text in zip(sockets, texts):
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
    results = await asyncio.gather(*(read_round(ws) for ws in sockets))
    for events, frames in results:
        dones = [e for e in events if e["type"] == "audio.done"]
        assert len(dones) == 2 and all(bytes_of(frames, d["utterance"]) == 2 * d["samples"] > 0 for d in dones)
    for ws in sockets:
        await ws.close()
    total = await metric_value(server.url, "streamvox_tick_batch_rows_count")
    at_most_7 = await metric_value(server.url, "streamvox_tick_batch_rows_bucket", '{le="7.0"}')
    assert total - at_most_7 >= 1, "no tick ever batched 8 or more rows"


async def test_dropped_client_frees_its_slot(server):
    engine = server.state.engine
    ws, _ = await connect(server)
    await ws.send(json.dumps({"type": "input.text", "text": LONG}))
    assert json.loads(await ws.recv())["type"] == "audio.start"
    assert isinstance(await ws.recv(), bytes)
    assert engine.stats().active_requests >= 1
    ws.transport.abort()  # no close handshake: the client just vanishes

    async def slots_free():
        return (engine.stats().active_requests == 0
                and await metric_value(server.url, "streamvox_active_slots") == 0)

    await wait_until(slots_free)


def tiny_receive_buffer_socket(url: str) -> socket.socket:
    """A connected TCP socket with a small receive buffer, so an unread stream backs up."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    return sock


async def test_slow_reader_is_paused_and_does_not_delay_others(engine, tmp_path):
    server = await start_server(engine, tmp_path / "data", ws_buffer_chunks=2)
    try:
        slow = await websockets.connect(server.ws_url, sock=tiny_receive_buffer_socket(server.ws_url),
                                        max_size=None, max_queue=1)
        await slow.send(json.dumps({"type": "input.text", "text": LONG}))
        # The slow client reads nothing more. Its generation must be paused by back-pressure.

        async def slow_session_paused():
            return await metric_value(server.url, "streamvox_paused_streams") >= 1

        await wait_until(slow_session_paused)
        async with StreamvoxClient(server.url) as client:
            result = await client.say("Meanwhile, another client is served.")
        assert result.time_to_first_audio_s is not None
        assert len(result.utterances) == 1 and result.utterances[0].samples > 0
        assert await metric_value(server.url, "streamvox_paused_streams") >= 1  # still backed up, still bounded
        # Every engine request of the slow session buffered at most high water + the one chunk in flight.
        streams = [stream for session in server.state.streams
                   for stream in (session.core.current, session.core.prefetched and session.core.prefetched[1]) if stream]
        assert streams and all(stream.max_buffered <= 3 for stream in streams)
        slow.transport.abort()

        async def released():
            return (engine.stats().active_requests == 0
                    and await metric_value(server.url, "streamvox_paused_streams") == 0)

        await wait_until(released)
    finally:
        await server.stop()


async def test_session_config_applies_to_later_utterances(server):
    ws, _ = await connect(server)
    sentence = "The same sentence twice, at two speeds."
    lengths = []
    for speed in (1.0, 2.0):
        await ws.send(json.dumps({"type": "session.config", "speed": speed, "seed": 3}))
        await ws.send(json.dumps({"type": "input.text", "text": sentence}))
        await ws.send(json.dumps({"type": "input.done"}))
        events, _ = await read_round(ws)
        lengths.append(next(e["samples"] for e in events if e["type"] == "audio.done"))
    assert lengths[1] < lengths[0]  # twice the speed: clearly shorter audio
    await ws.send(json.dumps({"type": "response.cancel"}))  # nothing playing: just closes the (empty) round
    assert json.loads(await ws.recv()) == {"type": "session.done", "utterances": 0}
    await ws.close()
