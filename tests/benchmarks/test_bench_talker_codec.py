"""benchmarks/bench_talker.py --codec at the tiny size: the whole-path table and the codec agreement
check come out, and the agreement check tells fp32 from a bf16 codec decoder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_codec_whole_path_table_and_agreement():
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_talker.py"), "--size", "tiny", "--batches", "1",
           "--rounds", "2", "--steps", "1", "--threads", "1", "--no-official", "--codec", "--codec-bf16"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "whole path per frame" in text, text
    table = text.split("whole path per frame")[1].split("codec agreement")[0]
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.split("|")] for line in table.splitlines())
            if len(cells) == 9 and cells[1] == "1"}
    assert set(rows) == {"ours", "ours codec-bf16"}, table
    for cells in rows.values():  # each turn's total = its talker + its codec: the best total >= either best
        talker, codec, total = ([float(v) for v in cells[i].split(" / ")] for i in (2, 3, 5))
        assert min(talker + codec) > 0 and total[0] >= max(talker[0], codec[0]), cells
    snr = re.search(r"ours codec-bf16: max abs error ([\d.e+-]+), SNR ([\d.]+) dB", text)
    assert snr, text
    # bf16 rounding is audible-level noise next to fp32's reordering (~100 dB): the check separates them
    assert 0 < float(snr.group(1)) and 10 < float(snr.group(2)) < 60, snr.group(0)
    assert re.search(r"B=\s+1\s+ours codec-bf16 / ours: [\d.]+ \.\. [\d.]+ \.\. [\d.]+", text), text
