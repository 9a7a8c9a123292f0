"""`streamvox synthesize` end to end, as a user runs it (a real subprocess)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

TEXT = "Hello from the command line. It writes a file."


def synthesize(tmp_path: Path, name: str, *extra: str) -> tuple[np.ndarray, int, int, bytes]:
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "clients.cli", "synthesize", "--preset", "tiny", "--device", "cpu",
         "--text", TEXT, "--out", str(out), *extra],
        capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM weights" in proc.stderr  # says which components are untrained
    frames = int(re.search(r"(\d+) frames", proc.stderr).group(1))
    audio, rate = sf.read(out, dtype="float32")
    return audio, rate, frames, out.read_bytes()


def test_synthesize_writes_a_valid_deterministic_wav(tmp_path):
    a, rate, frames, a_bytes = synthesize(tmp_path, "a.wav", "--seed", "3")
    assert rate == 24000
    assert frames > 0 and len(a) == frames * 1920
    assert np.isfinite(a).all() and np.abs(a).max() > 1e-3
    b, _, _, b_bytes = synthesize(tmp_path, "b.wav", "--seed", "3")
    assert a_bytes == b_bytes, "same seed must give the same file"
    c, _, _, _ = synthesize(tmp_path, "c.wav", "--seed", "4")
    n = min(len(a), len(c))
    assert np.abs(a[:n] - c[:n]).max() > 1e-3, "a different seed must give different audio"


def test_synthesize_flac_and_bad_voice(tmp_path):
    a, rate, frames, _ = synthesize(tmp_path, "a.flac", "--format", "flac")
    assert rate == 24000 and len(a) == frames * 1920
    proc = subprocess.run(
        [sys.executable, "-m", "clients.cli", "synthesize", "--preset", "tiny", "--device", "cpu",
         "--text", "hi", "--out", str(tmp_path / "x.wav"), "--voice", "nobody"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2
    assert "unknown voice" in proc.stderr and "default" in proc.stderr
