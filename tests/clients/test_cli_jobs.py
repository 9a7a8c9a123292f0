"""`streamvox submit --wait` as a user meets it (a real subprocess against a real server): a
progress bar on stderr that ends at 100 %, the finished job on stdout, polls that back off and
that the server logs at debug, not as one INFO line each (one wait used to write 814)."""

from __future__ import annotations

import itertools
import json
import logging

from test_cli_say import run_cli

from clients.client import poll_delays
from testsupport.long_text import long_text


def test_polls_back_off_to_a_ceiling():
    delays = list(itertools.islice(poll_delays(0.25, 2.0), 12))
    assert delays[0] == 0.25 and delays == sorted(delays) and delays[-1] == 2.0
    assert sum(delays) > 12  # a minute-long job is asked some 35 times, not 300


async def test_submit_wait_shows_a_progress_bar_and_its_polls_are_not_info_lines(server, caplog):
    caplog.set_level(logging.DEBUG, logger="streamvox.http")
    rc, stdout, stderr = await run_cli("submit", long_text(1500), "--wait", "--seed", "2", "--url", server.url)
    assert rc == 0, stderr
    job = json.loads(stdout)
    assert job["status"] == "succeeded" and job["progress"]["percent"] == 100.0
    assert "Traceback" not in stderr
    bars = [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith(f"job {job['id'][:8]}:")]
    assert bars and "100.0%|" in bars[-1] and "succeeded" in bars[-1], stderr
    assert "1/1 utterances" in bars[-1] and "s of audio" in bars[-1]
    polls = [r for r in caplog.records if f"GET /v1/jobs/{job['id']} " in r.getMessage()]
    assert polls and all(r.levelno == logging.DEBUG for r in polls)
    assert any(r.levelno == logging.INFO and "POST /v1/jobs" in r.getMessage() for r in caplog.records)
