"""Qwen3-ForcedAligner checkpoints (the ``Qwen/Qwen3-ForcedAligner-0.6B`` layout).

    parts = load_aligner("Qwen/Qwen3-ForcedAligner-0.6B")       # or a local directory
    parts.model, parts.tokenizer, parts.config, parts.languages

A directory holds ``config.json`` (``qwen3_asr`` with a ``thinker_config`` whose
``classify_num`` sizes the timestamp classifier; ``timestamp_token_id`` and
``timestamp_segment_time`` at the top level), ``model.safetensors`` (tensors under
``thinker.``), the Qwen2 text tokenizer files and optionally ``preprocessor_config.json``
(a Whisper feature extractor: checked against what streamvox computes when present).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from engines.checkpoints.files import CheckpointError, SafetensorsFiles, load_into, read_json, require
from engines.checkpoints.qwen3_text import QwenTextTokenizer
from engines.models.forced_aligner import (
    AudioEncoderConfig,
    ForcedAligner,
    ForcedAlignerConfig,
    TextDecoderConfig,
)

# What a model id must provide to be loaded as an aligner (engines/checkpoints/hub.py).
REQUIRED_FILES = ("config.json", "vocab.json")
RELEASE = "a Qwen3-ForcedAligner release"
RELEASE_HINT = "Qwen/Qwen3-ForcedAligner-0.6B is"
# The Whisper features streamvox computes (engines/models/mel.py WhisperLogMel).
FEATURES = {"sampling_rate": 16_000, "n_fft": 400, "hop_length": 160}


@dataclass(frozen=True)
class AlignerParts:
    model: ForcedAligner
    tokenizer: QwenTextTokenizer
    config: ForcedAlignerConfig
    languages: tuple[str, ...]  # config.json support_languages (lower-case); empty: not declared
    path: Path


def read_config(config: Mapping[str, Any], where: str = "config.json") -> ForcedAlignerConfig:
    thinker = require(config, "thinker_config", dict, where)
    tw = f"{where} [thinker_config]"
    audio = require(thinker, "audio_config", dict, tw)
    text = dict(require(thinker, "text_config", dict, tw))
    classify_num = require(thinker, "classify_num", int, tw)  # absent: an ASR model, not the aligner
    for key in ("num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim"):
        require(audio, key, int, f"{tw} [audio_config]")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        require(text, key, int, f"{tw} [text_config]")
    text["head_dim"] = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    text["num_key_value_heads"] = text.get("num_key_value_heads") or text["num_attention_heads"]
    rope = text.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"{tw} [text_config]: rope type {rope.get('rope_type')!r} is not supported")
    return ForcedAlignerConfig(
        audio=AudioEncoderConfig.from_dict(audio),
        text=TextDecoderConfig.from_dict(text),
        classify_num=classify_num,
        audio_token_id=int(thinker.get("audio_token_id", 151646)),
        timestamp_token_id=require(config, "timestamp_token_id", int, where),
        timestamp_segment_time=float(require(config, "timestamp_segment_time", (int, float), where)),
    )


def _check_features(directory: Path, cfg: ForcedAlignerConfig) -> None:
    path = directory / "preprocessor_config.json"
    if not path.is_file():
        return
    pre = read_json(path)
    want = {**FEATURES, "feature_size": cfg.audio.num_mel_bins}
    wrong = {k: pre[k] for k, v in want.items() if k in pre and pre[k] != v}
    if wrong:
        raise CheckpointError(f"{path}: feature settings {wrong} differ from the Whisper features streamvox "
                              f"computes ({want})")


def load_aligner(name: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> AlignerParts:
    """An official-layout directory, or a Hugging Face model id resolved through the cache."""
    from engines.checkpoints.hub import resolve_model

    directory = Path(name) if isinstance(name, Path) else resolve_model(
        name, required=REQUIRED_FILES, release=RELEASE, hint=RELEASE_HINT)
    config_file = directory / "config.json"
    raw = read_json(config_file)
    cfg = read_config(raw, str(config_file))
    _check_features(directory, cfg)
    tokenizer = QwenTextTokenizer.from_dir(directory)
    for token in ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>", "<timestamp>"):
        if tokenizer.token_to_id(token) is None:
            raise CheckpointError(f"{directory}: the tokenizer has no {token} token")
    if tokenizer.token_to_id("<|audio_pad|>") != cfg.audio_token_id:
        raise CheckpointError(f"{config_file}: audio_token_id {cfg.audio_token_id} is not the tokenizer's "
                              f"<|audio_pad|> ({tokenizer.token_to_id('<|audio_pad|>')})")
    if tokenizer.token_to_id("<timestamp>") != cfg.timestamp_token_id:
        raise CheckpointError(f"{config_file}: timestamp_token_id {cfg.timestamp_token_id} is not the "
                              f"tokenizer's <timestamp> ({tokenizer.token_to_id('<timestamp>')})")
    with torch.device("meta"):
        model = ForcedAligner(cfg)
    model = model.to_empty(device=device)
    load_into(model, SafetensorsFiles(directory), "thinker.", device=device, dtype=dtype)
    _rebuild_buffers(model, device)  # rotary frequencies and sinusoids are not in the file
    languages = tuple(str(x).lower() for x in (raw.get("support_languages") or []))
    return AlignerParts(model.eval(), tokenizer, cfg, languages, directory)


def _rebuild_buffers(model: ForcedAligner, device) -> None:
    from engines.models.forced_aligner import sinusoids
    from engines.models.layers import rope_inv_freq

    a, t = model.cfg.audio, model.cfg.text
    model.audio_tower.positional_embedding = sinusoids(a.max_source_positions, a.d_model).to(device)
    model.model.inv_freq = rope_inv_freq(t.head_dim, t.rope_theta).to(device)


__all__ = ["AlignerParts", "REQUIRED_FILES", "load_aligner", "read_config"]
