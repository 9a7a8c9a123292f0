"""Shared load generator for bench_e2e.py and load.py: real WebSocket sessions and REST
jobs against a running streamvox server, with client-side latency accounting.

Underrun model: playback of a stream starts when its first audio byte arrives; sample
k must be in hand by ``t_first + k / sample_rate``. A chunk that arrives more than
``UNDERRUN_SLACK_S`` after the moment its first sample is due is an underrun.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import websockets

UNDERRUN_SLACK_S = 0.100
BYTES_PER_SAMPLE = 2  # pcm_s16le
TEXTS = [
    "Hello there. This is a load test of the streaming speech server.",
    "Every session sends a few sentences and reads the audio back as it arrives.",
    "The quick brown fox jumps over the lazy dog, while the tick loop keeps every stream fed.",
    "Numbers such as 3.5 and 42 are part of the text too.",
]


@dataclass
class Playback:
    """The underrun model: playback starts when the first audio arrives; sample k is due at
    ``first + k / rate``; audio arriving more than UNDERRUN_SLACK_S after it is due is late."""

    rate: int
    first: float | None = None
    samples: int = 0
    underruns: int = 0
    worst_lateness_s: float = 0.0

    def arrived(self, now: float, samples: int) -> None:
        if self.first is None:
            self.first = now
        lateness = now - (self.first + self.samples / self.rate)
        self.worst_lateness_s = max(self.worst_lateness_s, lateness)
        if lateness > UNDERRUN_SLACK_S:
            self.underruns += 1
        self.samples += samples


@dataclass
class StreamStats:
    ok: bool = False
    error: str | None = None
    ttfa_s: float | None = None
    audio_s: float = 0.0
    wall_s: float = 0.0
    underruns: int = 0
    worst_lateness_s: float = 0.0

    @property
    def rtf(self) -> float | None:
        """Wall seconds per audio second (lower is better; < 1 keeps up)."""
        return self.wall_s / self.audio_s if self.audio_s else None


def ws_url(base: str) -> str:
    from clients.address import parse_address  # the CLI's reading of an address, so benchmarks take the same forms

    return parse_address(base).stream_url


async def run_ws_session(base_url: str, text: str, seed: int = 0, api_key: str | None = None,
                         timeout_s: float = 300.0, config: dict | None = None) -> StreamStats:
    """One WebSocket session: config (``config`` adds session.config fields, e.g. max_new_tokens),
    text, input.done, read until session.done."""
    stats = StreamStats()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    clock = {"t0": time.monotonic()}

    async def session() -> None:
        async with websockets.connect(ws_url(base_url), additional_headers=headers, max_size=None) as ws:
            created = json.loads(await ws.recv())
            rate = int(created.get("sample_rate", 24000))
            await ws.send(json.dumps({"type": "session.config", "seed": seed, **(config or {})}))
            clock["t0"] = t0 = time.monotonic()
            await ws.send(json.dumps({"type": "input.text", "text": text}))
            await ws.send(json.dumps({"type": "input.done"}))
            playback = Playback(rate)
            try:
                async for msg in ws:
                    now = time.monotonic()
                    if isinstance(msg, bytes):
                        if playback.first is None:
                            stats.ttfa_s = now - t0
                        playback.arrived(now, len(msg) // BYTES_PER_SAMPLE)
                        continue
                    event = json.loads(msg)
                    if event["type"] == "error":
                        stats.error = f"{event.get('code')}: {event.get('message')}"
                        break
                    if event["type"] == "session.done":
                        stats.ok = True
                        break
            finally:
                stats.audio_s = playback.samples / rate
                stats.underruns, stats.worst_lateness_s = playback.underruns, playback.worst_lateness_s

    try:
        await asyncio.wait_for(session(), timeout_s)
    except Exception as exc:  # a load generator reports, it does not crash
        stats.error = f"{type(exc).__name__}: {exc}"
    stats.wall_s = time.monotonic() - clock["t0"]
    return stats


async def run_job(session: aiohttp.ClientSession, base_url: str, text: str, headers: dict,
                  timeout_s: float = 300.0) -> str | None:
    """Submit a REST job, poll it, download the audio; returns an error string or None."""
    try:
        async with session.post(f"{base_url}/v1/jobs", json={"input": text}, headers=headers) as r:
            if r.status != 202:
                return f"submit HTTP {r.status}"
            job = await r.json()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            async with session.get(f"{base_url}/v1/jobs/{job['id']}", headers=headers) as r:
                status = (await r.json())["status"]
            if status == "succeeded":
                async with session.get(f"{base_url}/v1/jobs/{job['id']}/audio", headers=headers) as r:
                    body = await r.read()
                    return None if r.status == 200 and len(body) > 44 else f"audio HTTP {r.status}"
            if status in ("failed", "cancelled"):
                return f"job {status}"
            await asyncio.sleep(0.2)
        return "job timed out"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def process_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def process_open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def log_tail(lines: list[str], n: int = 40) -> str:
    """The last ``n`` distinct lines of a server log: a device-side assert prints one line per
    GPU thread, which would push the traceback out of any fixed window."""
    out: list[str] = []
    for line in reversed(lines):
        if out and line[:60] == out[-1][:60]:
            continue
        out.append(line)
        if len(out) == n:
            break
    return "".join(reversed(out))


@dataclass
class Server:
    """A real `streamvox serve` subprocess on 127.0.0.1 with an ephemeral port."""

    proc: subprocess.Popen
    url: str
    log: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, preset: str, device: str, data_dir: str, extra: list[str] | None = None,
              timeout_s: float = 300.0, cwd: Path | None = None) -> "Server":
        """``cwd``: serve that checkout's code (another tree's, for a before / after); default this one."""
        cmd = [sys.executable, "-m", "clients.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--preset", preset, "--device", device, "--data-dir", data_dir, *(extra or [])]
        if not any(arg.startswith(("--model", "--checkpoint")) for arg in extra or []):
            # the preset is what is measured: without a model named, serve would load the default
            # Qwen3-TTS release (from the cache or the hub) instead
            cmd += ["--model", "random"]
        env = None if cwd is None else {**os.environ, "PYTHONPATH": str(cwd)}
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                cwd=cwd or Path(__file__).resolve().parents[1], env=env)
        deadline = time.monotonic() + timeout_s
        log: list[str] = []
        assert proc.stderr is not None
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                raise RuntimeError("server exited before listening:\n" + log_tail(log))
            log.append(line)
            if "listening on http://" in line:
                url = line.strip().split("listening on ")[-1].split()[0]
                server = cls(proc, url, log)
                server._drain_stderr()
                return server
        proc.kill()
        raise RuntimeError("server did not start in time")

    log_bytes: int = 0  # everything the server logged after it listened
    tracebacks: int = 0  # "Traceback" lines among them
    forged_lines: int = 0  # lines starting with FORGED_PREFIX: a client wrote a log line of its own

    FORGED_PREFIX = "2026-01-01 00:00:00,000"  # the fake timestamp attacks.log_forging sends

    def _drain_stderr(self) -> None:
        import threading

        def pump():
            for line in self.proc.stderr:  # type: ignore[union-attr]
                self.log.append(line)
                del self.log[:-200]
                self.log_bytes += len(line.encode())
                self.tracebacks += line.startswith("Traceback")
                self.forged_lines += line.startswith(self.FORGED_PREFIX)

        threading.Thread(target=pump, daemon=True).start()

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    async def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:  # died while loading or warming up: say why
                    raise RuntimeError(f"server exited with {self.proc.returncode} before ready:\n"
                                       + log_tail(self.log))
                try:
                    async with s.get(f"{self.url}/readyz") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError("server not ready in time:\n" + log_tail(self.log))
