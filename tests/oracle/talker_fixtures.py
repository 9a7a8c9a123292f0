"""Pytest-side access to the talker oracle fixtures (runs in streamvox's own venv).

Built by ``bash scripts/oracle-talker-fixtures.sh`` (tests/oracle/make_talker_fixtures.py
inside .venv-oracle). Missing or stale: with ``CI=true`` the test FAILS (a CI run must
never turn parity into skips); otherwise it is skipped with how to build them.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.oracle.fixtures import fixtures_state, fixtures_unavailable, scripts_stamp

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "oracle" / "talker"
# Same list as scripts/oracle-talker-fixtures.sh.
TALKER_FIXTURE_SCRIPTS = ("official.py", "randomize.py", "make_fixtures.py", "make_talker_fixtures.py")
BUILD_HINT = "build them with `bash scripts/oracle-talker-fixtures.sh` (needs .venv-oracle; about 30 s)"
CHECKPOINTS = ("cv_proj", "cv_ident")  # known at collection time


def _unavailable(reason: str) -> None:
    fixtures_unavailable("talker oracle fixtures", FIXTURES, BUILD_HINT, reason)


def _expected_stamp() -> str:
    return scripts_stamp(TALKER_FIXTURE_SCRIPTS)


@lru_cache(maxsize=1)
def _state() -> tuple[str | None, dict]:
    return fixtures_state(FIXTURES, TALKER_FIXTURE_SCRIPTS)


def manifest() -> dict:
    problem, data = _state()
    if problem:
        _unavailable(problem)
    return data


def checkpoint_dir(name: str) -> Path:
    if name not in manifest()["checkpoints"]:
        _unavailable(f"lack checkpoint {name!r}")
    return FIXTURES / name


def cases(name: str) -> dict:
    checkpoint_dir(name)
    return manifest()["checkpoints"][name]["cases"]


@lru_cache(maxsize=None)
def _references(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / f"{name}.reference.safetensors"))


def references(name: str) -> dict[str, torch.Tensor]:
    checkpoint_dir(name)
    return _references(name)
