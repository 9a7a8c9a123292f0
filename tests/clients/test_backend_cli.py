"""`--backend onnxruntime` through the user-facing commands: export, then synthesize."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clients.cli", *args], capture_output=True, text=True,
                          timeout=600, env=ENV, cwd=REPO)


def test_synthesize_with_onnxruntime_matches_torch(tmp_path):
    artifacts = tmp_path / "onnx"
    done = cli("export", "--preset", "tiny", "--out", str(artifacts))
    assert done.returncode == 0, done.stderr
    outputs = {}
    for backend in ("torch", "onnxruntime"):
        out = tmp_path / f"{backend}.wav"
        extra = ["--artifacts-dir", str(artifacts)] if backend != "torch" else []
        done = cli("synthesize", "--preset", "tiny", "--device", "cpu", "--text", "Backends must agree.",
                   "--out", str(out), "--backend", backend, *extra)
        assert done.returncode == 0, done.stderr
        outputs[backend], rate = sf.read(out, dtype="float32")
        assert rate == 24000
    assert outputs["torch"].shape == outputs["onnxruntime"].shape
    # PCM16 files: equal within 2 quantization steps (the graphs sum in another order).
    np.testing.assert_allclose(outputs["onnxruntime"], outputs["torch"], atol=2 / 32768, rtol=0)


def test_backend_errors_are_clear(tmp_path):
    done = cli("synthesize", "--preset", "tiny", "--device", "cpu", "--text", "x", "--out", str(tmp_path / "a.wav"),
               "--backend", "onnxruntime")
    assert done.returncode == 2 and "streamvox export" in done.stderr
    done = cli("synthesize", "--preset", "tiny", "--device", "cpu", "--text", "x", "--out", str(tmp_path / "a.wav"),
               "--backend", "tensorrt", "--artifacts-dir", str(tmp_path))
    assert done.returncode == 2 and "tensorrt" in done.stderr.lower()
