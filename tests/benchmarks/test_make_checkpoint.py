"""The benchmark checkpoint has the released sizes: every size field of the released 0.6B
CustomVoice configs (benchmarks/released/, with their sources) equals what
benchmarks/make_checkpoint.py writes for ``--size 0.6b`` (run with the official code)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ORACLE = REPO / ".venv-oracle" / "bin" / "python"
RELEASED = REPO / "benchmarks" / "released" / "Qwen3-TTS-12Hz-0.6B-CustomVoice.json"


def differences(released, made, where: str = "") -> list[str]:
    """Every field of ``released`` (recursively) that ``made`` lacks or holds another value in."""
    if isinstance(released, dict):
        if not isinstance(made, dict):
            return [f"{where}: released {released!r}, made {made!r}"]
        return [d for key, value in released.items()
                for d in differences(value, made.get(key, "<missing>"), f"{where}.{key}" if where else key)]
    if isinstance(released, list) and isinstance(made, (list, tuple)):
        made = list(made)
    return [] if released == made else [f"{where}: released {released!r}, made {made!r}"]


def test_differences_sees_a_changed_nested_field():
    released = {"a": {"b": 1, "c": [1, 2]}, "d": 2}
    assert differences(released, {"a": {"b": 1, "c": (1, 2), "extra": 0}, "d": 2}) == []
    assert differences(released, {"a": {"b": 2, "c": [1, 2]}}) == ["a.b: released 1, made 2",
                                                                   "d: released 2, made '<missing>'"]


def test_make_checkpoint_0_6b_has_every_released_size_field():
    if not ORACLE.exists():
        if os.environ.get("CI") == "true":
            pytest.fail("no .venv-oracle (scripts/oracle-env.sh): make_checkpoint runs with the official code")
        pytest.skip("no .venv-oracle (scripts/oracle-env.sh)")
    released = json.loads(RELEASED.read_text())
    out = subprocess.run([str(ORACLE), str(REPO / "benchmarks" / "make_checkpoint.py"), "--size", "0.6b",
                          "--print-config"], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=dict(os.environ, TRANSFORMERS_VERBOSITY="error"))
    assert out.returncode == 0, out.stderr[-2000:]
    made = json.loads(out.stdout)
    fields = {k: v for k, v in released.items() if k.endswith("config.json")}
    assert len(fields) == 2 and released["config.json"]["talker_config"]["code_predictor_config"]["head_dim"] == 128
    assert differences(fields, made) == []
