"""The DiT pipeline's modules and its weights file (``streamvox.safetensors``).

``build_models`` makes every component with deterministic random weights; ``load_models`` reads
them from a checkpoint; ``save_weights`` / ``load_weights`` move them through one safetensors file
whose keys are ``<component>.<param>``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engines.checkpoints.qwen3_tts import load_checkpoint
from engines.models.code_predictor import CodePredictor
from engines.models.codec_decoder import CodecDecoder
from engines.models.codec_head import CodecHead
from engines.models.condition import ConditionEncoder
from engines.models.configs import ModelConfig
from engines.models.dit import FlowDiT
from engines.models.duration import DurationModel
from engines.models.init import init_module_
from engines.pipelines.modules import COMPONENTS, Models

WEIGHTS_FILE = "streamvox.safetensors"

log = logging.getLogger("streamvox.engine")


def build_models(config: ModelConfig, seed: int = 0) -> Models:
    """Every component with random weights, deterministically from ``seed``."""
    modules = {
        "encoder": ConditionEncoder(config.text),
        "duration": DurationModel(config.duration, config.text),
        "dit": FlowDiT(config.dit),
        "codec_head": CodecHead(config.codec_head),
        "code_predictor": CodePredictor(config.code_predictor),
        "decoder": CodecDecoder(config.decoder),
    }
    for i, name in enumerate(COMPONENTS):
        init_module_(modules[name], seed * 1000 + i)
    return Models(config=config, random_components=COMPONENTS, **modules)


def save_weights(models: Models, path: str | Path) -> None:
    """All components into one safetensors file, keys ``<component>.<param>``."""
    from safetensors.torch import save_file

    tensors = {f"{name}.{k}": v.detach().contiguous().cpu()
               for name, module in models.modules().items() for k, v in module.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "pt", "preset": models.config.name})


def load_weights(models: Models, path: str | Path, components: tuple[str, ...] = COMPONENTS) -> tuple[str, ...]:
    """Load ``components`` from a streamvox safetensors file (strict); returns what was loaded."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    loaded = []
    for name in components:
        prefix = f"{name}."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not state:
            continue
        missing, unexpected = getattr(models, name).load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}: component {name!r}: missing tensors {sorted(missing)[:8]}, "
                             f"unexpected tensors {sorted(unexpected)[:8]}")
        loaded.append(name)
    models.random_components = tuple(c for c in models.random_components if c not in loaded)
    return tuple(loaded)


def load_models(path: Path | None, preset_config: ModelConfig, seed: int) -> Models:
    """The DiT pipeline's modules: from a streamvox weights file, or a Qwen3-TTS directory (codec
    side real, DiT random unless the directory holds a streamvox weights file); random weights of
    ``preset_config`` when ``path`` is None (``streamvox export`` loads them here too)."""
    if path is None:
        return build_models(preset_config, seed)
    if path.is_file():
        models = build_models(preset_config, seed)
        load_weights(models, path)
        return models
    weights = path / WEIGHTS_FILE
    if (path / "config.json").exists():
        parts = load_checkpoint(path)
        models = build_models(parts.model_config(preset_config), seed)
        models.codec_head = parts.head
        models.code_predictor = parts.predictor
        models.decoder = parts.decoder
        models.random_components = ("encoder", "duration", "dit")
        if weights.exists():
            load_weights(models, weights, components=("encoder", "duration", "dit"))
        else:
            log.warning("%s has no %s: the DiT and condition encoder run on RANDOM weights "
                        "(no trained DiT exists); the audio will not be speech", path, WEIGHTS_FILE)
        return models
    if weights.exists():
        models = build_models(preset_config, seed)
        load_weights(models, weights)
        return models
    raise FileNotFoundError(f"{path}: neither a Qwen3-TTS checkpoint directory (config.json) nor {WEIGHTS_FILE}")
