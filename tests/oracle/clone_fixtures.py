"""Pytest-side access to the voice-clone / voice-design oracle fixtures (streamvox's venv).

Built by ``bash scripts/oracle-clone-fixtures.sh`` (tests/oracle/make_clone_fixtures.py inside
.venv-oracle). Missing or stale: with ``CI=true`` the test FAILS; otherwise it is skipped with
how to build them.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.oracle.fixtures import fixtures_state, fixtures_unavailable

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "oracle" / "clone"
# Same list as scripts/oracle-clone-fixtures.sh.
CLONE_FIXTURE_SCRIPTS = ("official.py", "randomize.py", "make_fixtures.py", "make_talker_fixtures.py",
                         "make_clone_fixtures.py")
BUILD_HINT = "build them with `bash scripts/oracle-clone-fixtures.sh` (needs .venv-oracle with librosa; about 20 s)"


@lru_cache(maxsize=1)
def _state() -> tuple[str | None, dict]:
    return fixtures_state(FIXTURES, CLONE_FIXTURE_SCRIPTS)


def manifest() -> dict:
    problem, data = _state()
    if problem:
        fixtures_unavailable("clone oracle fixtures", FIXTURES, BUILD_HINT, problem)
    return data


def checkpoint_dir(name: str) -> Path:
    if name not in manifest()["checkpoints"]:
        fixtures_unavailable("clone oracle fixtures", FIXTURES, BUILD_HINT, f"lack checkpoint {name!r}")
    return FIXTURES / name


def info(name: str) -> dict:
    checkpoint_dir(name)
    return manifest()["checkpoints"][name]


@lru_cache(maxsize=None)
def _references(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / f"{name}.reference.safetensors"))


def references(name: str) -> dict[str, torch.Tensor]:
    checkpoint_dir(name)
    return _references(name)
