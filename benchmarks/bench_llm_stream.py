"""Reading an LLM's answer aloud while it is written: live text vs sentence mode, side by side.

An LLM-like token stream (``--rate`` tokens/s, each gap drawn uniformly within ``--jitter``
of its mean; a token is a word piece of ~4 characters) is replayed into N concurrent
WebSocket sessions of a real server (talker checkpoint), once with ``text_streaming`` on (live
utterances) and once off (sentence mode), in one run. Per session:

- TTFA: first audio byte - first text token sent (the floor: the time the first text ids need
  to arrive, one word held back by stable tokenization, plus the first chunk's frames);
- stalls: a player that starts at the first audio and pauses whenever its buffer runs dry;
  gaps over 50 ms counted, and their total seconds (the floor for live text is what the
  text rate forces: a row that catches up with its text waits for it);
- end lag: when the last sample finishes playing - when the last token was sent.

    .venv/bin/python benchmarks/bench_llm_stream.py --checkpoint DIR --device cpu --sessions 1,4 --rate 20
    .venv-oracle/bin/python benchmarks/make_checkpoint.py --size tiny DIR    # a CPU-sized checkpoint
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import websockets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Server, percentile, ws_url  # noqa: E402

ANSWER = ("Streaming text to speech lets a voice assistant start talking while the language model is "
          "still writing its answer, so the listener hears the first words almost at once. Each sentence "
          "is spoken as it arrives, and the next one follows without a gap. That is the whole idea.")
STALL_S = 0.05


def llm_tokens(text: str, chars: int = 4) -> list[str]:
    """Word pieces of about ``chars`` characters, a leading space kept with its word (like BPE)."""
    out: list[str] = []
    for i, word in enumerate(text.split(" ")):
        word = word if i == 0 else " " + word
        out += [word[j:j + chars] for j in range(0, len(word), chars)]
    return out


@dataclass
class Player:
    rate: int = 24000
    end: float | None = None  # when the audio received so far finishes playing
    stalls: int = 0
    stall_s: float = 0.0

    def arrived(self, now: float, samples: int) -> None:
        if self.end is not None and now - self.end > STALL_S:
            self.stalls += 1
            self.stall_s += now - self.end
        self.end = max(self.end or now, now) + samples / self.rate


async def session(url: str, tokens: list[str], gaps: list[float], streaming: bool, voice: str | None) -> dict:
    player, first_audio = Player(), None
    async with websockets.connect(ws_url(url), max_size=None) as ws:
        json.loads(await ws.recv())
        config = {"type": "session.config", "text_streaming": streaming}
        if voice:
            config["voice"] = voice
        await ws.send(json.dumps(config))

        async def reader():
            nonlocal first_audio
            async for msg in ws:
                now = time.monotonic()
                if isinstance(msg, bytes):
                    first_audio = first_audio or now
                    player.arrived(now, len(msg) // 2)
                    continue
                event = json.loads(msg)
                if event["type"] == "error":
                    raise RuntimeError(f"{event.get('code')}: {event.get('message')}")
                if event["type"] == "session.done":
                    return

        task = asyncio.create_task(reader())
        t0 = time.monotonic()
        for token, gap in zip(tokens, gaps):
            await ws.send(json.dumps({"type": "input.text", "text": token}))
            await asyncio.sleep(gap)
        t_last = time.monotonic()
        await ws.send(json.dumps({"type": "input.done"}))
        await asyncio.wait_for(task, 600)
    return {"ttfa": first_audio - t0 if first_audio else None, "stalls": player.stalls, "stall_s": player.stall_s,
            "end_lag": (player.end - t_last) if player.end else None}


async def level(url: str, n: int, streaming: bool, rate: float, jitter: float, voice: str | None, seed: int) -> dict:
    tokens = llm_tokens(ANSWER)
    runs = []
    for i in range(n):
        rng = random.Random(seed + i)
        mean = 1.0 / rate
        runs.append([max(0.0, mean * (1 + rng.uniform(-jitter, jitter))) for _ in tokens])
    results = await asyncio.gather(*(session(url, tokens, gaps, streaming, voice) for gaps in runs))
    ttfa = [r["ttfa"] for r in results if r["ttfa"] is not None]
    lag = [r["end_lag"] for r in results if r["end_lag"] is not None]
    return {"ttfa50": percentile(ttfa, 0.5), "ttfa95": percentile(ttfa, 0.95),
            "stalls": sum(r["stalls"] for r in results) / n, "stall_s": sum(r["stall_s"] for r in results) / n,
            "lag50": percentile(lag, 0.5), "text_s": len(tokens) / rate}


def ms(v) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (talker checkpoint) instead of starting one")
    parser.add_argument("--checkpoint", help="serve this Qwen3-TTS directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sessions", default="1,4", help="concurrent sessions per level, comma-separated")
    parser.add_argument("--rate", type=float, default=20.0, help="LLM tokens per second")
    parser.add_argument("--jitter", type=float, default=0.5, help="each gap within +-jitter x the mean")
    parser.add_argument("--voice")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[])
    args = parser.parse_args()
    server, url = None, args.url
    if url is None:
        if not args.checkpoint:
            parser.error("--checkpoint (a talker directory) or --url")
        server = Server.start("tiny", args.device, tempfile.mkdtemp(prefix="streamvox-llm-"),
                              extra=[f"--checkpoint={args.checkpoint}", *args.serve_arg])
        url = server.url
        asyncio.run(server.wait_ready())
    try:
        import torch

        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
            f"CPU x{torch.get_num_threads()} threads"
        tokens = llm_tokens(ANSWER)
        print(f"streamvox bench_llm_stream: {args.checkpoint or url}, device {args.device} ({name}); "
              f"{len(tokens)} tokens at {args.rate:g}/s +-{args.jitter:.0%} ({len(tokens) / args.rate:.1f} s of text)")
        print(f"{'sessions':>8} {'mode':>9} {'TTFA p50 ms':>11} {'TTFA p95 ms':>11} {'stalls/sess':>11} "
              f"{'stall s/sess':>12} {'end lag p50 ms':>14}   TTFA sentence/live")
        for n in [int(x) for x in args.sessions.split(",")]:
            rows = {}
            for mode, streaming in (("live", True), ("sentence", False)):
                rows[mode] = r = asyncio.run(level(url, n, streaming, args.rate, args.jitter, args.voice, args.seed))
                ratio = ""
                if mode == "sentence" and rows["live"]["ttfa50"] and r["ttfa50"]:
                    ratio = f"{r['ttfa50'] / rows['live']['ttfa50']:.1f}x"
                print(f"{n:>8} {mode:>9} {ms(r['ttfa50']):>11} {ms(r['ttfa95']):>11} {r['stalls']:>11.1f} "
                      f"{r['stall_s']:>12.2f} {ms(r['lag50']):>14}   {ratio}")
    finally:
        if server:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
