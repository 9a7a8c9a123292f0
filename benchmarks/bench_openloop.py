"""First audio the way the peers measure it: open-loop Poisson arrivals at fixed request rates over a
fixed English sentence set, each utterance as long as its text, against the real server with real
WebSocket and HTTP clients. The same on a GPU and on the virtual device.

    # the virtual device (this CPU; prompts of benchmarks/costs/prompt-0.6b)
    .venv/bin/python benchmarks/bench_openloop.py --virtual-device benchmarks/costs/h100-0.6b.json --rates 1,5,10,20,40
    # a GPU, faster-qwen3-tts beside ours at 1 request/s (scripts/gpu-verify.sh openloop)
    python3 benchmarks/bench_openloop.py --device cuda --checkpoint /tmp/ckpt-0.6b --rates 1,5,10,20,40 \
        --peer-python /tmp/peer-python
    # before / after: another checkout's server in the same run, levels interleaved
    .venv/bin/python benchmarks/bench_openloop.py --virtual-device ... --tree before=/tmp/streamvox-main

The protocol (SGLang-Omni's calibration report and nari-qwen3-tts measure this way):

* **Arrivals**: at ``rate`` requests per second, exponential gaps (a Poisson process, seeded), for
  ``--seconds`` per rate (at least ``--min-requests``); a request is sent at its arrival whatever is
  still running (open loop: a slow server is not given time to catch up).
* **Text**: benchmarks/sentences/en.txt (523 sentences of 5-40 words written for this repository, of
  the Seed-TTS English kind), shuffled once by the seed; each rate takes the next sentences in turn.
* **Length follows the text**: each request sends ``max_new_tokens`` = its words x 12.5 / 2.7 frames
  (read English at ~2.7 words per second) + 1, since the benchmark checkpoint's random weights never
  sample EOS (on a trained checkpoint EOS would end it near there). Default sampling, seed = index.
* **Clients** (``--clients``), taking turns: ``ws`` opens a `/v1/stream` session at the arrival and
  sends the text at once (a connected voice agent); ``http`` POSTs `/v1/audio/speech` (raw PCM
  streamed, ``stream_format`` audio) on a pooled keep-alive connection. First audio = from sending
  the text (WS) or the request (HTTP) to the first PCM byte.
* **Reported per rate**: first audio p50 / p95 / p99; the server's own mean submit -> first chunk
  (``srv``); the share of streams that stay within 50 ms of underrun (playback starts at the first
  byte; no sample arrives more than 50 ms after it is due); audio seconds made per wall second; then
  the rate at which p95 first audio crosses 100 ms (linear between the two rates around it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import websockets

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_e2e import shares, stage_seconds  # noqa: E402
from loadgen import Playback, Server, log_tail, percentile, ws_url  # noqa: E402

SENTENCES = REPO / "benchmarks" / "sentences" / "en.txt"
WORDS_PER_SECOND = 2.7  # read English, ~160 words a minute
FRAMES_PER_SECOND = 12.5
UNDERRUN_MARGIN_S = 0.050  # "within 50 ms of underrun"
TARGET_P95_S = 0.100  # the rate at which p95 first audio crosses this is reported
BYTES_PER_SAMPLE = 2  # pcm_s16le
SAMPLE_RATE = 24000


def load_sentences(path: Path = SENTENCES) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#")]


def max_new_tokens_for(text: str) -> int:
    """The utterance's length from its text: its words at ~2.7 words per second, in frames, + 1
    (``max_new_tokens`` N gives N - 1 frames)."""
    return math.ceil(len(text.split()) / WORDS_PER_SECOND * FRAMES_PER_SECOND) + 1


def arrivals(rate: float, count: int, seed: int) -> list[float]:
    """``count`` arrival offsets (seconds from the level's start) of a Poisson process at ``rate``."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


@dataclass
class Stream:
    kind: str
    ttfa_s: float | None = None
    worst_lateness_s: float = 0.0
    audio_s: float = 0.0
    wall_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttfa_s is not None


def _received(stream: Stream, playback: Playback, t0: float, samples: int) -> None:
    now = time.monotonic()
    if playback.first is None:
        stream.ttfa_s = now - t0
    playback.arrived(now, samples)


async def ws_request(base: str, text: str, seed: int, max_new_tokens: int, headers: dict | None,
                     timeout_s: float) -> Stream:
    stream, playback = Stream("ws"), Playback(SAMPLE_RATE)
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with websockets.connect(ws_url(base), additional_headers=headers, max_size=None) as ws:
                json.loads(await ws.recv())  # session.created
                await ws.send(json.dumps({"type": "session.config", "seed": seed, "max_new_tokens": max_new_tokens}))
                t0 = time.monotonic()
                await ws.send(json.dumps({"type": "input.text", "text": text}))
                await ws.send(json.dumps({"type": "input.done"}))
                async for msg in ws:
                    if isinstance(msg, bytes):
                        _received(stream, playback, t0, len(msg) // BYTES_PER_SAMPLE)
                        continue
                    event = json.loads(msg)
                    if event["type"] == "error":
                        stream.error = f"{event.get('code')}: {event.get('message')}"
                        break
                    if event["type"] == "session.done":
                        break
                else:
                    stream.error = "closed before session.done"
    except Exception as exc:  # a load generator reports, it does not crash
        stream.error = f"{type(exc).__name__}: {exc}"
    return _finish(stream, playback, t0)


async def http_request(http: aiohttp.ClientSession, base: str, text: str, seed: int, max_new_tokens: int,
                       headers: dict | None, timeout_s: float) -> Stream:
    stream, playback = Stream("http"), Playback(SAMPLE_RATE)
    body = {"input": text, "response_format": "pcm", "stream_format": "audio", "seed": seed,
            "max_new_tokens": max_new_tokens}
    t0 = time.monotonic()
    carry = 0  # a chunk may end mid-sample
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(base + "/v1/audio/speech", json=body, headers=headers) as r:
                if r.status != 200:
                    stream.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                else:
                    async for data in r.content.iter_any():
                        carry += len(data)
                        samples, carry = divmod(carry, BYTES_PER_SAMPLE)
                        if samples:
                            _received(stream, playback, t0, samples)
    except Exception as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    return _finish(stream, playback, t0)


def _finish(stream: Stream, playback: Playback, t0: float) -> Stream:
    stream.wall_s = time.monotonic() - t0
    stream.audio_s = playback.samples / SAMPLE_RATE
    stream.worst_lateness_s = playback.worst_lateness_s
    if stream.error is None and stream.ttfa_s is None:
        stream.error = "no audio"
    return stream


async def run_level(base: str, rate: float, texts: list[str], seed: int, clients: list[str],
                    api_key: str | None, timeout_s: float, max_frames: int | None = None) -> tuple[list[Stream], float]:
    """One rate: every request sent at its arrival; -> the streams and the level's wall seconds
    (first arrival to last stream's end)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    offsets = arrivals(rate, len(texts), seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        start = time.monotonic()

        async def one(i: int, text: str) -> Stream:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.monotonic()))
            mnt = max_new_tokens_for(text) if max_frames is None else min(max_new_tokens_for(text), max_frames + 1)
            if clients[i % len(clients)] == "http":
                return await http_request(http, base, text, seed + i, mnt, headers, timeout_s)
            return await ws_request(base, text, seed + i, mnt, headers, timeout_s)

        streams = await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
        return list(streams), time.monotonic() - start - offsets[0]


def summarize(streams: list[Stream], wall_s: float, srv: tuple[float, float]) -> dict:
    ok = [s for s in streams if s.ok]
    ttfa = [s.ttfa_s for s in ok]
    return {"requests": len(streams), "errors": len(streams) - len(ok),
            "p50": percentile(ttfa, 0.50), "p95": percentile(ttfa, 0.95), "p99": percentile(ttfa, 0.99),
            "srv": srv[0] / srv[1] if srv[1] else None,
            "fed": (sum(1 for s in ok if s.worst_lateness_s <= UNDERRUN_MARGIN_S) / len(ok)) if ok else None,
            "worst_late": max((s.worst_lateness_s for s in ok), default=None),
            "audio_s_per_s": sum(s.audio_s for s in ok) / wall_s if wall_s > 0 else 0.0,
            "error_sample": next((s.error for s in streams if s.error), None)}


def crossing(rates: list[float], p95s: list[float | None], limit: float = TARGET_P95_S) -> str:
    """The rate at which p95 first audio crosses ``limit``, linear between the rates around it."""
    for i, (rate, p) in enumerate(zip(rates, p95s)):
        if p is None or p <= limit:
            continue
        if i == 0:
            return f"< {rate:g} req/s (already {p * 1e3:.0f} ms at the lowest rate)"
        r0, q0 = rates[i - 1], p95s[i - 1]
        if q0 is None:
            return f"<= {rate:g} req/s"
        return f"~{r0 + (rate - r0) * (limit - q0) / (p - q0):.1f} req/s (between {r0:g} and {rate:g})"
    return f"not crossed up to {rates[-1]:g} req/s"


def ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.0f}"


# ------------------------------------------------------------------------------------------- the peer


def peer_level(peer, texts: list[str], rate: float, seed: int) -> tuple[list[Stream], float]:
    """faster-qwen3-tts (bench_peers.py's worker process, one stream at a time) under the same
    arrivals: a request waits while the peer speaks the one before (its first audio counts the wait)."""
    offsets = arrivals(rate, len(texts), seed)
    start = time.monotonic()
    out: list[Stream] = []
    for i, text in enumerate(texts):
        time.sleep(max(0.0, start + offsets[i] - time.monotonic()))
        waited = time.monotonic() - (start + offsets[i])
        reply = peer.ask(1, max_new_tokens_for(text), text=text)
        stream = Stream("peer")
        if "error" in reply or reply.get("ttfa_s") is None:
            stream.error = reply.get("error", "no audio")
        else:
            stream.ttfa_s = waited + reply["ttfa_s"]
            playback = Playback(SAMPLE_RATE)
            for t, samples in reply.get("chunks", []):
                playback.arrived(t, samples)
            stream.worst_lateness_s, stream.audio_s = playback.worst_lateness_s, reply["audio_s"]
        out.append(stream)
    return out, time.monotonic() - start - offsets[0]


# -------------------------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server instead of starting one")
    p.add_argument("--device", default="cpu")
    p.add_argument("--checkpoint", help="the Qwen3-TTS directory to serve (benchmarks/make_checkpoint.py)")
    p.add_argument("--virtual-device", metavar="COSTS_JSON", help="serve on a virtual device (engines/virtual/)")
    p.add_argument("--rates", default="1,5,10,20,40", help="request rates, requests per second")
    p.add_argument("--seconds", type=float, default=30.0, help="arrivals per rate over this long")
    p.add_argument("--min-requests", type=int, default=20)
    p.add_argument("--max-requests", type=int, default=10_000)
    p.add_argument("--clients", default="ws,http", help="client kinds taking turns (ws, http)")
    p.add_argument("--seed", type=int, default=46)
    p.add_argument("--max-frames", type=int, help="cap every utterance at this many frames (quick checks, dry runs)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--sentences", type=Path, default=SENTENCES)
    p.add_argument("--api-key")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="also serve this checkout's code (e.g. the commit before a change), repeatable; "
                        "its levels interleave with this tree's (named 'this')")
    p.add_argument("--peer-python", help="an interpreter with faster-qwen3-tts: the peer under the same "
                                         "arrivals at --peer-rate (bench_peers.py's worker)")
    p.add_argument("--peer-rate", type=float, default=1.0)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `streamvox serve` flag, repeatable")
    args = p.parse_args()

    rates = [float(r) for r in args.rates.split(",")]
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if not clients or any(c not in ("ws", "http") for c in clients):
        p.error("--clients takes ws and/or http")
    serve = list(args.serve_arg)
    if args.virtual_device:
        serve.append(f"--virtual-device={Path(args.virtual_device).resolve()}")
        args.device = "cpu"
        args.checkpoint = args.checkpoint or str(REPO / "benchmarks" / "costs" / "prompt-0.6b")
    if args.checkpoint:
        serve.append(f"--checkpoint={Path(args.checkpoint).resolve()}")
    sentences = load_sentences(args.sentences)
    random.Random(args.seed).shuffle(sentences)

    trees = [("this", REPO)] + [(spec.split("=", 1)[0], Path(spec.split("=", 1)[1]).resolve()) for spec in args.tree]
    servers: dict[str, Server] = {}
    urls: dict[str, str] = {}
    try:
        if args.url:
            urls["this"] = args.url
        else:
            for name, tree in trees:
                servers[name] = Server.start("small", args.device, tempfile.mkdtemp(prefix="streamvox-openloop-"),
                                             extra=serve, cwd=tree)
                asyncio.run(servers[name].wait_ready())
                urls[name] = servers[name].url
        print(header(args, urls, rates, clients, len(sentences)))
        for name, url in urls.items():  # untimed: a first request of each client kind
            asyncio.run(run_level(url, 50.0, sentences[:len(clients)], args.seed, clients, args.api_key, args.timeout,
                                  args.max_frames))
        results: dict[str, list[dict]] = {name: [] for name in urls}
        cursor = 0
        print(f"{'tree':<8} {'req/s':>5} {'reqs':>5} {'err':>4} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} "
              f"{'srv ms':>7} {'fed <=50ms':>10} {'worst late ms':>13} {'audio s/s':>9} {'ms/tick':>7}  worker time by stage")
        for k, rate in enumerate(rates):
            count = min(args.max_requests, max(args.min_requests, round(rate * args.seconds)))
            texts = [sentences[(cursor + i) % len(sentences)] for i in range(count)]
            cursor += count
            names = list(urls)
            for name in names[k % len(names):] + names[:k % len(names)]:  # the order rotates by rate
                before = asyncio.run(stage_seconds(urls[name], args.api_key))
                streams, wall = asyncio.run(run_level(urls[name], rate, texts, args.seed + k, clients,
                                                      args.api_key, args.timeout, args.max_frames))
                after = asyncio.run(stage_seconds(urls[name], args.api_key))
                srv = (after.get("ttfa_sum", 0.0) - before.get("ttfa_sum", 0.0),
                       after.get("ttfa_count", 0.0) - before.get("ttfa_count", 0.0))
                row = summarize(streams, wall, srv)
                results[name].append(row)
                ticks = after.get("ticks", 0.0) - before.get("ticks", 0.0)
                per_tick = f"{1e3 * wall / ticks:.1f}" if ticks else "n/a"
                print(line(name, rate, row) + f" {per_tick:>7}  {shares(before, after)}", flush=True)
                if row["error_sample"]:
                    print(f"         (an error: {row['error_sample'][:200]})")
        for name in urls:
            print(f"{name}: p95 first audio crosses {TARGET_P95_S * 1e3:.0f} ms at "
                  + crossing(rates, [r["p95"] for r in results[name]]))
        if args.peer_python:
            run_peer(args, sentences, cursor)
    except Exception:
        for server in servers.values():
            print("server log (last lines):\n" + log_tail(server.log))
        raise
    finally:
        for server in servers.values():
            server.stop()
    print("p50/p95/p99 = first audio (client: text or request sent -> first PCM byte); srv = the server's mean "
          "submit -> first chunk; fed <=50ms = streams never more than 50 ms behind playback; audio s/s = audio "
          "seconds received per wall second of the level; ms/tick = level wall / worker ticks")
    return 0


def header(args, urls: dict[str, str], rates: list[float], clients: list[str], n_sentences: int) -> str:
    device = args.device
    if args.virtual_device:
        device = f"virtual device {args.virtual_device} on CPU x{os.cpu_count()}"
    elif args.device.startswith("cuda"):
        import torch

        device = torch.cuda.get_device_name()
    commit = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    return (f"bench_openloop: {device}, checkpoint {args.checkpoint}, commit {commit or '?'}, load {' '.join(load)}\n"
            f"  rates {rates} req/s over {args.seconds:g} s each (>= {args.min_requests} requests), Poisson, seed "
            f"{args.seed}; {n_sentences} sentences; length from the text ({WORDS_PER_SECOND} words/s); clients "
            f"{'/'.join(clients)}; servers {urls}")


def line(name: str, rate: float, r: dict) -> str:
    fed = "n/a" if r["fed"] is None else f"{100 * r['fed']:.0f} %"
    return (f"{name:<8} {rate:>5g} {r['requests']:>5} {r['errors']:>4} {ms(r['p50']):>7} {ms(r['p95']):>7} "
            f"{ms(r['p99']):>7} {ms(r['srv']):>7} {fed:>10} {ms(r['worst_late']):>13} {r['audio_s_per_s']:>9.1f}")


def run_peer(args, sentences: list[str], cursor: int) -> None:
    from bench_peers import PeerProcess

    peer_args = argparse.Namespace(peer_python=args.peer_python, checkpoint=args.checkpoint, device=args.device)
    peer = PeerProcess(peer_args)
    try:
        if not peer.ready:
            print("peer: faster-qwen3-tts did not start (its stderr is above)")
            return
        if args.device != "cuda":
            print("peer: faster-qwen3-tts needs CUDA (its loader read the checkpoint: CPU check only)")
            return
        count = min(args.max_requests, max(args.min_requests, round(args.peer_rate * args.seconds)))
        texts = [sentences[(cursor + i) % len(sentences)] for i in range(count)]
        peer.ask(1, max_new_tokens_for(texts[0]), text=texts[0])  # untimed: its graphs are captured on first use
        streams, wall = peer_level(peer, texts, args.peer_rate, args.seed)
        print(line("peer c1", args.peer_rate, summarize(streams, wall, (0.0, 0.0)))
              + "   (faster-qwen3-tts, chunk 1, one stream at a time)")
    finally:
        peer.close()


if __name__ == "__main__":
    sys.exit(main())
