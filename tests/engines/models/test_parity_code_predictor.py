"""Code predictor and codec head vs the OFFICIAL qwen-tts code (oracle fixtures).

References come from the official model loaded back by its own from_pretrained
(tests/oracle/make_fixtures.py); ours from engines.checkpoints.qwen3_tts.load_checkpoint.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from engines.checkpoints.qwen3_tts import load_checkpoint
from tests.oracle.fixtures import (
    ALL_CHECKPOINTS,
    DTYPE_VARIANTS,
    FP32_CHECKPOINTS,
    REL_TOL,
    checkpoint_dir,
    manifest,
    references,
    rel_err,
)

pytestmark = pytest.mark.parity


@lru_cache(maxsize=None)
def _parts(name: str, dtype: torch.dtype = torch.float32):
    return load_checkpoint(checkpoint_dir(name), dtype=dtype)


def _cp_cases(name: str) -> list[str]:
    return manifest()["checkpoints"][name]["cp_cases"]


@pytest.mark.parametrize("name", ALL_CHECKPOINTS)
def test_greedy_tokens_and_step_logits_match_official_generate(name):
    refs, parts = references(name), _parts(name)
    cases = _cp_cases(name)
    assert cases, "no code predictor cases in the fixtures"
    for case in cases:
        inputs = refs[f"cp/{case}/inputs"]
        codes, logits = parts.codes_and_logits(inputs)
        expected = refs[f"cp/{case}/tokens"]
        assert codes.dtype == torch.int64
        assert torch.equal(codes, expected), f"{name} {case}: tokens differ from official generate()"
        err = rel_err(logits, refs[f"cp/{case}/logits"])
        assert err <= REL_TOL, f"{name} {case}: per-step logits rel err {err:.2e}"
        assert torch.equal(parts.codes(inputs), expected)  # the public one-frame call


def test_cases_cover_several_seeds_and_batch_sizes():
    cases = _cp_cases("g16_proj")
    batches = {int(c.split("_b")[1]) for c in cases}
    seeds = {c.split("_b")[0] for c in cases}
    assert len(batches) >= 3 and 1 in batches and len(seeds) >= 3, cases


def test_fixture_configs_cover_projection_identity_and_two_group_counts():
    cps = manifest()["checkpoints"]
    proj, ident = cps["g16_proj"], cps["g8_ident"]
    assert proj["talker_hidden"] != proj["predictor_hidden"] and proj["num_code_groups"] == 16
    assert ident["talker_hidden"] == ident["predictor_hidden"] and ident["num_code_groups"] != 16
    assert isinstance(_parts("g16_proj").predictor.small_to_mtp_projection, torch.nn.Linear)
    assert isinstance(_parts("g8_ident").predictor.small_to_mtp_projection, torch.nn.Identity)


@pytest.mark.parametrize("name", FP32_CHECKPOINTS)
def test_oracle_code_predictor_depends_on_its_inputs(name):
    """Changing only the code-0 embedding row must change the official logits a lot,
    else a parity pass would say little (the fixtures use fan-in scaled weights)."""
    refs = references(name)
    base = _cp_cases(name)[-1]
    assert not torch.equal(refs["cp/dep/inputs"][:, 0], refs["cp/dep/inputs"][:, 0] * 0)
    assert torch.equal(refs["cp/dep/inputs"][:, 0], refs[f"cp/{base}/inputs"][:, 0])
    assert rel_err(refs["cp/dep/logits"][:, 0], refs[f"cp/{base}/logits"][:, 0]) > 0.1
    assert (refs["cp/dep/tokens"] != refs[f"cp/{base}/tokens"]).float().mean() > 0.5
    # and ours follows the official change
    assert torch.equal(_parts(name).codes(refs["cp/dep/inputs"]), refs["cp/dep/tokens"])


@pytest.mark.parametrize("name", ALL_CHECKPOINTS)
def test_codec_head_logits_match_official(name):
    refs, parts = references(name), _parts(name)
    err = rel_err(parts.codec_logits(refs["head/hidden"]), refs["head/logits"])
    assert err <= REL_TOL, f"{name}: codec head logits rel err {err:.2e}"
    # From a pre-norm talker hidden (the vocalizer's path): final norm + codec head.
    err = rel_err(parts.head.logits(refs["head/prenorm"]), refs["head/prenorm_logits"])
    assert err <= REL_TOL, f"{name}: norm + codec head logits rel err {err:.2e}"


@pytest.mark.parametrize("name", FP32_CHECKPOINTS)
def test_oracle_codec_head_depends_on_its_inputs(name):
    refs = references(name)
    assert rel_err(refs["head/logits"][1:], refs["head/logits"][:-1]) > 0.5


@pytest.mark.parametrize("name", DTYPE_VARIANTS)
def test_half_precision_weights_load_and_cast(name):
    """bf16 / fp16 files: loaded at fp32 they match the official fp32 load (tests above);
    loaded at bf16 the modules are bf16 and still give valid codes."""
    parts = _parts(name, torch.bfloat16)
    stored = manifest()["checkpoints"][name]["weight_dtype"]
    assert parts.config.weight_dtypes == (stored,)
    assert all(p.dtype == torch.bfloat16 for m in (parts.head, parts.predictor, parts.decoder)
               for p in m.parameters())
    refs = references(name)
    case = _cp_cases(name)[0]
    codes = parts.codes(refs[f"cp/{case}/inputs"])
    assert codes.shape == refs[f"cp/{case}/tokens"].shape
    assert 0 <= int(codes.min()) and int(codes.max()) < parts.config.codebook_size


def test_the_comparison_catches_a_realistic_mistake():
    """RoPE theta 1e4 instead of the config's 1e6 (a classic porting slip) must fail
    the logits tolerance by a wide margin: the test is able to fail."""
    from engines.models.layers import rope_inv_freq

    name = "g16_proj"
    parts = load_checkpoint(checkpoint_dir(name))  # a private copy: mutated below
    cfg = parts.predictor.cfg
    parts.predictor.inv_freq.copy_(rope_inv_freq(cfg.head_dim, 10_000.0))
    refs = references(name)
    case = _cp_cases(name)[-1]
    _, logits = parts.codes_and_logits(refs[f"cp/{case}/inputs"])
    assert rel_err(logits, refs[f"cp/{case}/logits"]) > 100 * REL_TOL
