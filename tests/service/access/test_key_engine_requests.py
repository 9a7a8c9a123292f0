"""``--max-sessions-per-key`` counts work, not sockets: one key's Cartesia socket with 16
contexts holds no more engine requests than one /v1/stream session may (two: one speaking, one
prefetched), so another key's first audio beside it stays within 1.5x of what it is beside one
ordinary session of that key; every context still speaks, in turn. Real server on the tiny
engine, real clients."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import websockets
from conftest import start_server
from dialect_helpers import CARTESIA_PATH, cartesia_request, next_message, ws_base

CONTEXTS = 16
ROUNDS = 5
JITTER_S = 0.03  # a loaded 2-core machine's scheduling noise on a median of a few tens of ms
ANSWER = " ".join(f"This is sentence number {i} of an answer that one context keeps speaking." for i in range(2))


async def first_audio_s(url: str, key: str) -> float:
    """Seconds from ``input.done`` to the first audio of one sentence on /v1/stream."""
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {key}"}, max_size=None) as ws:
        assert (await next_message(ws))["type"] == "session.created"
        await ws.send(json.dumps({"type": "input.text", "text": "Hello there, how are you?"}))
        start = time.perf_counter()
        await ws.send(json.dumps({"type": "input.done"}))
        while isinstance(message := await asyncio.wait_for(ws.recv(), 30), str):
            assert json.loads(message)["type"] != "error", message
        first = time.perf_counter() - start
        while not (isinstance(message := await asyncio.wait_for(ws.recv(), 30), str)
                   and json.loads(message)["type"] == "session.done"):
            pass
        return first


async def beside(url: str, load) -> tuple[float, bool]:
    """Key B's median first audio while ``load`` (key A's client, started) runs; whether A was
    still speaking at the end."""
    task = asyncio.create_task(load.run())
    await asyncio.wait_for(load.audible.wait(), 30)
    first = statistics.median([await first_audio_s(url, "key-b") for _ in range(ROUNDS)])
    busy = not task.done()
    await asyncio.wait_for(task, 300)
    return first, busy


class OneSession:
    """Key A's fair share: one /v1/stream session speaking a long answer."""

    def __init__(self, url: str):
        self.url, self.audible = url, asyncio.Event()

    async def run(self) -> None:
        async with websockets.connect(self.url, additional_headers={"Authorization": "Bearer key-a"},
                                      max_size=None) as ws:
            await next_message(ws)
            await ws.send(json.dumps({"type": "input.text", "text": ANSWER * 3}))
            await ws.send(json.dumps({"type": "input.done"}))
            while not isinstance(message := await asyncio.wait_for(ws.recv(), 60), str) \
                    or json.loads(message)["type"] != "session.done":
                self.audible.set()


class SixteenContexts:
    """Key A's crowd: 16 Cartesia contexts on one socket, all speaking at once."""

    def __init__(self, server, engine):
        self.server, self.engine, self.audible = server, engine, asyncio.Event()
        self.held: list[int] = []  # engine requests in flight, sampled at each message
        self.done: set[str] = set()

    async def run(self) -> None:
        async with websockets.connect(ws_base(self.server) + CARTESIA_PATH, additional_headers={"X-API-Key": "key-a"},
                                      max_size=None) as ws:
            for i in range(CONTEXTS):
                await ws.send(cartesia_request(f"ctx-{i}", ANSWER, False))
            while len(self.done) < CONTEXTS:
                message = await next_message(ws, 60)
                assert message["type"] != "error", message
                self.held.append(self.engine.stats().active_requests)
                self.audible.set()
                if message["type"] == "done":
                    self.done.add(message["context_id"])


async def test_one_keys_contexts_hold_one_sessions_share(engine, tmp_path):
    server = await start_server(engine, tmp_path / "data", api_keys=("key-a", "key-b"), max_sessions_per_key=1)
    try:
        await first_audio_s(server.ws_url, "key-b")  # warm
        idle = statistics.median([await first_audio_s(server.ws_url, "key-b") for _ in range(ROUNDS)])
        fair, fair_busy = await beside(server.ws_url, OneSession(server.ws_url))
        crowd = SixteenContexts(server, engine)
        crowded, crowd_busy = await beside(server.ws_url, crowd)
    finally:
        await server.stop()
    print(f"key B's first audio: idle {idle:.3f} s, beside one session of key A {fair:.3f} s, "
          f"beside its 16 contexts {crowded:.3f} s; engine requests at most {max(crowd.held)}")
    assert fair_busy and crowd_busy, "key A finished before key B's rounds: give it more text"
    assert crowd.done == {f"ctx-{i}" for i in range(CONTEXTS)}  # every context spoke, in turn
    assert max(crowd.held) <= 2 + 2, crowd.held  # key A's two, key B's (speaking, prefetched) at most
    assert crowded <= 1.5 * fair + JITTER_S, (crowded, fair, idle)
