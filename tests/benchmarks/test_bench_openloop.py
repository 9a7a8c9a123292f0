"""The open-loop first-audio benchmark (benchmarks/bench_openloop.py): its sentence set, the length
it asks for, the rate at which p95 crosses 100 ms, and a run at tiny levels on a virtual device -
a real server, real WebSocket and HTTP clients - that reports every figure, so the protocol a GPU
run relies on cannot rot."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engines.text.sentences import split_sentences

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_openloop  # noqa: E402

TINY_TABLE = {  # a fast virtual GPU: 2-4 ms steps, so a 5 s utterance takes a fraction of a second
    "schema": 1, "device": "test GPU", "torch": "0", "date": "2026-11-30", "commit": "test", "size": "0.6b",
    "dtype": "bfloat16", "command": "by hand",
    "decode_step": {"rows": [1, 4], "kv_blocks": [1, 8], "ms": [[2.0, 3.0], [3.0, 4.0]]},
    "prefill": {"prompts": [1, 4], "width": [8, 64], "ms": [[4.0, 5.0], [6.0, 8.0]]},
    "codec_decode": {"rows": [1, 4], "frames": [1, 25], "ms": [[1.0, 3.0], [2.0, 5.0]]},
    "capture_ms": {"decode_step": 20.0, "codec_decode": 10.0}, "start_s": 1.0, "prefill_graph_positions": 1024,
}


def test_the_sentence_set_is_500_single_sentences_of_5_to_40_words_with_its_source_stated():
    text = bench_openloop.SENTENCES.read_text(encoding="utf-8")
    assert "Source:" in text.split("\n\n")[0] and "written for this repository" in text
    sentences = bench_openloop.load_sentences()
    assert len(sentences) >= 500 and len(set(sentences)) == len(sentences)
    assert all(5 <= len(s.split()) <= 40 for s in sentences)
    # one utterance each: the server's splitter finds no sentence end inside a line
    assert all(len(split_sentences(s + " Next")[0]) == 1 for s in sentences)
    assert sum(len(s.split()) > 25 for s in sentences) >= 40  # long ones too


def test_the_length_follows_the_text():
    assert bench_openloop.max_new_tokens_for("one two three four five") == 25  # 5 / 2.7 s x 12.5 + 1
    assert bench_openloop.max_new_tokens_for(" ".join(["w"] * 27)) == 126  # 10 s of speech


def test_the_rate_where_p95_crosses_100_ms():
    rates = [1.0, 5.0, 10.0, 20.0, 40.0]
    assert bench_openloop.crossing(rates, [0.03, 0.05, 0.08, 0.12, 0.3]).startswith("~15.0 req/s")
    assert bench_openloop.crossing(rates, [0.03, 0.05, 0.08, 0.09, 0.1]).startswith("not crossed up to 40")
    assert bench_openloop.crossing(rates, [0.2, 0.3, 0.4, 0.5, 0.6]).startswith("< 1 req/s")
    arrivals = bench_openloop.arrivals(20.0, 2000, seed=1)
    assert arrivals == sorted(arrivals) and 90 < arrivals[-1] < 110  # 2000 arrivals at 20 per second


@pytest.mark.timeout(300)
def test_a_tiny_run_on_a_virtual_device_reports_every_figure(tmp_path):
    table = tmp_path / "tiny-0.6b.json"
    table.write_text(json.dumps(TINY_TABLE))
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_openloop.py", "--virtual-device", str(table), "--rates", "2,4",
         "--seconds", "1", "--min-requests", "4", "--serve-arg=--max-slots=16"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "virtual device" in out and "ws/http" in out
    rows = re.findall(r"^this +(\d+) +(\d+) +(\d+) +(\d+) +(\d+) +(\d+) +(\d+) +(\d+) %", out, re.M)
    assert [(rate, reqs, errors) for rate, reqs, errors, *_ in rows] == [("2", "4", "0"), ("4", "4", "0")], out
    for _, _, _, p50, p95, p99, srv, fed in rows:
        assert 0 < int(p50) <= int(p95) <= int(p99) and int(srv) > 0 and 0 <= int(fed) <= 100
    assert re.search(r"^this: p95 first audio crosses 100 ms at ", out, re.M), out
