"""End-to-end: the real server under 1..N concurrent WebSocket clients on loopback.

For each concurrency level: time to first audio p50/p95, per-stream wall/audio ratio
(RTF, < 1 keeps up), sessions with underruns (audio later than playback needs by
> 100 ms) and errors; then the largest level with no underrun. Shares its load
generator with load.py.

    .venv/bin/python benchmarks/bench_e2e.py --preset small --device cpu --levels 1,2,4,8
    python3 benchmarks/bench_e2e.py --device cuda --checkpoint DIR ...   # the talker path
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import TEXTS, Server, log_tail, percentile, run_ws_session  # noqa: E402


async def level(url: str, clients: int, api_key: str | None, min_sessions: int = 1) -> dict:
    """``clients`` concurrent sessions, repeated until at least ``min_sessions`` were measured
    (so a 1-client TTFA is a percentile, not one sample)."""
    t0 = time.monotonic()
    stats = []
    while len(stats) < max(clients, min_sessions):
        stats += await asyncio.gather(*(run_ws_session(url, TEXTS[i % len(TEXTS)], seed=i, api_key=api_key)
                                        for i in range(clients)))
    ok = [s for s in stats if s.ok and not s.error]
    ttfa = [s.ttfa_s for s in ok if s.ttfa_s is not None]
    rtf = [s.rtf for s in ok if s.rtf is not None]
    audio = sum(s.audio_s for s in ok)
    for reason in sorted({s.error or "no audio" for s in stats if s not in ok})[:3]:
        print(f"  ({clients} clients) failed session: {reason[:300]}")
    return {"clients": clients, "sessions": len(stats), "errors": len(stats) - len(ok),
            "ttfa_p50": percentile(ttfa, 0.5), "ttfa_p95": percentile(ttfa, 0.95),
            "rtf_p50": percentile(rtf, 0.5), "rtf_max": max(rtf) if rtf else None,
            "underrun_sessions": sum(1 for s in ok if s.underruns), "audio_s_per_s": audio / (time.monotonic() - t0)}


async def metric_samples(url: str, api_key: str | None, family: str) -> list:
    """The server's /metrics samples of one metric family ([] if not exposed)."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics", headers=headers) as r:
            text = await r.text() if r.status == 200 else ""
    except aiohttp.ClientError:
        return []
    return [s for f in text_string_to_metric_families(text) if f.name == family for s in f.samples
            if s.name.endswith("_total")]


async def stage_seconds(url: str, api_key: str | None) -> dict[str, float]:
    """The server's streamvox_worker_stage_seconds_total by stage ({} if not exposed)."""
    return {s.labels["stage"]: s.value for s in await metric_samples(url, api_key, "streamvox_worker_stage_seconds")}


async def late_captures(url: str, api_key: str | None) -> int | None:
    """streamvox_graph_captures_after_start_total: graphs captured while serving (None if not exposed)."""
    samples = await metric_samples(url, api_key, "streamvox_graph_captures_after_start")
    return int(samples[0].value) if samples else None


def shares(before: dict[str, float], after: dict[str, float]) -> str:
    spent = {k: after[k] - before.get(k, 0.0) for k in after}
    total = sum(spent.values())
    return " ".join(f"{k} {100 * v / total:.0f}%" for k, v in spent.items()) if total > 0 else "n/a"


def fmt(v, scale=1.0, digits=0):
    return "n/a" if v is None else f"{v * scale:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="target a running server instead of starting one")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--levels", default="1,8,32,64,128,256")
    parser.add_argument("--checkpoint", help="serve this Qwen3-TTS directory (its talker; make_checkpoint.py)")
    parser.add_argument("--api-key")
    parser.add_argument("--min-sessions", type=int, default=8,
                        help="repeat a level until this many sessions were measured (percentiles need samples)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `streamvox serve` flag for the started server, repeatable "
                             "(e.g. --serve-arg=--max-slots=128)")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if args.checkpoint:
        args.serve_arg.append(f"--checkpoint={args.checkpoint}")
    server = None
    url = args.url
    if url is None:
        server = Server.start(args.preset, args.device, tempfile.mkdtemp(prefix="streamvox-e2e-"),
                              extra=args.serve_arg)
        url = server.url
        asyncio.run(server.wait_ready())
    try:
        import torch

        device = args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        name = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU x{torch.get_num_threads()} threads"
        what = f"checkpoint {args.checkpoint}" if args.checkpoint else f"preset {args.preset}"
        print(f"streamvox bench_e2e: {what}, device {device} ({name}), server {url}")
        print(f"{'clients':>7} {'sessions':>8} {'errors':>6} {'TTFA p50 ms':>11} {'TTFA p95 ms':>11} {'RTF p50':>7} "
              f"{'RTF max':>7} {'underrun':>8} {'audio s/s':>9}  worker time by stage")
        best = 0
        for c in levels:
            before = asyncio.run(stage_seconds(url, args.api_key))
            r = asyncio.run(level(url, c, args.api_key, args.min_sessions))
            after = asyncio.run(stage_seconds(url, args.api_key))
            print(f"{r['clients']:>7} {r['sessions']:>8} {r['errors']:>6} {fmt(r['ttfa_p50'], 1000):>11} {fmt(r['ttfa_p95'], 1000):>11} "
                  f"{fmt(r['rtf_p50'], 1, 2):>7} {fmt(r['rtf_max'], 1, 2):>7} {r['underrun_sessions']:>8} "
                  f"{r['audio_s_per_s']:>9.1f}  {shares(before, after) if after else ''}")
            if r["errors"] == 0 and r["underrun_sessions"] == 0:
                best = c
        print(f"largest concurrency with no underrun and no error: {best}")
        print(f"graph captures after start (each stalls every stream): {asyncio.run(late_captures(url, args.api_key))}")
    except Exception:
        if server:
            print("server log (last lines):\n" + log_tail(server.log))
        raise
    finally:
        if server:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
