"""Every sink receives the whole event stream of speech (service/synthesis/events.py): a dialect's
socket context (service/ws/contexts.py) and an HTTP speech route (service/speech.py) get
``StreamBehind`` and ``UtteranceTruncated`` as ``/v1/stream`` does, and each decides what it
writes (the vendors log them). Two toy dialects, added as routes on a real server, write one JSON
line per event they receive.

The engine is a virtual device (engines/virtual/) whose cost table makes a talker step 300 ms for
80 ms of audio, so every chunk after the first comes after its listener ran dry (``StreamBehind``;
a loaded machine is only slower), and whose rows never sample EOS, so the request's
``max_new_tokens`` ends each utterance (``UtteranceTruncated``, ``max_new_tokens``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import websockets
from aiohttp import web

from engines.build import build_engine
from engines.config import EngineConfig, VirtualDeviceConfig
from service.app import create_app
from service.settings import Settings
from service.speech import SpeechOrder, SpeechRoute, handler
from service.synthesis.params import SynthesisParams
from service.ws.contexts import ContextSocket
from service.ws.dialects.common import dialect_voice
from service.ws.handshake import serve

REPO = Path(__file__).resolve().parents[4]
PROMPT_SIDE = REPO / "benchmarks" / "costs" / "prompt-0.6b"  # the benchmark checkpoint's configs and tokenizer
FRAMES = 5  # max_new_tokens 6: five frames, then the utterance is cut
SLOW = {  # a talker step (300 ms) far slower than the frame of audio it makes (80 ms)
    "schema": 1, "device": "slow test GPU", "torch": "0", "date": "2026-12-01", "commit": "test", "size": "0.6b",
    "dtype": "bfloat16", "command": "by hand",
    "decode_step": {"rows": [1, 4], "kv_blocks": [1, 8], "ms": [[300.0, 300.0], [300.0, 300.0]]},
    "prefill": {"prompts": [1, 4], "width": [8, 64], "ms": [[1.0, 1.0], [1.0, 1.0]]},
    "codec_decode": {"rows": [1, 4], "frames": [1, 25], "ms": [[1.0, 1.0], [1.0, 1.0]]},
    "capture_ms": {"decode_step": 0.0, "codec_decode": 0.0}, "start_s": 0.0, "notes": "slower than real time",
}


@pytest.fixture(scope="module")
def slow_engine(tmp_path_factory):
    table = tmp_path_factory.mktemp("costs") / "slow-0.6b.json"
    table.write_text(json.dumps(SLOW))
    engine = build_engine(EngineConfig().updated(checkpoint=str(PROMPT_SIDE), max_slots=2, warmup=False,
                                                virtual=VirtualDeviceConfig(str(table))))
    engine.start()
    yield engine
    engine.stop()


class EventSocket(ContextSocket):
    """A toy dialect: one context; ``{"text"}`` speaks it; every event it hears is a JSON line."""

    ENDPOINT = "/test/dialect-events"

    async def opened(self) -> None:
        context = self.open_context("only")
        await context.core.configure({"max_new_tokens": FRAMES + 1},
                                     voice=await dialect_voice(self.request, "default"))

    async def on_message(self, message: dict) -> None:
        context = self.contexts["only"]
        await context.add_text(message["text"])
        await context.flush("end")

    async def line(self, event: str, **fields) -> None:
        await self.send_json({"event": event, **fields})

    async def audio(self, context, pcm) -> None:
        await self.line("audio", samples=int(pcm.size))

    async def stream_behind(self, context, event) -> None:
        await self.line("stream_behind", gap_s=event.gap_s)

    async def utterance_truncated(self, context, event) -> None:
        await self.line("utterance_truncated", reason=event.reason)

    async def round_done(self, context, label) -> None:
        await self.line("round_done")

    async def context_error(self, context, code: str, message: str) -> None:
        await self.line("error", code=code)


class EventSpeech(SpeechRoute):
    """A toy HTTP speech route: ``{"text"}`` in, one JSON line per event out."""

    ENDPOINT = "/test/speech-events"

    async def parse(self, body: dict) -> SpeechOrder:
        return SpeechOrder(body["text"], SynthesisParams(max_new_tokens=FRAMES + 1),
                           await dialect_voice(self.request, "default"))

    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/x-ndjson"}

    async def line(self, event: str, **fields) -> None:
        await self.response.write(json.dumps({"event": event, **fields}).encode() + b"\n")

    async def audio(self, event) -> None:
        await self.line("audio", samples=int(event.pcm.size))

    async def stream_behind(self, event) -> None:
        await self.line("stream_behind", gap_s=event.gap_s)

    async def utterance_truncated(self, event) -> None:
        await self.line("utterance_truncated", reason=event.reason)

    async def alignment(self, event) -> None:
        await self.line("alignment")

    async def done(self, event) -> None:
        await self.line("done", samples=event.samples)


async def serve_events(request: web.Request) -> web.StreamResponse:
    return await serve(request, EventSocket)


@pytest.fixture
async def toy_server(slow_engine, tmp_path):
    app = create_app(Settings(host="127.0.0.1", port=0, device="cpu", data_dir=tmp_path), slow_engine)
    app.router.add_get(EventSocket.ENDPOINT, serve_events)
    app.router.add_post(EventSpeech.ENDPOINT, handler(EventSpeech))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    yield f"{host}:{port}"
    await runner.cleanup()


def assert_whole_stream(events: list[dict]) -> None:
    """The audio of the one utterance, the listener's gaps before all but its first chunk, its cut."""
    kinds = [e["event"] for e in events]
    assert sum(e["samples"] for e in events if e["event"] == "audio") == FRAMES * 1920, events
    assert "stream_behind" in kinds and kinds.index("stream_behind") > kinds.index("audio"), kinds
    assert all(e["gap_s"] > 0 for e in events if e["event"] == "stream_behind")
    assert [e["reason"] for e in events if e["event"] == "utterance_truncated"] == ["max_new_tokens"], kinds


async def test_a_dialect_context_receives_every_event(toy_server):
    async with websockets.connect(f"ws://{toy_server}{EventSocket.ENDPOINT}") as ws:
        await ws.send(json.dumps({"text": "Hello there."}))
        events = []
        while not events or events[-1]["event"] not in ("round_done", "error"):
            events.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
    assert events[-1]["event"] == "round_done", events
    assert_whole_stream(events)


async def test_an_http_speech_route_receives_every_event(toy_server):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://{toy_server}{EventSpeech.ENDPOINT}", json={"text": "Hello there."}) as r:
            assert r.status == 200, await r.text()
            events = [json.loads(line) for line in (await r.text()).splitlines()]
    assert events[-1] == {"event": "done", "samples": FRAMES * 1920}, events
    assert_whole_stream(events)
