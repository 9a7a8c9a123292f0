"""How the event loop fares while a long pause is encoded: three ways of sending the silence of
``<break>`` tags through a response encoder, measured in one process, beside a task that wakes
every millisecond and records how late it woke (the loop's stall).

* inline, no yield  - what the server did before: every 1 s piece generated and encoded in one
                      run of the loop (a reader whose socket never pushes back)
* inline, yield     - a turn of the loop before each 1 s piece, the encoder on the loop
* thread, yield     - a turn of the loop before each piece, the encoder on a thread
                      (StreamEncoder.encode_async: FFmpeg and soxr release the GIL); what is served

    .venv/bin/python benchmarks/bench_pause_encoding.py --seconds 300

Prints, per format and way: the longest stall of the loop, its 99th percentile, and the wall time
for all of the audio (the price of the thread hops).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines.contract import SAMPLE_RATE  # noqa: E402
from service.synthesis.audio import StreamEncoder  # noqa: E402

FORMATS = [("mp3", 44100, 128_000), ("mp3", 24000, None), ("opus", 48000, None), ("aac", 24000, None),
           ("pcm_s16le", 44100, None)]


async def encode(fmt: str, rate: int, bit_rate: int | None, seconds: int, way: str) -> tuple[float, float, float]:
    """(longest stall s, p99 stall s, wall s) for ``seconds`` of silence encoded ``way``."""
    encoder = StreamEncoder(fmt, rate, bit_rate)
    piece = np.zeros(SAMPLE_RATE, np.float32)
    lates: list[float] = []
    done = False

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not done:
            due = loop.time() + 0.001
            await asyncio.sleep(0.001)
            lates.append(loop.time() - due)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    for _ in range(seconds):
        if way == "inline, no yield":
            encoder.encode(piece)
        elif way == "inline, yield":
            await asyncio.sleep(0)
            encoder.encode(piece)
        else:
            await asyncio.sleep(0)
            await encoder.encode_async(piece)
    await encoder.finish_async()
    wall = time.perf_counter() - start
    done = True
    await task
    # "inline, no yield" never lets the ticker run: its one stall is the whole encode
    longest = max(lates + [wall if way == "inline, no yield" else 0.0])
    return longest, float(np.percentile(lates, 99)) if lates else wall, wall


async def main(seconds: int) -> None:
    ways = ["inline, no yield", "inline, yield", "thread, yield"]
    print(f"{seconds} s of silence in 1 s pieces; {os.cpu_count()} CPUs; load {open('/proc/loadavg').read().split()[:3]}")
    print(f"{'format':<22} {'way':<18} {'longest stall ms':>16} {'p99 stall ms':>12} {'wall s':>7}")
    for fmt, rate, bit_rate in FORMATS:
        name = f"{fmt} {rate}" + (f" {bit_rate // 1000}k" if bit_rate else "")
        for way in ways:
            longest, p99, wall = await encode(fmt, rate, bit_rate, seconds, way)
            print(f"{name:<22} {way:<18} {longest * 1000:>16.1f} {p99 * 1000:>12.1f} {wall:>7.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=300, help="seconds of silence per format and way")
    asyncio.run(main(parser.parse_args().seconds))
