"""A short soak with the shared load generator (benchmarks/load.py) against a real server."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from load import run_load  # noqa: E402
from loadgen import Server  # noqa: E402


async def test_short_soak_has_no_errors_and_bounded_growth(tmp_path):
    server = Server.start("tiny", "cpu", str(tmp_path / "data"))
    try:
        await server.wait_ready()
        # Warm the allocator and the job store before taking the baseline.
        await run_load(server.url, sessions=2, jobs=1, seconds=1, pid=server.proc.pid)
        report = await run_load(server.url, sessions=3, jobs=1, seconds=6, pid=server.proc.pid)
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])
    assert report.errors == [], report.errors
    assert report.sessions >= 3 and report.jobs >= 1, report.table()
    # Bounded growth: no per-session leak of sockets or memory.
    assert report.fds_end - report.fds_start <= 16, report.table()
    assert report.rss_end_mb - report.rss_start_mb <= 150, report.table()
