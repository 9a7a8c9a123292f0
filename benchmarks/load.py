"""Soak load: N concurrent WebSocket sessions plus M REST job loops for a while.

Reports errors, underruns, time to first audio, server RSS growth and open file
descriptors. Starts its own server (``--preset``/``--device``) or targets ``--url``
(then ``--pid`` lets it read the server's RSS and fds from /proc).

``--attacks`` runs the hostile clients (``attacks.py``: WebSocket floods, silent
sockets, bad bytes, a heavy streamer, over-work requests, colliding and reopened contexts, a
16-context crowd, vendor-route text, forged log lines, a connection-cap flood) from 127.0.0.2
(and 127.0.0.3) beside the normal traffic; the server it starts then has 2 s read timeouts and
at most 2 sessions' share of socket work per client address. It
fails on any 5xx, on a log line a client forged and on a traceback in the server's log (when it
started the server), and reads RSS and fds again ``--settle`` seconds after the attacks stopped
(back to baseline?).

    .venv/bin/python benchmarks/load.py --preset tiny --sessions 4 --jobs 1 --seconds 60
    .venv/bin/python benchmarks/load.py --preset tiny --sessions 2 --jobs 1 --seconds 60 --attacks
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attacks import AttackReport, report_from_json  # noqa: E402
from loadgen import (  # noqa: E402
    TEXTS,
    Server,
    percentile,
    process_open_fds,
    process_rss_mb,
    run_job,
    run_ws_session,
)


@dataclass
class LoadReport:
    sessions: int = 0
    jobs: int = 0
    errors: list[str] = field(default_factory=list)
    underruns: int = 0
    ttfa: list[float] = field(default_factory=list)
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    fds_start: int = 0
    fds_end: int = 0
    seconds: float = 0.0
    server_errors: int = 0  # 5xx answers to the normal traffic
    attacks: AttackReport | None = None
    rss_baseline_mb: float = 0.0
    rss_samples_mb: list[float] = field(default_factory=list)  # every 10 s while attacked, then settled
    fds_baseline: int = 0
    rss_settled_mb: float = 0.0
    fds_settled: int = 0
    log_bytes: int | None = None  # the server's log during the run (a server it started)
    tracebacks: int | None = None
    forged_lines: int | None = None
    loop_lag_max_s: float | None = None  # the server's own reading (streamvox_event_loop_lag_max_seconds)

    def table(self) -> str:
        p50, p95 = percentile(self.ttfa, 0.5), percentile(self.ttfa, 0.95)
        rows = [
            ("WS sessions completed", self.sessions), ("REST jobs completed", self.jobs),
            ("errors", len(self.errors)), ("underruns (>100 ms late)", self.underruns),
            ("TTFA p50 / p95 ms", f"{p50 * 1000:.0f} / {p95 * 1000:.0f}" if p50 is not None else "n/a"),
            ("server RSS start -> end MiB", f"{self.rss_start_mb:.0f} -> {self.rss_end_mb:.0f}"),
            ("server open fds start -> end", f"{self.fds_start} -> {self.fds_end}"),
            ("duration s", f"{self.seconds:.0f}"),
        ]
        if self.attacks is not None:
            rows += self.attacks.rows()
            rows += [("5xx (normal traffic + attacks)", self.server_errors + self.attacks.server_errors),
                     ("server RSS baseline -> settled MiB", f"{self.rss_baseline_mb:.0f} -> {self.rss_settled_mb:.0f}"),
                     ("server RSS every 10 s under attack MiB", ", ".join(f"{x:.0f}" for x in self.rss_samples_mb)),
                     ("server open fds baseline -> settled", f"{self.fds_baseline} -> {self.fds_settled}")]
        if self.loop_lag_max_s is not None:  # the loop's own clock: no client's scheduling in it
            rows += [("server event loop's longest lag ms (its own timer)", f"{self.loop_lag_max_s * 1000:.0f}")]
        if self.log_bytes is not None:
            rows += [("server log KiB / tracebacks / lines forged by a client",
                      f"{self.log_bytes / 1024:.0f} / {self.tracebacks} / {self.forged_lines}")]
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


async def loop_lag_max(http: aiohttp.ClientSession, url: str) -> float | None:
    """The server's longest event-loop lag since start, from its /metrics (None: not exported)."""
    async with http.get(url + "/metrics") as response:
        text = await response.text() if response.status == 200 else ""
    found = re.search(r"^streamvox_event_loop_lag_max_seconds ([0-9.eE+-]+)$", text, re.M)
    return float(found.group(1)) if found else None


