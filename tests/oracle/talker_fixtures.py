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


RELEASED_PREDICTOR_HEAD_DIM = 128  # REFERENCES.md: the code predictor's head_dim, not hidden / heads


def released_checkpoint(name: str, directory: Path, seed: int = 0) -> Path:
    """A copy of talker fixture ``name`` at ``directory`` holding the released values where the
    fixture's differ: the released ``generation_config.json`` (the one tests/oracle/make_fixtures.py
    writes: ``max_new_tokens`` 8192, sampled) and the code predictor's ``head_dim`` 128 (its
    attention weights redrawn at that size, fan-in scaled). Served as it is, a plain request on it
    meets what a user's first request on a released checkpoint meets."""
    import json
    import math
    import shutil

    from safetensors.torch import save_file

    from tests.oracle import fixtures

    source = checkpoint_dir(name)
    released = json.loads((fixtures.checkpoint_dir("g8_ident") / "generation_config.json").read_text())
    assert released["max_new_tokens"] == 8192, released  # make_fixtures.GENERATION_CONFIG: the released file
    shutil.copytree(source, directory)
    (directory / "generation_config.json").write_text(json.dumps(released, indent=2))
    config = json.loads((directory / "config.json").read_text())
    predictor = config["talker_config"]["code_predictor_config"]
    predictor["head_dim"] = head_dim = RELEASED_PREDICTOR_HEAD_DIM
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    weights = load_file(str(directory / "model.safetensors"))
    hidden, heads, kv_heads = (predictor[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    shapes = {"q_proj.weight": (heads * head_dim, hidden), "k_proj.weight": (kv_heads * head_dim, hidden),
              "v_proj.weight": (kv_heads * head_dim, hidden), "o_proj.weight": (hidden, heads * head_dim),
              "q_norm.weight": (head_dim,), "k_norm.weight": (head_dim,)}
    g = torch.Generator().manual_seed(seed)
    for key, value in list(weights.items()):
        suffix = key.rsplit("self_attn.", 1)[-1]
        if not key.startswith("talker.code_predictor.model.layers.") or suffix not in shapes:
            continue
        shape = shapes[suffix]
        if len(shape) == 1:  # a norm
            fresh = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            fresh = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        weights[key] = fresh.to(value.dtype)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
