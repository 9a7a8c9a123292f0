"""Word timestamps cost no memory once their utterances end: the audio a request keeps for its
alignment is bounded (16-bit, at most what the aligner accepts) and freed with the request, and
the engine hands freed heap pages back when it goes idle. On ``streamvox serve`` with the random
aligner (a subprocess: its real RSS), 32 concurrent timestamped utterances leave the server's
RSS within 50 MB of what it was before them (after 32 short ones, so that what any burst of 32
builds once - batch buckets, decoder states, the aligner's first run - is in the baseline)."""

from __future__ import annotations

import asyncio
import json
import time

import websockets
from conftest import ALIGNER, ServerProcess, wait_until

SESSIONS = 32
WARM_CHARS, TIMED_CHARS = 60, 240
RSS_RETURN_MB = 50


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def sentence(chars: int) -> str:
    return (" ".join(["the quick brown fox jumps over the lazy dog near the river bank,"] * 10))[:chars - 1] + "."


async def utterance(url: str, text: str, timestamps: bool) -> int:
    """One /v1/stream round (one sentence, DiT steps 1); the alignment messages it got."""
    async with websockets.connect(url, max_size=None) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "session.config", "timestamps": timestamps, "text_streaming": False,
                                  "steps": 1}))
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        alignments = 0
        while True:
            message = await asyncio.wait_for(ws.recv(), 120)
            if isinstance(message, str):
                event = json.loads(message)
                assert event["type"] != "error", event
                alignments += event["type"] == "alignment"
                if event["type"] == "session.done":
                    return alignments


async def settled_rss_mb(pid: int) -> float:
    """RSS once it stopped moving (the engine idle and its free pages handed back)."""
    readings: list[tuple[float, float]] = []

    async def steady() -> bool:
        readings.append((time.monotonic(), rss_mb(pid)))
        recent = [mb for at, mb in readings if at >= readings[-1][0] - 1.5]
        return readings[-1][0] - readings[0][0] >= 3.0 and max(recent) - min(recent) < 2.0

    await wait_until(steady, timeout_s=30, every_s=0.25)
    return readings[-1][1]


async def test_rss_returns_after_32_timestamped_utterances(tmp_path):
    server = ServerProcess(tmp_path / "data", "--aligner", str(ALIGNER))
    try:
        url = server.wait_listening().replace("http://", "ws://") + "/v1/stream"
        pid = server.proc.pid
        await asyncio.gather(*(utterance(url, sentence(WARM_CHARS), True) for _ in range(SESSIONS)))
        baseline = await settled_rss_mb(pid)
        aligned = await asyncio.gather(*(utterance(url, sentence(TIMED_CHARS), True) for _ in range(SESSIONS)))
        assert aligned == [1] * SESSIONS  # each utterance was timed
        after = await settled_rss_mb(pid)
    finally:
        server.stop()
    print(f"RSS baseline {baseline:.0f} MB, after {SESSIONS} timestamped utterances {after:.0f} MB")
    assert after - baseline < RSS_RETURN_MB, (baseline, after)
