"""Pytest-side access to the oracle fixtures (runs in streamvox's own venv).

The fixtures are built by ``bash scripts/oracle-env.sh`` (tests/oracle/make_fixtures.py
inside .venv-oracle). When they are missing or stale: with ``CI=true`` the test FAILS
(a CI run must never turn parity into skips); otherwise it is skipped with a message
saying how to build them.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "oracle"
FIXTURE_SCRIPTS = ("official.py", "randomize.py", "make_fixtures.py")  # same list as scripts/oracle-env.sh
BUILD_HINT = "build them with `bash scripts/oracle-env.sh` (about 1 minute)"

# fp32 parity tolerance, relative to the reference's largest magnitude. Both sides do
# the same maths in a different operation order (SDPA vs explicit attention, fused
# vs split matmuls): measured differences are ~3e-7 for logits and <= ~4e-6 for the
# decoder's deep conv stack; 1e-5 holds them with margin while any real mistake (an
# eps, a RoPE or scale convention, a wrong tensor) moves outputs by 1e-3 or more.
REL_TOL = 1e-5
# float64 on both sides removes fp32 noise; what is left is a pure implementation check.
REL_TOL_FP64 = 1e-9


def fixtures_unavailable(label: str, directory: Path, hint: str, reason: str) -> None:
    """Fail under CI=true (parity must never turn into skips), else skip with ``hint``."""
    message = f"{label} {reason} ({directory}); {hint}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " [CI=true: missing fixtures are a failure, never a skip]", pytrace=False)
    pytest.skip(message)


def scripts_stamp(scripts: tuple[str, ...]) -> str:
    """The hash a fixture directory's STAMP must hold: the scripts that wrote it."""
    data = b"".join((Path(__file__).parent / name).read_bytes() for name in scripts)
    return hashlib.sha256(data).hexdigest()


def fixtures_state(directory: Path, scripts: tuple[str, ...]) -> tuple[str | None, dict]:
    """(problem or None, manifest) of one fixture directory."""
    manifest, stamp = directory / "manifest.json", directory / "STAMP"
    if not manifest.is_file() or not stamp.is_file():
        return "are missing", {}
    if stamp.read_text().strip() != scripts_stamp(scripts):
        return "are stale (the fixture scripts changed)", {}
    return None, json.loads(manifest.read_text())


def _unavailable(reason: str) -> None:
    fixtures_unavailable("oracle fixtures", FIXTURES, BUILD_HINT, reason)


def _expected_stamp() -> str:
    return scripts_stamp(FIXTURE_SCRIPTS)


@lru_cache(maxsize=1)
def _state() -> tuple[str | None, dict]:
    return fixtures_state(FIXTURES, FIXTURE_SCRIPTS)


def manifest() -> dict:
    """The fixture manifest; fails (CI) or skips when fixtures are missing or stale."""
    problem, data = _state()
    if problem:
        _unavailable(problem)
    return data


def checkpoint_dir(name: str) -> Path:
    if name not in manifest()["checkpoints"]:
        _unavailable(f"lack checkpoint {name!r}")
    return FIXTURES / name


@lru_cache(maxsize=None)
def _references(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / f"{name}.reference.safetensors"))


def references(name: str) -> dict[str, torch.Tensor]:
    checkpoint_dir(name)
    return _references(name)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (in float64)."""
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


# Names known at collection time (parametrisation must not depend on the files).
FP32_CHECKPOINTS = ("g16_proj", "g8_ident")
DTYPE_VARIANTS = ("g8_ident_bfloat16", "g8_ident_float16")
ALL_CHECKPOINTS = FP32_CHECKPOINTS + DTYPE_VARIANTS
