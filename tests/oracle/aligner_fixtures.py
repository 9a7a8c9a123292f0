"""Pytest-side access to the forced-aligner oracle fixtures (runs in streamvox's own venv).

Built by ``bash scripts/aligner-oracle-env.sh`` (tests/oracle/make_aligner_fixtures.py inside
.venv-aligner). Missing or stale: with ``CI=true`` the test FAILS; otherwise it is skipped.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.oracle.fixtures import fixtures_state, fixtures_unavailable

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "aligner"
SCRIPTS = ("make_aligner_fixtures.py",)  # same list as scripts/aligner-oracle-env.sh
BUILD_HINT = "build them with `bash scripts/aligner-oracle-env.sh` (about 2 minutes the first time)"
CASES = ("en_short", "en_long", "de", "zh", "ko", "ja", "fr")  # known at collection time


@lru_cache(maxsize=1)
def _state() -> tuple[str | None, dict]:
    return fixtures_state(FIXTURES, SCRIPTS)


def manifest() -> dict:
    problem, data = _state()
    if problem:
        fixtures_unavailable("aligner oracle fixtures", FIXTURES, BUILD_HINT, problem)
    return data


def checkpoint_dir() -> Path:
    return FIXTURES / manifest()["checkpoint"]


@lru_cache(maxsize=1)
def references() -> dict[str, torch.Tensor]:
    manifest()
    return load_file(str(FIXTURES / "tiny.reference.safetensors"))