async def run_load(url: str, sessions: int, jobs: int, seconds: float, pid: int | None = None,
                   api_key: str | None = None, attacks: bool = False, settle_s: float = 10.0,
                   only: str | None = None) -> LoadReport:
    report = LoadReport()
    if pid:
        report.rss_start_mb, report.fds_start = process_rss_mb(pid), process_open_fds(pid)
    deadline = time.monotonic() + seconds
    texts = itertools.cycle(TEXTS)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def ws_loop(worker: int) -> None:
        for n in itertools.count():
            if time.monotonic() >= deadline:
                return
            stats = await run_ws_session(url, next(texts), seed=worker * 1000 + n, api_key=api_key)
            if stats.error or not stats.ok:
                report.errors.append(f"ws: {stats.error or 'no session.done'}")
            else:
                report.sessions += 1
                report.underruns += stats.underruns
                if stats.ttfa_s is not None:
                    report.ttfa.append(stats.ttfa_s)

    async def job_loop(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            error = await run_job(session, url, next(texts), headers)
            if error and " HTTP 5" in error:
                report.server_errors += 1
            if error:
                report.errors.append(f"job: {error}")
            else:
                report.jobs += 1

    async def attack() -> None:
        # The baseline is taken after a third of the run of normal traffic alone (allocator
        # and caches warm), then the attacks join until the end.
        await asyncio.sleep(seconds / 3)
        sampler = None
        if pid:
            report.rss_baseline_mb, report.fds_baseline = process_rss_mb(pid), process_open_fds(pid)

            async def sample() -> None:
                while True:
                    await asyncio.sleep(10)
                    report.rss_samples_mb.append(process_rss_mb(pid))

            sampler = asyncio.create_task(sample())
        try:  # a process of its own: the attackers must not slow this process's clients
            attackers = await asyncio.create_subprocess_exec(
                sys.executable, str(Path(__file__).resolve().parent / "attacks.py"), url,
                str(max(0.0, deadline - time.monotonic())), *([only] if only else []), stdout=asyncio.subprocess.PIPE)
            out, _ = await attackers.communicate()
            if attackers.returncode != 0:
                raise RuntimeError(f"the attack process failed (exit {attackers.returncode})")
            report.attacks = report_from_json(out.decode().strip().splitlines()[-1])
        finally:
            if sampler:
                sampler.cancel()

    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(ws_loop(i) for i in range(sessions)), *(job_loop(http) for _ in range(jobs)),
                             *([attack()] if attacks else []))
        report.seconds = time.monotonic() - t0
        report.loop_lag_max_s = await loop_lag_max(http, url)
    if pid:
        report.rss_end_mb, report.fds_end = process_rss_mb(pid), process_open_fds(pid)
        if attacks:
            await asyncio.sleep(settle_s)  # timeouts fire, sessions close, memory is returned
            report.rss_settled_mb, report.fds_settled = process_rss_mb(pid), process_open_fds(pid)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="target a running server instead of starting one")
    parser.add_argument("--pid", type=int, help="server pid (with --url) for RSS / fd readings")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--api-key")
    parser.add_argument("--attacks", action="store_true", help="run the hostile clients beside the load")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the attacks before the last reading")
    parser.add_argument("--only", help="with --attacks: only these attacks (attacks.py names, comma-separated)")
    args = parser.parse_args()
    server = None
    url, pid = args.url, args.pid
    if url is None:
        # attacked: short read timeouts, and a per-key (per-address: auth is off) share of socket work
        extra = ["--http-idle-seconds", "2", "--http-body-seconds", "2", "--max-sessions-per-key", "2"] \
            if args.attacks else []
        server = Server.start(args.preset, args.device, tempfile.mkdtemp(prefix="streamvox-load-"), extra)
        url, pid = server.url, server.proc.pid
        asyncio.run(server.wait_ready())
    try:
        report = asyncio.run(run_load(url, args.sessions, args.jobs, args.seconds, pid, args.api_key,
                                      args.attacks, args.settle, args.only))
    finally:
        if server:
            server.stop()
    if server:
        report.log_bytes, report.tracebacks, report.forged_lines = server.log_bytes, server.tracebacks, server.forged_lines
    print(f"streamvox load: {args.sessions} WS sessions + {args.jobs} job loops on {url} "
          f"(preset {args.preset}, device {args.device}{', with attacks' if args.attacks else ''})")
    print(report.table())
    for err in report.errors[:10]:
        print("error:", err)
    failed = report.errors or (report.attacks is not None and report.server_errors + report.attacks.server_errors)
    failed = failed or bool(report.attacks is not None and (report.tracebacks or report.forged_lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
