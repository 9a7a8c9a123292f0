"""POST /v1/audio/speech: when the first and last bytes arrive, streamed (OpenAI's default
now) vs one whole file (``stream: false``, the old default), per format, side by side.

    python benchmarks/bench_speech_delivery.py [--preset small] [--reps 3] [--formats mp3 opus aac wav]

A real server on 127.0.0.1 (the service's app, an in-process engine on this machine's
CPU), a real HTTP client reading the body as it comes. Random weights: timing does not
depend on their values. The floor is the whole-file request's last byte: a streamed
response cannot finish earlier, it can only start earlier (first byte / that floor).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import torch
from aiohttp import web

from engines.build import build_engine
from engines.config import EngineConfig
from service.app import create_app
from service.settings import Settings

TEXT = " ".join(f"This is sentence number {i} of a longer reading for the benchmark." for i in range(8))


async def one(http: aiohttp.ClientSession, url: str, fmt: str, stream: bool) -> tuple[float, float, int]:
    start = time.perf_counter()
    first = None
    size = 0
    body = {"input": TEXT, "response_format": fmt, "stream": False} if not stream else {"input": TEXT, "response_format": fmt}
    async with http.post(url + "/v1/audio/speech", json=body) as response:
        assert response.status == 200, await response.text()
        async for piece in response.content.iter_any():
            if first is None:
                first = time.perf_counter() - start
            size += len(piece)
    return first * 1e3, (time.perf_counter() - start) * 1e3, size


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--formats", nargs="+", default=["mp3", "opus", "aac", "wav"])
    args = parser.parse_args()
    engine = build_engine(EngineConfig().updated(preset=args.preset, device="cpu"))
    engine.start()
    with tempfile.TemporaryDirectory() as data:
        settings = Settings(host="127.0.0.1", port=0, preset=args.preset, device="cpu", data_dir=Path(data))
        runner = web.AppRunner(create_app(settings, engine), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}"
        print(f"device: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
              f"preset {args.preset}, {len(TEXT)} chars, median of {args.reps}")
        print("| format | whole file: first / last byte ms | streamed: first / last byte ms | "
              "streamed first byte / whole-file last byte |")
        print("|---|---|---|---|")
        async with aiohttp.ClientSession() as http:
            await one(http, url, "pcm", True)  # warm-up
            for fmt in args.formats:
                rows = {}
                for stream in (False, True):
                    runs = [await one(http, url, fmt, stream) for _ in range(args.reps)]
                    rows[stream] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
                (wf, wl), (sf_, sl) = rows[False], rows[True]
                print(f"| {fmt} | {wf:,.0f} / {wl:,.0f} | {sf_:,.0f} / {sl:,.0f} | {sf_ / wl:.3f} |")
        await runner.cleanup()
    engine.stop()


if __name__ == "__main__":
    asyncio.run(main())
