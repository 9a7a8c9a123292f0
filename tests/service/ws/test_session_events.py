"""The session core speaks to a protocol in typed events (service/ws/events.py), and a protocol is
only a sink that calls the core's methods: a toy protocol, added in this test as a new route on a
real server, writes one JSON line per event (its client sends ``{"text"}``, ``{"end": true}``,
``{"cancel": true}``). What it hears is the core's contract: the events of each utterance in
order, its audio counted in ``UtteranceDone``, each round answered once, refusals as
``SessionError`` with the socket still working - and the same samples ``/v1/stream`` sends."""

from __future__ import annotations

import asyncio
import json

import websockets
from aiohttp import web
from ws_helpers import read_until_json

from service.app import create_app
from service.settings import Settings
from service.ws.core import SessionCore
from service.ws.events import SessionSink
from service.ws.handshake import SocketOwner, serve

TEXT = "Hello there. This is the second sentence."


class EventLines(SocketOwner, SessionSink):
    ENDPOINT = "/test/events"

    def __init__(self, request, ws, state):
        super().__init__(request, ws, state)
        self.core = SessionCore(request, state, self, self.socket_id, text_streaming=False)
        self.speaker: asyncio.Task | None = None

    closed = property(lambda self: self.core.closed)
    busy = property(lambda self: self.core.busy)

    async def run(self) -> None:
        self.speaker = asyncio.create_task(self.core.speak_loop())
        await self.core.configure({"voice": "default"})
        await self.read_loop()

    async def shut(self) -> None:
        self.core.stop()
        if self.speaker is not None:
            self.speaker.cancel()
            await asyncio.gather(self.speaker, return_exceptions=True)

    def read_timeout(self, first: bool) -> tuple[float, str]:
        return 60.0, "idle_timeout"

    async def on_message(self, message: dict) -> None:
        if "text" in message:
            await self.core.add_text(message["text"])
        if message.get("end"):
            await self.core.end_round()
        if message.get("cancel"):
            await self.core.cancel()

    async def fatal(self, code: str, message: str, close_code: int) -> None:
        await self.core.fail(code, message, close_code)

    async def write(self, event: object, **fields) -> None:
        await self.ws.send_json({"event": type(event).__name__, **fields})

    async def error(self, code: str, message: str) -> None:
        await self.ws.send_json({"event": "error", "code": code})

    async def utterance_started(self, event) -> None:
        await self.write(event, index=event.index, text=event.text)

    async def audio(self, event) -> None:
        await self.write(event, index=event.index, samples=int(event.pcm.size))
        await self.ws.send_bytes(event.pcm.tobytes())

    async def stream_behind(self, event) -> None:  # (a slow machine)
        await self.write(event, index=event.index)

    async def utterance_truncated(self, event) -> None:
        await self.write(event, index=event.index, reason=event.reason)

    async def alignment(self, event) -> None:
        await self.write(event, index=event.index)

    async def utterance_done(self, event) -> None:
        await self.write(event, index=event.index, samples=event.samples, cancelled=event.cancelled,
                         error=event.error)

    async def round_done(self, event) -> None:
        await self.write(event, utterances=event.utterances)

    async def session_error(self, event) -> None:
        await self.write(event, code=event.code)

    async def session_failed(self, event) -> None:
        await self.write(event, code=event.code)
        await self.ws.close(code=event.close_code)


async def serve_events(request: web.Request) -> web.StreamResponse:
    return await serve(request, EventLines)


async def read_round(ws) -> tuple[list[dict], int]:
    """Every event up to RoundDone, and the samples of the audio frames."""
    events, samples = [], 0
    while True:
        message = await asyncio.wait_for(ws.recv(), 60)
        if isinstance(message, bytes):
            samples += len(message) // 4  # float32
            continue
        events.append(json.loads(message))
        if events[-1]["event"] == "RoundDone":
            return events, samples


async def test_a_new_protocol_is_a_sink_of_typed_events(engine, tmp_path):
    app = create_app(Settings(host="127.0.0.1", port=0, preset="tiny", device="cpu", data_dir=tmp_path,
                              max_input_chars=200), engine)
    app.router.add_get(EventLines.ENDPOINT, serve_events)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        async with websockets.connect(f"ws://{host}:{port}{EventLines.ENDPOINT}") as ws:
            await ws.send(json.dumps({"text": TEXT[:9]}))
            await ws.send(json.dumps({"text": TEXT[9:], "end": True}))
            events, samples = await read_round(ws)
            assert [e["event"] for e in events][-1] == "RoundDone"
            spoken, index, audio = [], None, 0  # each utterance: started, its audio, done - never interleaved
            for event in events[:-1]:
                if event["event"] == "UtteranceStarted":
                    assert index is None, events
                    index, audio = event["index"], 0
                    spoken.append(event["text"])
                elif event["event"] == "Audio":
                    assert event["index"] == index, events
                    audio += event["samples"]
                elif event["event"] == "StreamBehind":  # (a slow machine)
                    assert event["index"] == index, events
                else:
                    assert event == {"event": "UtteranceDone", "index": index, "samples": audio, "cancelled": False,
                                     "error": None} and audio > 0, events
                    index = None
            assert index is None and spoken == ["Hello there.", "This is the second sentence."]
            assert samples == sum(e["samples"] for e in events if e["event"] == "UtteranceDone")
            assert events[-1]["utterances"] == 2

            # a refusal is an event; the socket keeps working
            await ws.send(json.dumps({"text": "x" * 201}))
            refused = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert refused == {"event": "SessionError", "code": "text_too_long"}
            await ws.send(json.dumps({"cancel": True}))  # nothing speaks: answered at once
            assert (await read_round(ws))[0] == [{"event": "RoundDone", "utterances": 0}]

        # the same text over /v1/stream: the same samples
        async with websockets.connect(f"ws://{host}:{port}/v1/stream", subprotocols=["streamvox"]) as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "default", "text_streaming": False}))
            await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            await ws.send(json.dumps({"type": "input.done"}))
            stream_samples, message = 0, {}
            while message.get("type") != "session.done":
                audio, message = await read_until_json(ws)
                stream_samples += len(audio) // 2  # PCM16
        assert stream_samples == samples
    finally:
        await runner.cleanup()
