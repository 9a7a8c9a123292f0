"""Time to first audio over the voice-agent dialects vs streamvox's own ``/v1/stream``.

N concurrent sessions per protocol against one real server (``streamvox serve`` subprocess).
Each session connects first (not timed), then sends the text in pieces as an LLM would and
ends it (flush / EOS / continue false / input.done); TTFA is first audio byte - first text
piece sent. Rows: protocol x sessions; median and p90 TTFA, and the ratio of the median to
``/v1/stream``'s at the same concurrency. The device and preset are printed with the table.

    .venv/bin/python benchmarks/bench_dialects.py --preset tiny --device cpu --sessions 1,16
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import websockets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Server, percentile  # noqa: E402

PIECES = ["Hello there, ", "this is a short test ", "of the first audio. ", "And a second sentence follows it."]
FMT = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}


async def streamvox(ws_base: str) -> float:
    async with websockets.connect(f"{ws_base}/v1/stream") as ws:
        await ws.recv()  # session.created
        t0 = time.perf_counter()
        for piece in PIECES:
            await ws.send(json.dumps({"type": "input.text", "text": piece}))
        await ws.send(json.dumps({"type": "input.done"}))
        first = None
        while True:
            message = await ws.recv()
            if isinstance(message, bytes) and first is None:
                first = time.perf_counter() - t0
            elif isinstance(message, str) and json.loads(message)["type"] == "session.done":
                return first


async def elevenlabs(ws_base: str) -> float:
    url = f"{ws_base}/v1/text-to-speech/default/multi-stream-input?output_format=pcm_24000"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"text": " ", "context_id": "a", "voice_settings": {}}))
        t0 = time.perf_counter()
        for piece in PIECES:
            await ws.send(json.dumps({"text": piece, "context_id": "a"}))
        await ws.send(json.dumps({"context_id": "a", "flush": True}))
        await ws.send(json.dumps({"context_id": "a", "close_context": True}))
        first = None
        while True:
            message = json.loads(await ws.recv())
            if message.get("audio") and first is None:
                first = time.perf_counter() - t0
            if message.get("isFinal"):
                return first


async def cartesia(ws_base: str) -> float:
    async with websockets.connect(f"{ws_base}/tts/websocket?cartesia_version=2025-04-16") as ws:
        t0 = time.perf_counter()
        for i, piece in enumerate(PIECES):
            await ws.send(json.dumps({"transcript": piece, "context_id": "a", "continue": i < len(PIECES) - 1,
                                      "voice": {"mode": "id", "id": "default"}, "output_format": FMT}))
        first = None
        while True:
            message = json.loads(await ws.recv())
            if message["type"] == "chunk" and first is None:
                first = time.perf_counter() - t0
            if message["type"] == "done":
                return first


async def deepgram(ws_base: str) -> float:
    async with websockets.connect(f"{ws_base}/v1/speak?model=default&encoding=linear16&sample_rate=24000") as ws:
        await ws.recv()  # Metadata
        t0 = time.perf_counter()
        for piece in PIECES:
            await ws.send(json.dumps({"type": "Speak", "text": piece}))
        await ws.send(json.dumps({"type": "Flush"}))
        first = None
        while True:
            message = await ws.recv()
            if isinstance(message, bytes) and first is None:
                first = time.perf_counter() - t0
            elif isinstance(message, str) and json.loads(message)["type"] == "Flushed":
                return first


PROTOCOLS = {"/v1/stream": streamvox, "elevenlabs multi-stream-input": elevenlabs, "cartesia /tts/websocket": cartesia,
             "deepgram /v1/speak": deepgram}


async def measure(ws_base: str, sessions: int, rounds: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {name: [] for name in PROTOCOLS}
    for _ in range(rounds):  # protocols interleaved round by round: drift hits all alike
        for name, run in PROTOCOLS.items():
            results[name] += await asyncio.gather(*(run(ws_base) for _ in range(sessions)))
    return results


async def device_of(url: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/v1/models") as response:
            model = (await response.json())["data"][0]
    return f"{model['device']} ({model['preset']}, {model['source']}, {model['dtype']})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sessions", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        server = Server.start(args.preset, args.device, data_dir)
        try:
            asyncio.run(server.wait_ready())
            ws_base = server.url.replace("http://", "ws://")
            device = asyncio.run(device_of(server.url))
            asyncio.run(measure(ws_base, 1, 1))  # warm-up
            print(f"device: {device}; pieces: {len(PIECES)}; rounds: {args.rounds}")
            print(f"{'protocol':32} {'sessions':>8} {'TTFA p50 ms':>12} {'p90 ms':>8} {'vs /v1/stream':>14}")
            for sessions in (int(s) for s in args.sessions.split(",")):
                results = asyncio.run(measure(ws_base, sessions, args.rounds))
                base = percentile(results["/v1/stream"], 0.5)
                for name, values in results.items():
                    p50, p90 = percentile(values, 0.5), percentile(values, 0.9)
                    print(f"{name:32} {sessions:>8} {p50 * 1000:>12.0f} {p90 * 1000:>8.0f} {p50 / base:>14.2f}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
