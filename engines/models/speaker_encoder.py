"""The Base checkpoints' speaker encoder (``speaker_encoder.*``): log-mel frames -> x-vector.

    enc = SpeakerEncoder(SpeakerEncoderConfig.from_dict(config["speaker_encoder_config"]))
    xvec = enc(LogMel()(wav[None]))      # [B, T, 128] -> [B, enc_dim]

ECAPA-TDNN as ``qwen_tts`` builds it (parameter names match the checkpoint): a TDNN, SE-Res2Net
blocks, multi-layer feature aggregation, attentive statistics pooling and a 1x1 conv. Every
conv pads "same" with reflection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engines.models.configs import FromDict


@dataclass(frozen=True)
class SpeakerEncoderConfig(FromDict):
    """``speaker_encoder_config`` of config.json (official keys and defaults)."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24_000

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpeakerEncoderConfig":
        cfg = super().from_dict(data)
        if not len(cfg.enc_channels) == len(cfg.enc_kernel_sizes) == len(cfg.enc_dilations):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        return cfg


def _conv(c_in: int, c_out: int, kernel: int = 1, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(c_in, c_out, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int):
        super().__init__()
        self.conv = _conv(c_in, c_out, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(TDNN(channels // scale, channels // scale, kernel, dilation)
                                    for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: list[torch.Tensor] = []
        for i, part in enumerate(torch.chunk(x, self.scale, dim=1)):
            if i == 1:
                part = self.blocks[0](part)
            elif i > 1:
                part = self.blocks[i - 1](part + out[-1])
            out.append(part)
        return torch.cat(out, dim=1)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = _conv(channels, se_channels)
        self.conv2 = _conv(se_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * s


class SERes2NetBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, scale: int, se_channels: int, kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = TDNN(c_in, c_out, 1, 1)
        self.res2net_block = Res2Net(c_out, scale, kernel, dilation)
        self.tdnn2 = TDNN(c_out, c_out, 1, 1)
        self.se_block = SqueezeExcitation(c_out, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


class AttentiveStatsPooling(nn.Module):
    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TDNN(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels)

    @staticmethod
    def _stats(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (weights * x).sum(2)
        std = torch.sqrt((weights * (x - mean[..., None]).pow(2)).sum(2).clamp(1e-12))
        return mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        # Every frame counts (no padding): the uniform weights 1 / T, as the official mask / total.
        uniform = torch.ones(x.shape[0], 1, t, dtype=x.dtype, device=x.device)
        mean, std = self._stats(x, uniform / uniform.sum(dim=2, keepdim=True))
        context = torch.cat([x, mean[..., None].expand(-1, -1, t), std[..., None].expand(-1, -1, t)], dim=1)
        attention = F.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = self._stats(x, attention)
        return torch.cat([mean, std], dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        self.cfg = cfg
        ch, ks, dil = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        self.blocks = nn.ModuleList([TDNN(cfg.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels,
                                              ks[i], dil[i]))
        self.mfa = TDNN(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatsPooling(ch[-1], cfg.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, cfg.enc_dim)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """mels [B, T, mel_dim] -> x-vectors [B, enc_dim]."""
        x = mels.transpose(1, 2)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(x))[..., 0]


__all__ = ["SpeakerEncoder", "SpeakerEncoderConfig"]
