"""End-to-end: the real server under 1..N concurrent WebSocket clients on loopback.

For each concurrency level: time to first audio p50/p95, per-stream wall/audio ratio
(RTF, < 1 keeps up), sessions with underruns (audio later than playback needs by
> 100 ms) and errors; then the largest level with no underrun. Shares its load
generator with load.py.

    .venv/bin/python benchmarks/bench_e2e.py --preset small --device cpu --levels 1,2,4,8
    python3 benchmarks/bench_e2e.py --device cuda --checkpoint DIR ...   # the talker path
    .venv/bin/python benchmarks/bench_e2e.py --virtual-device benchmarks/costs/h200-0.6b.json --levels 1,64,256 \
        --serve-arg=--max-slots=256 --serve-arg=--max-queue=1024
        # the served levels on this CPU, the talker's and codec decoder's device work as waits of a GPU's
        # measured costs (engines/virtual/; prompts of benchmarks/costs/prompt-0.6b unless --checkpoint)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import TEXTS, Server, log_tail, percentile, run_ws_session  # noqa: E402


async def level(url: str, clients: int, api_key: str | None, min_sessions: int = 1,
                config: dict | None = None) -> dict:
    """``clients`` concurrent sessions, repeated until at least ``min_sessions`` were measured
    (so a 1-client TTFA is a percentile, not one sample)."""
    t0 = time.monotonic()
    stats = []
    while len(stats) < max(clients, min_sessions):
        stats += await asyncio.gather(*(run_ws_session(url, TEXTS[i % len(TEXTS)], seed=i, api_key=api_key,
                                                       config=config) for i in range(clients)))
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


async def stage_seconds(url: str, api_key: str | None) -> dict:
    """The server's counters: ``stages`` (streamvox_worker_stage_seconds_total by stage), ``ticks``,
    ``late_captures`` and the first-audio histogram's ``ttfa_sum`` / ``ttfa_count`` ({} if not exposed)."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics", headers=headers) as r:
            text = await r.text() if r.status == 200 else ""
    except aiohttp.ClientError:
        return {}
    out: dict = {"stages": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == "streamvox_worker_stage_seconds" and sample.name.endswith("_total"):
                out["stages"][sample.labels["stage"]] = sample.value
            elif sample.name == "streamvox_tick_seconds_count":
                out["ticks"] = sample.value
            elif sample.name == "streamvox_graph_captures_after_start_total":
                out["late_captures"] = sample.value
            elif sample.name in ("streamvox_time_to_first_audio_seconds_sum", "streamvox_time_to_first_audio_seconds_count"):
                out["ttfa_" + sample.name.rsplit("_", 1)[1]] = sample.value
    return out


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system) of a process (this one when ``pid`` is None)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def served_device(url: str, api_key: str | None) -> str:
    """The device /v1/models names (a virtual device says which GPU's table it runs)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession() as http, http.get(url + "/v1/models", headers=headers) as r:
        return (await r.json())["data"][0]["device"]


def server_ttfa_ms(before: dict[str, float], after: dict[str, float]) -> str:
    """The server's own mean time to first audio over the level (submit to the first chunk handed to
    the connection: client TTFA minus this is the transport's share)."""
    n = after.get("ttfa_count", 0.0) - before.get("ttfa_count", 0.0)
    return "n/a" if n <= 0 else f"{1e3 * (after['ttfa_sum'] - before.get('ttfa_sum', 0.0)) / n:.0f}"


def shares(before: dict[str, float], after: dict[str, float]) -> str:
    stages = after.get("stages", {})
    spent = {k: v - before.get("stages", {}).get(k, 0.0) for k, v in stages.items()}
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
    parser.add_argument("--virtual-device", metavar="COSTS_JSON",
                        help="serve on a virtual device: this GPU cost table's times instead of the talker's and "
                             "codec decoder's device work (runs on the CPU)")
    parser.add_argument("--max-new-tokens", type=int,
                        help="each utterance's cap (session.config max_new_tokens; the benchmark checkpoint never "
                             "ends an utterance itself: 76 gives the 6 s utterances of the recorded GPU runs); "
                             "default: the talker's budget from the text")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `streamvox serve` flag for the started server, repeatable "
                             "(e.g. --serve-arg=--max-slots=128)")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if args.virtual_device:
        args.serve_arg.append(f"--virtual-device={args.virtual_device}")
        args.device = "cpu"
        args.checkpoint = args.checkpoint or str(Path(__file__).resolve().parent / "costs" / "prompt-0.6b")
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
        if args.virtual_device:
            name = f"{asyncio.run(served_device(url, args.api_key))}, on CPU x{os.cpu_count()} cores"
        what = f"checkpoint {args.checkpoint}" if args.checkpoint else f"preset {args.preset}"
        print(f"streamvox bench_e2e: {what}, device {device} ({name}), server {url}")
        print(f"{'clients':>7} {'sessions':>8} {'errors':>6} {'TTFA p50 ms':>11} {'TTFA p95 ms':>11} {'srv TTFA':>8} {'RTF p50':>7} "
              f"{'RTF max':>7} {'underrun':>8} {'audio s/s':>9} {'late cap':>8} {'ms/tick':>7} {'CPU ms/tick':>11}  "
              f"worker time by stage")
        best = 0
        for c in levels:
            before = asyncio.run(stage_seconds(url, args.api_key))
            cpu0 = (cpu_seconds(server.proc.pid) if server else 0.0, cpu_seconds(), time.monotonic())
            config = {"max_new_tokens": args.max_new_tokens} if args.max_new_tokens else None
            r = asyncio.run(level(url, c, args.api_key, args.min_sessions, config))
            cpu1 = (cpu_seconds(server.proc.pid) if server else 0.0, cpu_seconds(), time.monotonic())
            after = asyncio.run(stage_seconds(url, args.api_key))
            late = f"{after.get('late_captures', 0) - before.get('late_captures', 0):.0f}"
            ticks = after.get("ticks", 0.0) - before.get("ticks", 0.0)
            per_tick = "n/a" if not ticks else f"{1e3 * (cpu1[2] - cpu0[2]) / ticks:.1f}"
            # host CPU per tick: the server process (event loop + worker) / the clients (this process)
            cpu = "n/a" if not ticks or not server else (f"{1e3 * (cpu1[0] - cpu0[0]) / ticks:.1f}/"
                                                          f"{1e3 * (cpu1[1] - cpu0[1]) / ticks:.1f}")
            print(f"{r['clients']:>7} {r['sessions']:>8} {r['errors']:>6} {fmt(r['ttfa_p50'], 1000):>11} {fmt(r['ttfa_p95'], 1000):>11} "
                  f"{server_ttfa_ms(before, after):>8} {fmt(r['rtf_p50'], 1, 2):>7} {fmt(r['rtf_max'], 1, 2):>7} {r['underrun_sessions']:>8} "
                  f"{r['audio_s_per_s']:>9.1f} {late:>8} {per_tick:>7} {cpu:>11}  {shares(before, after) if after else ''}")
            if r["errors"] == 0 and r["underrun_sessions"] == 0:
                best = c
        print(f"largest concurrency with no underrun and no error: {best}")
        print(f"graph captures after start (each stalls every stream): {after.get('late_captures', 0):.0f}")
        print("late cap = graphs captured after start during the level (streamvox_graph_captures_after_start_total); "
              "srv TTFA = the server's mean submit -> first chunk (streamvox_time_to_first_audio_seconds); "
              "ms/tick = level wall / worker ticks; CPU ms/tick = host CPU per tick, server process / clients")
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
