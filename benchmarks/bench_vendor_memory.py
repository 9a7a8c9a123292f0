"""Peak server memory of the largest answer the work limits allow on ElevenLabs' HTTP routes.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_vendor_memory.py [--seconds 2550] [--format pcm_48000]

Starts ``streamvox serve`` (tiny preset, CPU, default limits) as a subprocess and sends each
ElevenLabs route one request of ``--seconds`` of audio - ``Hello there.`` then ``<break time=10s>``
tags, the cheapest audio to make: 255 of them fill ``--max-input-chars`` (4,096), 2,550 s, under
the default ``--max-work-audio-frames`` (49,152 frames, ~3,930 s), which pauses count against -
in the largest format it serves (``pcm_48000``, 96 kB/s). For each:
the server's RSS before, its peak while answering (VmHWM after resetting it with
``/proc/PID/clear_refs``) and the answer's size. The client reads the answer in 1 MiB pieces and
keeps none of it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Server  # noqa: E402

ROUTES = ["/with-timestamps", "/stream/with-timestamps", "/stream", ""]


def memory_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


async def measure(url: str, pid: int, route: str, text: str, fmt: str) -> tuple[int, float, float, int, float]:
    """(status, RSS before MB, peak MB, answer bytes, seconds) of one request."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        await asyncio.sleep(1.0)  # whatever the previous request freed is handed back
        before = memory_mb(pid, "VmRSS")
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        start = time.monotonic()
        size = 0
        async with http.post(f"{url}/v1/text-to-speech/default{route}?output_format={fmt}", json={"text": text}) as r:
            async for chunk in r.content.iter_chunked(1 << 20):
                size += len(chunk)
        return r.status, before, memory_mb(pid, "VmHWM"), size, time.monotonic() - start


async def run(args) -> None:
    with tempfile.TemporaryDirectory() as data_dir:
        server = Server.start("tiny", "cpu", data_dir)
        try:
            pid = server.proc.pid
            text = "Hello there. " + "<break time=10s>" * round(args.seconds / 10)
            for route in ROUTES:  # warm: first requests build what every later one reuses
                await measure(server.url, pid, route, "Warm up.", args.format)
            rows = [(route or "(convert)", *await measure(server.url, pid, route, text, args.format))
                    for route in ROUTES]
        finally:
            server.proc.terminate()
            server.proc.wait(30)
    print(f"device: CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), tiny preset, "
          f"load average {os.getloadavg()[0]:.2f}; {len(text):,} characters -> ~{args.seconds:.0f} s of audio as "
          f"{args.format}")
    print(f"{'route /v1/text-to-speech/default…':<36} {'status':>6} {'RSS before MB':>14} {'peak MB':>8} "
          f"{'peak - before':>14} {'answer MiB':>11} {'seconds':>8}")
    for route, status, before, peak, size, seconds in rows:
        print(f"{route:<36} {status:>6} {before:>14.0f} {peak:>8.0f} {peak - before:>14.0f} {size / 2**20:>11.0f} "
              f"{seconds:>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=2550.0, help="audio per request (10 s break tags)")
    parser.add_argument("--format", default="pcm_48000", help="ElevenLabs output_format")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
