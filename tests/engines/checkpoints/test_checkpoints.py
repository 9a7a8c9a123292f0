"""The Qwen3-TTS directory loader: strict inside what it loads, tolerant outside.

These tests build a small directory in the official layout from our own modules (so
they run without the oracle venv) with extra tensors outside the loaded prefixes, then
break it one way at a time: every malformed case must raise CheckpointError whose
message names the file and the tensors / keys at fault.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.checkpoints.files import CheckpointError
from engines.checkpoints.qwen3_tts import load_checkpoint
from engines.config import EngineConfig, get_preset
from engines.models.code_predictor import CodePredictor
from engines.models.codec_decoder import CodecDecoder
from engines.models.codec_head import CodecHead
from engines.models.init import init_module_

pytestmark = pytest.mark.parity

PRESET = get_preset("tiny")


def _talker_config() -> dict:
    head, cp = PRESET.codec_head, PRESET.code_predictor
    cp_cfg = {k: v for k, v in dataclasses.asdict(cp).items() if k != "talker_hidden_size"}
    return {
        "hidden_size": head.hidden_size, "vocab_size": head.vocab_size, "rms_norm_eps": head.rms_norm_eps,
        "num_code_groups": cp.num_code_groups, "codec_pad_id": head.codec_pad_id,
        "codec_bos_id": head.codec_bos_id, "codec_eos_token_id": head.codec_eos_token_id,
        "num_hidden_layers": 28, "hidden_act": "silu",
        "code_predictor_config": {**cp_cfg, "hidden_act": "silu", "model_type": "qwen3_tts_talker_code_predictor"},
    }


def _decoder_config() -> dict:
    dec = dataclasses.asdict(PRESET.decoder)
    return {**dec, "upsample_rates": list(dec["upsample_rates"]),
            "upsampling_ratios": list(dec["upsampling_ratios"]), "hidden_act": "silu"}


def write_directory(root: Path, dtype: torch.dtype = torch.float32) -> Path:
    """An official-layout directory: our three parts under their official keys, plus
    tensors a real checkpoint also holds and we must ignore."""
    head, predictor, decoder = (init_module_(m, 3) for m in (
        CodecHead(PRESET.codec_head), CodePredictor(PRESET.code_predictor), CodecDecoder(PRESET.decoder)))
    talker = {f"talker.code_predictor.{k}": v for k, v in predictor.state_dict().items()}
    talker |= {f"talker.{k}": v for k, v in head.state_dict().items()}
    talker |= {  # outside what we load: the full talker, a speaker encoder
        "talker.model.layers.0.self_attn.q_proj.weight": torch.randn(8, PRESET.codec_head.hidden_size),
        "talker.model.text_embedding.weight": torch.randn(10, 4),
        "speaker_encoder.fc.weight": torch.randn(4, 4),
    }
    tokenizer = {f"decoder.{k}": v for k, v in decoder.state_dict().items()}
    tokenizer["encoder.encoder.layers.0.conv.weight"] = torch.randn(4, 1, 7)
    root.mkdir(parents=True, exist_ok=True)
    (root / "speech_tokenizer").mkdir(exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in talker.items()}, str(root / "model.safetensors"))
    save_file({k: v.to(dtype).contiguous() for k, v in tokenizer.items()},
              str(root / "speech_tokenizer" / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3_tts", "tts_model_type": "base",
                                                  "talker_config": _talker_config()}))
    (root / "speech_tokenizer" / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_tts_tokenizer_12hz", "decoder_config": _decoder_config()}))
    (root / "generation_config.json").write_text("{}")
    return root


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return write_directory(tmp_path / "ckpt")


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _expect(ckpt: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in error: {message}"
    return message


# --------------------------------------------------------------------------- good directories


def test_loads_and_ignores_tensors_outside_the_loaded_prefixes(ckpt):
    parts = load_checkpoint(ckpt)
    c = parts.config
    assert (c.num_code_groups, c.codebook_size, c.talker_hidden_size) == (
        PRESET.code_predictor.num_code_groups, PRESET.code_predictor.vocab_size, PRESET.codec_head.hidden_size)
    assert c.code_predictor == PRESET.code_predictor and c.decoder == PRESET.decoder
    assert c.codec_head == PRESET.codec_head and c.weight_dtypes == ("float32",)
    expected = load_file(str(ckpt / "model.safetensors"))
    for k, v in parts.predictor.state_dict().items():
        assert torch.equal(v, expected[f"talker.code_predictor.{k}"]), k


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_half_precision_files_are_cast_to_the_requested_dtype(tmp_path, stored, dtype):
    root = write_directory(tmp_path / "half", dtype=stored)
    parts = load_checkpoint(root, dtype=dtype)
    assert parts.config.weight_dtypes == (str(stored).removeprefix("torch."),)
    assert {p.dtype for m in (parts.head, parts.predictor, parts.decoder) for p in m.parameters()} == {dtype}
    stored_weight = load_file(str(root / "model.safetensors"))["talker.codec_head.weight"]
    assert torch.equal(parts.head.codec_head.weight, stored_weight.to(dtype))


def test_public_calls_have_the_documented_shapes(ckpt):
    parts = load_checkpoint(ckpt)
    d, g, v = PRESET.codec_head.hidden_size, PRESET.num_code_groups, PRESET.codec_head.vocab_size
    codes = parts.codes(torch.randn(3, 2, d))
    assert codes.shape == (3, g - 1) and codes.dtype == torch.int64
    assert parts.codec_logits(torch.randn(3, d)).shape == (3, v)
    assert parts.decode(torch.zeros(2, g, 4, dtype=torch.long)).shape == (2, 4 * 1920)
    with pytest.raises(ValueError, match=r"inputs_embeds must be \[B, 2,"):
        parts.codes(torch.randn(3, 3, d))


def test_sharded_weights_load(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(ckpt / shard))
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    parts = load_checkpoint(ckpt)
    assert torch.equal(parts.head.codec_head.weight, tensors["talker.codec_head.weight"])


def test_model_config_takes_codec_sizes_from_the_directory_and_dit_sizes_from_the_preset(ckpt):
    parts = load_checkpoint(ckpt)
    base = get_preset("small")  # a preset whose codec sizes differ from the directory's
    merged = parts.model_config(base)
    assert merged.code_predictor == parts.config.code_predictor and merged.decoder == parts.config.decoder
    assert merged.codec_head == parts.config.codec_head
    assert merged.dit.latent_dim == parts.config.talker_hidden_size != base.dit.latent_dim
    assert dataclasses.replace(merged.dit, latent_dim=base.dit.latent_dim) == base.dit
    assert (merged.text, merged.duration, merged.stream) == (base.text, base.duration, base.stream)


# --------------------------------------------------------------------------- malformed directories


def test_not_a_directory(tmp_path):
    _expect(tmp_path / "nope", str(tmp_path / "nope"), "not a directory")


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    _expect(ckpt, str(ckpt / "config.json"), "file not found")


def test_config_json_is_not_json(ckpt):
    (ckpt / "config.json").write_text("{talker_config: ")
    _expect(ckpt, str(ckpt / "config.json"), "not valid JSON")


def test_config_without_talker_config(ckpt):
    _edit_json(ckpt / "config.json", lambda c: c.pop("talker_config"))
    _expect(ckpt, str(ckpt / "config.json"), "missing key 'talker_config'")


def test_config_with_a_wrongly_typed_size(ckpt):
    _edit_json(ckpt / "config.json", lambda c: c["talker_config"]["code_predictor_config"].update(hidden_size="64"))
    _expect(ckpt, str(ckpt / "config.json"), "code_predictor_config", "'hidden_size' must be int")


def test_config_with_a_non_positive_size(ckpt):
    _edit_json(ckpt / "config.json", lambda c: c["talker_config"].update(hidden_size=0))
    _expect(ckpt, "[talker_config]", "'hidden_size' must be > 0")


def test_config_with_inconsistent_group_counts(ckpt):
    _edit_json(ckpt / "config.json", lambda c: c["talker_config"].update(num_code_groups=5))
    _expect(ckpt, "num_code_groups 5 != code_predictor_config.num_code_groups 4")


def test_config_with_an_unsupported_activation(ckpt):
    _edit_json(ckpt / "config.json", lambda c: c["talker_config"]["code_predictor_config"].update(hidden_act="gelu"))
    _expect(ckpt, "hidden_act 'gelu' is not supported")


def test_missing_speech_tokenizer_config(ckpt):
    (ckpt / "speech_tokenizer" / "config.json").unlink()
    _expect(ckpt, str(ckpt / "speech_tokenizer" / "config.json"), "file not found")


def test_decoder_quantizers_disagree_with_the_talker(ckpt):
    _edit_json(ckpt / "speech_tokenizer" / "config.json", lambda c: c["decoder_config"].update(num_quantizers=8))
    _expect(ckpt, str(ckpt / "speech_tokenizer" / "config.json"), "num_quantizers 8 != num_code_groups 4")


def test_decoder_codebook_disagrees_with_the_predictor(ckpt):
    _edit_json(ckpt / "speech_tokenizer" / "config.json", lambda c: c["decoder_config"].update(codebook_size=32))
    _expect(ckpt, "codebook_size 32 != code predictor vocab_size 64")


def test_decoder_with_another_frame_size(ckpt):
    _edit_json(ckpt / "speech_tokenizer" / "config.json",
               lambda c: c["decoder_config"].update(upsample_rates=[8, 5, 4, 2]))
    _expect(ckpt, "1280 samples per frame", "needs 1920")


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    _expect(ckpt, str(ckpt), "no model.safetensors")


def test_weights_file_is_not_safetensors(ckpt):
    (ckpt / "speech_tokenizer" / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    _expect(ckpt, str(ckpt / "speech_tokenizer" / "model.safetensors"), "not a readable safetensors file")


def test_index_names_a_missing_shard(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"talker.codec_head.weight": "model-00001-of-00002.safetensors"}}))
    _expect(ckpt, "model.safetensors.index.json", "model-00001-of-00002.safetensors, which does not exist")


def test_missing_predictor_tensor(ckpt):
    _edit_tensors(ckpt / "model.safetensors", lambda t: t.pop("talker.code_predictor.lm_head.1.weight"))
    _expect(ckpt, str(ckpt / "model.safetensors"), "missing tensors under 'talker.code_predictor.'",
            "talker.code_predictor.lm_head.1.weight")


def test_unexpected_predictor_tensor(ckpt):
    """e.g. a checkpoint with more layers than its config says."""
    _edit_tensors(ckpt / "model.safetensors",
                  lambda t: t.update({"talker.code_predictor.model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}))
    _expect(ckpt, str(ckpt / "model.safetensors"), "unexpected tensors",
            "talker.code_predictor.model.layers.9.mlp.up_proj.weight")


def test_missing_codec_head_tensor(ckpt):
    _edit_tensors(ckpt / "model.safetensors", lambda t: t.pop("talker.model.norm.weight"))
    _expect(ckpt, str(ckpt / "model.safetensors"), "missing tensors", "talker.model.norm.weight")


def test_unexpected_codec_head_bias(ckpt):
    _edit_tensors(ckpt / "model.safetensors",
                  lambda t: t.update({"talker.codec_head.bias": torch.zeros(PRESET.codec_head.vocab_size)}))
    _expect(ckpt, str(ckpt / "model.safetensors"), "unexpected tensors", "talker.codec_head.bias")


def test_unexpected_final_norm_bias(ckpt):
    _edit_tensors(ckpt / "model.safetensors",
                  lambda t: t.update({"talker.model.norm.bias": torch.zeros(PRESET.codec_head.hidden_size)}))
    _expect(ckpt, str(ckpt / "model.safetensors"), "unexpected tensors", "talker.model.norm.bias")


def test_shape_mismatch(ckpt):
    _edit_tensors(ckpt / "model.safetensors",
                  lambda t: t.update({"talker.codec_head.weight": torch.zeros(7, PRESET.codec_head.hidden_size)}))
    _expect(ckpt, str(ckpt / "model.safetensors"), "shape mismatch",
            f"talker.codec_head.weight (7, {PRESET.codec_head.hidden_size}) (expected "
            f"({PRESET.codec_head.vocab_size}, {PRESET.codec_head.hidden_size}))")


def test_integer_dtype_is_rejected(ckpt):
    key = "decoder.pre_conv.conv.weight"

    def to_int(t):
        t[key] = t[key].to(torch.int32)

    _edit_tensors(ckpt / "speech_tokenizer" / "model.safetensors", to_int)
    _expect(ckpt, str(ckpt / "speech_tokenizer" / "model.safetensors"), "unsupported dtype", f"{key} torch.int32")


def test_missing_decoder_tensor(ckpt):
    key = "decoder.quantizer.rvq_rest.vq.layers.0._codebook.embedding_sum"
    _edit_tensors(ckpt / "speech_tokenizer" / "model.safetensors", lambda t: t.pop(key))
    _expect(ckpt, str(ckpt / "speech_tokenizer" / "model.safetensors"), "missing tensors under 'decoder.'", key)


# --------------------------------------------------------------------------- the engine on top


def test_engine_builds_from_a_qwen3_tts_directory(tmp_path):
    """`serve/synthesize --checkpoint DIR`: codec side from the directory (its sizes, its
    weights), DiT side random at the preset's sizes and reported as such."""
    from engines.build import build_engine

    root = write_directory(tmp_path / "ckpt")
    engine = build_engine(EngineConfig.for_tests(preset="small", checkpoint=str(root), warmup=False))
    assert engine.info.random_components == ("encoder", "duration", "dit")
    cfg = engine.models.config
    assert cfg.code_predictor == PRESET.code_predictor and cfg.decoder == PRESET.decoder
    assert cfg.latent_dim == PRESET.codec_head.hidden_size and cfg.dit.hidden_size == get_preset("small").dit.hidden_size
    stored = load_file(str(root / "model.safetensors"))["talker.codec_head.weight"]
    assert torch.equal(engine.models.codec_head.codec_head.weight, stored)
