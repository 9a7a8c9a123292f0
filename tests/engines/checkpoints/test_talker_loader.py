"""checkpoints.qwen3_tts.load_talker: strict inside ``talker.`` (minus the code predictor), clear errors, dtypes.

Uses the talker oracle fixture checkpoints as the well-formed starting point.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.checkpoints.files import CheckpointError
from engines.checkpoints.qwen3_tts import (
    TalkerGenerationConfig,
    load_checkpoint,
    load_talker,
)
from engines.contract import SynthesisRequest
from engines.pipelines.talker.reference import TalkerBundle
from engines.pipelines.talker.source import TalkerSource
from tests.oracle import talker_fixtures as fx
from testsupport.talker import step

pytestmark = pytest.mark.parity  # needs the oracle fixtures



@pytest.fixture
def ckpt(tmp_path):
    src = fx.checkpoint_dir("cv_ident")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_weights(directory, fn):
    path = directory / "model.safetensors"
    state = load_file(str(path))
    fn(state)
    save_file(state, str(path))


def _edit_config(directory, fn):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    fn(config)
    path.write_text(json.dumps(config))


def test_loads_and_shares_the_predictor(ckpt):
    parts = load_checkpoint(ckpt)
    bundle = load_talker(ckpt, predictor=parts.predictor)
    assert bundle.predictor is parts.predictor
    assert sorted(bundle.prompt.speakers) == ["dylan", "eric", "ryan", "vivian"]
    # The talker's head/norm/embedding are the tensors the loader's CodecHead holds.
    assert torch.equal(bundle.talker.codec_head.weight, parts.head.codec_head.weight)
    assert torch.equal(bundle.talker.model.norm.weight, parts.head.model.norm.weight)


def test_alone_it_loads_the_same_predictor_and_generation_defaults(ckpt):
    parts, alone = load_checkpoint(ckpt), load_talker(ckpt)
    assert alone.predictor.cfg == parts.config.code_predictor  # one parser for both loaders
    for (k, v), (k2, v2) in zip(alone.predictor.state_dict().items(), parts.predictor.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    assert alone.generation == TalkerGenerationConfig.from_dir(ckpt)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("talker.model.layers.0.mlp.up_proj.weight"), "missing tensors"),
    (lambda s: s.pop("talker.text_projection.linear_fc1.bias"), "missing tensors"),
    (lambda s: s.__setitem__("talker.model.layers.0.self_attn.q_proj.bias", torch.zeros(64)), "unexpected"),
    (lambda s: s.__setitem__("talker.lm_head.weight", torch.zeros(4, 4)), "unexpected"),
    (lambda s: s.__setitem__("talker.model.text_embedding.weight", torch.zeros(3, 3)), "shape mismatch"),
])
def test_strict_inside_the_talker_prefix(ckpt, edit, message):
    _edit_weights(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        load_talker(ckpt)


def test_tolerant_outside_it(ckpt):
    _edit_weights(ckpt, lambda s: s.__setitem__("speaker_encoder.extra.weight", torch.zeros(2)))
    load_talker(ckpt)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["talker_config"].pop("text_vocab_size"), "text_vocab_size"),
    (lambda c: c["talker_config"].__setitem__("use_sliding_window", True), "use_sliding_window"),
    (lambda c: c["talker_config"].__setitem__("hidden_act", "gelu"), "hidden_act"),
    (lambda c: c.pop("tts_pad_token_id"), "tts_pad_token_id"),
    (lambda c: c["talker_config"]["spk_is_dialect"].__setitem__("vivian", "martian_dialect"), "martian_dialect"),
])
def test_malformed_config(ckpt, edit, message):
    _edit_config(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        load_talker(ckpt)


def test_missing_tokenizer_files(ckpt):
    (ckpt / "merges.txt").unlink()
    with pytest.raises(CheckpointError, match="merges.txt"):
        load_talker(ckpt)


def test_base_config_without_speaker_encoder_is_refused(ckpt):
    """A directory that says Base but holds no speaker encoder cannot clone: refused at load,
    naming the missing tensors (tests/engines/pipelines/talker/test_clone_parity.py runs real Base directories)."""
    _edit_config(ckpt, lambda c: c.__setitem__("tts_model_type", "base"))
    with pytest.raises(CheckpointError, match="speaker_encoder"):
        TalkerBundle.from_checkpoint(ckpt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_batched(ckpt, dtype):
    """Lower precision runs end to end (codes in range, batch == solo at that dtype)."""
    bundle = TalkerBundle.from_checkpoint(ckpt, dtype=dtype)
    solo = bundle.generate_codes("Hello world, this is a test.", "Ryan", "English", greedy=True, max_new_tokens=8)
    source = TalkerSource.from_bundle(bundle, max_slots=2, max_seq_len=96)
    source.admit(SynthesisRequest(id="a", text="Hello world, this is a test.", voice="Ryan", language="English",
                                  temperature=0), max_new_tokens=8)
    source.admit(SynthesisRequest(id="b", text="Streaming speech.", voice="Vivian"), max_new_tokens=5)
    got = []
    while source.active_slots:
        got += [f.codes for f in step(source) if f.request_id == "a"]
    codes = torch.cat(got)
    assert codes.shape[1] == 4 and int(codes.max()) < 64 and int(codes.min()) >= 0
    assert torch.equal(codes, solo)
