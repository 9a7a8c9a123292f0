"""The DiT pipeline's modules and its weights file (``streamvox.safetensors``).

``build_models`` makes every component with deterministic random weights;
``save_weights`` / ``load_weights`` move them through one safetensors file whose keys are
``<component>.<param>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engines.models.code_predictor import CodePredictor
from engines.models.codec_decoder import CodecDecoder
from engines.models.codec_head import CodecHead
from engines.models.condition import ConditionEncoder
from engines.models.configs import ModelConfig
from engines.models.dit import FlowDiT
from engines.models.duration import DurationModel
from engines.models.init import init_module_

COMPONENTS = ("encoder", "duration", "dit", "codec_head", "code_predictor", "decoder")

WEIGHTS_FILE = "streamvox.safetensors"


@dataclass
class Models:
    """All nn.Modules of the DiT source pipeline. Serving the talker only the decoder is
    used: encoder, duration model and DiT are None then (never built)."""

    config: ModelConfig
    encoder: ConditionEncoder | None
    duration: DurationModel | None
    dit: FlowDiT | None
    codec_head: CodecHead
    code_predictor: CodePredictor
    decoder: CodecDecoder
    random_components: tuple[str, ...]

    def modules(self) -> dict[str, nn.Module]:
        return {name: getattr(self, name) for name in COMPONENTS}

    def to(self, device: torch.device, dtype: torch.dtype) -> "Models":
        for module in self.modules().values():
            if module is not None:
                module.to(device=device, dtype=dtype).eval()
        return self


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
