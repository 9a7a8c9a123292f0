"""The modules a pipeline runs on, in one container the engine hands its builder: the codec side
every pipeline shares (codec head, code predictor, decoder) and the DiT's (None where a pipeline
does not use them). Filled by a pipeline's ``load`` (engines/pipelines/registry.py); the DiT's
weights file and random init are engines/pipelines/dit/weights.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engines.models.code_predictor import CodePredictor
from engines.models.codec_decoder import CodecDecoder
from engines.models.codec_head import CodecHead
from engines.models.condition import ConditionEncoder
from engines.models.configs import ModelConfig
from engines.models.dit import FlowDiT
from engines.models.duration import DurationModel

COMPONENTS = ("encoder", "duration", "dit", "codec_head", "code_predictor", "decoder")


@dataclass
class Models:
    """All nn.Modules of a pipeline. Serving the talker only the codec side is used: encoder,
    duration model and DiT are None then (never built)."""

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

    @classmethod
    def codec_only(cls, config: ModelConfig, codec_head=None, code_predictor=None, decoder=None) -> "Models":
        """The codec side alone (``None`` parts: a virtual device's, which runs no model)."""
        return cls(config=config, encoder=None, duration=None, dit=None, codec_head=codec_head,
                   code_predictor=code_predictor, decoder=decoder, random_components=())
