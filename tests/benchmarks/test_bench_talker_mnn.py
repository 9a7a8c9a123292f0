"""bench_talker's report for the qwen3-tts-mnn peer in its own int8 (no MNN needed: made-up turns):
"mnn int8 lowmem" (MNN computing on its int8 weights) is held to the floor of what "ours int8" reads,
"mnn int8" (the peer's own sessions: MNN expands the weights to fp32) to ours fp32's, and both get
their in-round ratio to ours int8 beside the one to ours fp32."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_talker import report  # noqa: E402


def test_mnn_int8_floor_and_ratio_against_ours_int8(capsys):
    args = argparse.Namespace(batches=[1], rounds=2, threads=1, dtype="float32", codec=False)
    gb = 1e9
    turns = []
    for r in range(2):
        turns.append({"variant": "machine", "batch": 1, "round": r, "bandwidth": 10 * gb, "flops": 1e12,
                      "gemv": 10 * gb, "cpu_bandwidth": 20 * gb})
        turns.append({"variant": "ours", "batch": 1, "round": r, "prefill_ms": 50.0, "step_med_ms": 800.0,
                      "step_cpu_ms": 700.0, "weight_bytes": 6 * gb, "kv_bytes": 0, "weight_elems": 1.5e9})
        turns.append({"variant": "ours int8", "batch": 1, "round": r, "prefill_ms": 20.0, "step_med_ms": 200.0,
                      "step_cpu_ms": 150.0, "weight_bytes": 1.5 * gb, "kv_bytes": 0, "weight_elems": 1.5e9})
        turns.append({"variant": "mnn int8 lowmem", "batch": 1, "round": r, "prefill_ms": 90.0, "step_med_ms": 300.0,
                      "step_cpu_ms": 240.0})
        turns.append({"variant": "mnn int8", "batch": 1, "round": r, "prefill_ms": 90.0, "step_med_ms": 600.0})
    report(args, None, ["ours", "ours int8", "mnn int8 lowmem", "mnn int8"], turns)
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.strip().startswith("mnn int8 lowmem |"))
    cells = [" ".join(c.split()) for c in row.split("|")]
    assert cells[5:8] == ["1.500", "150", "2.00 / 2.00"], cells  # ours int8's 1.5 GB at 10 GB/s
    assert re.search(r"B=\s+1\s+decode\s+mnn int8 lowmem / ours int8: 1.50 \.\. 1.50 \.\. 1.50", text), text
    assert re.search(r"B=\s+1\s+decode\s+mnn int8 lowmem / ours: 0.38 \.\. 0.38 \.\. 0.38", text), text
    row = next(line for line in text.splitlines() if line.strip().startswith("mnn int8 |"))
    assert [" ".join(c.split()) for c in row.split("|")][5:7] == ["6.000", "600"], row  # fp32's 6 GB
    assert re.search(r"B=\s+1\s+decode\s+mnn int8 / ours int8: 3.00 \.\. 3.00 \.\. 3.00", text), text
