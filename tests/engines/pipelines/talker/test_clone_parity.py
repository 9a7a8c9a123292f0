"""Voice-cloning front end against the official qwen-tts code (oracle fixtures).

Fixtures: ``bash scripts/oracle-clone-fixtures.sh`` (random Base / VoiceDesign / 1.7B-style
CustomVoice checkpoints in the released layout). fp32 on both sides. Tolerances (the issue's):
log-mel and x-vector within 1e-5 relative to the reference's largest magnitude (measured: the
filterbank and log-mel are bit-identical, the x-vector ~2e-7: float32 maths in the official
order reaches it; a wrong window, padding, mel scale or norm moves values by 1e-2 or more);
reference codes identical (nearest-codeword choices; the fixture script refuses near-ties).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.checkpoints.qwen3_voice import load_voice_encoders
from engines.models.mel import LogMel, slaney_mel_filterbank
from tests.oracle import clone_fixtures as fx

pytestmark = pytest.mark.parity
REL_TOL = 1e-5


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


@pytest.fixture(scope="module")
def base():
    return load_voice_encoders(fx.checkpoint_dir("base")), fx.references("base"), fx.info("base")


def test_slaney_filterbank_equals_librosa():
    ours = torch.from_numpy(slaney_mel_filterbank(24000, 1024, 128, 0, 12000))
    assert ours.dtype == torch.float32
    assert rel_err(ours, fx.references("base")["filterbank"]) < 1e-6
    # not trivially so: htk-free slaney triangles differ from a plain linear-spaced bank
    assert (ours > 0).sum(1).min() >= 1


@pytest.mark.parametrize("ref", ["a", "b"])
def test_log_mel_matches_official(base, ref):
    _, refs, _ = base
    mel = LogMel()(refs[f"ref/{ref}/wav"][None])[0]
    assert rel_err(mel, refs[f"ref/{ref}/mel"]) < REL_TOL


@pytest.mark.parametrize("ref", ["a", "b"])
def test_xvector_and_reference_codes_match_official(base, ref):
    encoders, refs, info = base
    features = encoders.features(refs[f"ref/{ref}/wav"].numpy())
    assert rel_err(torch.from_numpy(features.xvector), refs[f"ref/{ref}/xvector"]) < REL_TOL
    expected = refs[f"ref/{ref}/codes"]
    assert features.codes.shape == tuple(expected.shape) == (info["refs"][ref]["frames"], info["num_code_groups"])
    assert torch.equal(torch.from_numpy(features.codes), expected)
    assert len(set(features.codes[:, 0].tolist())) > 1  # the codes depend on the audio


def test_features_depend_on_the_audio(base):
    encoders, refs, _ = base
    a = encoders.features(refs["ref/a/wav"].numpy())
    reversed_ = encoders.features(refs["ref/a/wav"].numpy()[::-1].copy())
    assert not np.allclose(a.xvector, reversed_.xvector)
    assert not np.array_equal(a.codes, reversed_.codes)


def test_non_base_directories_have_no_voice_encoders():
    assert load_voice_encoders(fx.checkpoint_dir("design")) is None
    assert load_voice_encoders(fx.checkpoint_dir("cv17")) is None


# --------------------------------------------------------------------------- prompt modes, greedy codes

CASES = [(name, case) for name in ("base", "design", "cv17") for case in
         {"base": ["icl_a_stream", "icl_a_nonstream", "icl_b_stream_long", "icl_b_nonstream_long", "xvec_a_stream",
                   "xvec_b_nonstream"],
          "design": ["design_en", "design_auto_stream"],
          "cv17": ["instruct_ryan_en", "instruct_dylan_auto_stream"]}[name]]


@pytest.fixture(scope="module")
def bundles():
    from engines.pipelines.talker.reference import TalkerBundle

    return {name: TalkerBundle.from_checkpoint(fx.checkpoint_dir(name)) for name in ("base", "design", "cv17")}


def case_clone(bundle, refs, c):
    if c["kind"] != "clone":
        return None
    return bundle.clone_voice(refs[f"ref/{c['ref']}/wav"].numpy(), c["ref_text"], c["x_vector_only_mode"])


@pytest.mark.parametrize("name,case", CASES)
def test_prompt_and_greedy_codes_match_official(bundles, name, case):
    """generate_voice_clone (in-context / x-vector only, both text modes), generate_voice_design
    and generate_custom_voice with an instruction on a 1.7B-style checkpoint: the prefill within
    1e-5, greedy talker + predictor codes identical, through the public Python API."""
    from engines.pipelines.talker.reference import prompt_tensors

    bundle, refs, c = bundles[name], fx.references(name), fx.info(name)["cases"][case]
    clone = case_clone(bundle, refs, c)
    prompt = bundle.prompt.build(c["text"], c["speaker"], c["language"], c["non_streaming_mode"],
                                 instruct=c["instruct"], clone=clone)
    x, _, _ = prompt_tensors(bundle.talker, prompt, "cpu")
    assert rel_err(x, refs[f"case/{case}/prefill"]) < REL_TOL
    codes = bundle.generate_codes(c["text"], c["speaker"], c["language"], greedy=True,
                                  non_streaming_mode=c["non_streaming_mode"], instruct=c["instruct"], clone=clone)
    assert codes.shape[0] == c["frames"] > 0
    assert torch.equal(codes, refs[f"case/{case}/codes"])


def test_in_context_decode_matches_official_wav(bundles):
    """The official in-context output: decode(reference codes + generated codes), then cut the
    reference's share of the samples, int(T_ref / T_all * samples) (which can land one sample
    before T_ref * 1920: floating point)."""
    from engines.checkpoints.qwen3_tts import load_checkpoint

    parts = load_checkpoint(fx.checkpoint_dir("base"))
    refs = fx.references("base")
    for case in ("icl_a_stream", "icl_b_stream_long"):
        c = fx.info("base")["cases"][case]
        ref_codes = refs[f"ref/{c['ref']}/codes"]
        codes = torch.cat([ref_codes, refs[f"case/{case}/codes"]])
        wav = parts.decode(codes.T[None])[0]
        cut = int(ref_codes.shape[0] / codes.shape[0] * wav.shape[0])
        assert rel_err(wav[cut:], refs[f"case/{case}/wav"]) < REL_TOL


def test_prompt_modes_differ_and_refuse_what_they_cannot_do(bundles):
    base, design, cv = bundles["base"], bundles["design"], bundles["cv17"]
    refs = fx.references("base")
    icl = base.clone_voice(refs["ref/a/wav"].numpy(), "Hello world, this is a test.")
    xvec = base.clone_voice(refs["ref/a/wav"].numpy(), x_vector_only=True)
    assert len(base.prompt.build("Hi.", None, clone=icl)) > len(base.prompt.build("Hi.", None, clone=xvec))
    with pytest.raises(ValueError, match="reference audio"):
        base.prompt.build("Hi.", "vivian")
    with pytest.raises(ValueError, match="ref_text"):
        base.prompt.build("Hi.", None, clone=type(icl)(icl.xvector, icl.ref_codes, None))
    with pytest.raises(ValueError, match="instructions"):
        design.prompt.build("Hi.", None)
    with pytest.raises(ValueError, match="Base checkpoint"):
        cv.prompt.build("Hi.", "Ryan", clone=xvec)
    assert (base.task_type, design.task_type, cv.task_type) == ("Base", "VoiceDesign", "CustomVoice")
    assert cv.prompt.instructions_apply and design.prompt.instructions_apply and not base.prompt.instructions_apply
    with_instruction = cv.prompt.build("Hi.", "Ryan", instruct="Whisper.")
    assert len(with_instruction) > len(cv.prompt.build("Hi.", "Ryan"))
