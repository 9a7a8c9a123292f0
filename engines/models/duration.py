"""Duration model: frames per text token, from encoder states.

Each token gets a positive duration ``base_frames_per_token * softplus(k head(h) + b)``
with ``b`` chosen so that a zero head output gives exactly the prior. The gentle slope
``k`` keeps an untrained (random) head within about 0.7x-1.4x of the prior, so the
frame count of an utterance stays near ``base_frames_per_token * tokens / speed``;
a trained head can still reach any positive duration.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engines.models.configs import DurationConfig, TextEncoderConfig
from engines.models.layers import RMSNorm

_SOFTPLUS_ONE = math.log(math.e - 1.0)  # softplus(_SOFTPLUS_ONE) == 1
_HEAD_SLOPE = 0.25


class DurationModel(nn.Module):
    def __init__(self, cfg: DurationConfig, text_cfg: TextEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.proj = nn.Linear(text_cfg.hidden_size, cfg.hidden_size)
        self.norm = RMSNorm(cfg.hidden_size, text_cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, 1)

    def forward(self, enc: torch.Tensor, speech_mask: torch.Tensor) -> torch.Tensor:
        # enc [B, L, C]; speech_mask [B, L] bool (True = a token that is spoken, i.e.
        # not padding / bos / eos) -> durations [B, L] fp32 frames, 0 where masked
        h = self.norm(F.silu(self.proj(enc)))
        raw = self.head(h).squeeze(-1).float()  # [B, L]
        per_token = self.cfg.base_frames_per_token * F.softplus(_HEAD_SLOPE * raw + _SOFTPLUS_ONE)
        return per_token * speech_mask.to(per_token.dtype)

    def frame_counts(self, durations: torch.Tensor, speed: float | torch.Tensor) -> list[int]:
        """Utterance frames per row: round(sum / speed), clamped to [min_frames,
        max_frames_per_clause]; ``speed`` one number or one per row (fp32 tensor on the
        device; the fp32 division is the same either way). Reads the device (admission
        time only)."""
        if not isinstance(speed, torch.Tensor) and not (math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed must be a positive finite number, got {speed}")
        totals = (durations.sum(dim=-1) / speed).tolist()
        lo, hi = self.cfg.min_frames, self.cfg.max_frames_per_clause
        return [min(max(int(round(t)), lo), hi) for t in totals]
