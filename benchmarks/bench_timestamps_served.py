"""Word timestamps inside the served engine: time to first audio over /v1/stream with vs
without an aligner, and the aligner's engine-thread cost per audio second.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/bench_timestamps_served.py \
        --aligner tests/fixtures/aligner/tiny --sessions 1,8 --rounds 3

Two engines in this process (tiny DiT preset, CPU, one with ``--aligner``), each behind a real
server on loopback; N concurrent sessions per round send the same two sentences in pieces
with ``timestamps: true``. TTFA = first audio byte - first text piece sent. The aligner's
cost is the worker's ``align`` stage (engines/core/worker.py) over the audio it aligned.
Rounds alternate between the two servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import websockets
from aiohttp import web

PIECES = ["Hello there, ", "my friend. How are ", "you today?"]


async def serve(engine, data_dir: Path) -> tuple[web.AppRunner, str]:
    from service.app import create_app
    from service.settings import Settings

    app = create_app(Settings(host="127.0.0.1", port=0, preset="tiny", device="cpu", data_dir=data_dir), engine)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"ws://{host}:{port}/v1/stream"


async def session(url: str) -> tuple[float, float]:
    """(TTFA s, audio ms aligned) of one session."""
    async with websockets.connect(url, max_size=None) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "session.config", "timestamps": True}))
        start = time.perf_counter()
        for piece in PIECES:
            await ws.send(json.dumps({"type": "input.text", "text": piece}))
        await ws.send(json.dumps({"type": "input.done"}))
        ttfa, aligned = None, 0.0
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                if ttfa is None:
                    ttfa = time.perf_counter() - start
                continue
            event = json.loads(message)
            if event["type"] == "alignment":
                aligned += event["duration_ms"]
            if event["type"] == "session.done":
                return ttfa, aligned


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--aligner", default="tests/fixtures/aligner/tiny")
    ap.add_argument("--sessions", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from engines.build import build_engine
    from engines.config import EngineConfig

    engines = {"no aligner": build_engine(EngineConfig.for_tests()),
               "aligner": build_engine(EngineConfig.for_tests(aligner=args.aligner))}
    for engine in engines.values():
        engine.start()
    print(f"device cpu, tiny DiT, torch threads {torch.get_num_threads()}, aligner {args.aligner}")
    with tempfile.TemporaryDirectory() as tmp:
        servers = {name: await serve(engine, Path(tmp) / name.replace(" ", "-")) for name, engine in engines.items()}
        print(f"{'server':12s} {'sessions':>8s} {'TTFA p50 ms':>12s} {'p90 ms':>8s} {'alignments s':>13s}")
        for n in [int(x) for x in args.sessions.split(",")]:
            ttfas = {name: [] for name in servers}
            aligned_ms = {name: 0.0 for name in servers}
            for _ in range(args.rounds):
                for name, (_, url) in servers.items():
                    results = await asyncio.gather(*(session(url) for _ in range(n)))
                    ttfas[name] += [t for t, _ in results]
                    aligned_ms[name] += sum(a for _, a in results)
            for name in servers:
                values = sorted(ttfas[name])
                p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
                print(f"{name:12s} {n:8d} {statistics.median(values) * 1000:12.0f} {p90 * 1000:8.0f} "
                      f"{aligned_ms[name] / 1000:13.1f}")
        align_s = engines["aligner"].stage_seconds().get("align", 0.0)
        for runner, _ in servers.values():
            await runner.cleanup()
    audio_s = engines["aligner"].worker.aligning.audio_seconds
    print(f"aligner on the engine thread: {align_s:.2f} s for {audio_s:.1f} s of audio aligned = "
          f"{align_s * 1000 / max(audio_s, 1e-9):.0f} ms per audio second")
    for engine in engines.values():
        engine.stop()


if __name__ == "__main__":
    asyncio.run(main())
