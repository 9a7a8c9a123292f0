"""Condition encoder: byte tokens + voice -> encoder states the DiT cross-attends to.

Shapes: B batch, L tokens, T frames, C / H widths, h heads, hd head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engines.models.configs import TextEncoderConfig
from engines.models.layers import (
    Attention,
    RMSNorm,
    SwiGLU,
    fp32_rope,
    key_padding_mask,
)


class EncoderBlock(nn.Module):
    """Pre-norm bidirectional transformer block."""

    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg.hidden_size, cfg.num_attention_heads)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, mask, rope):
        x = x + self.attn(self.attn_norm(x), mask, rope=rope)
        return x + self.mlp(self.mlp_norm(x))


class ConditionEncoder(nn.Module):
    """Token + voice embeddings -> bidirectional transformer -> encoder states [B, L, C]."""

    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_voice = nn.Embedding(cfg.num_voices, cfg.hidden_size)
        # Unconditional ("no text") states for classifier-free guidance.
        self.null_embedding = nn.Embedding(1, cfg.hidden_size)
        self.layers = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, token_ids: torch.Tensor, voice: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # token_ids [B, L] int64, voice [B] int64, mask [B, L] bool (True = real token)
        B, L = token_ids.shape
        x = self.embed_tokens(token_ids) + self.embed_voice(voice)[:, None, :]  # [B, L, C]
        x = x / math.sqrt(2.0)  # sum of two unit-variance embeddings back to unit scale
        positions = torch.arange(L, device=token_ids.device).expand(B, L)
        rope = fp32_rope(positions, self.layers[0].attn.head_dim if self.layers else 2, self.cfg.rope_theta)
        attn_mask = key_padding_mask(mask)
        for layer in self.layers:
            x = layer(x, attn_mask, rope)
        return self.norm(x)  # [B, L, C]

    def null_states(self, length: int, batch: int = 1) -> torch.Tensor:
        """The learned null embedding expanded (a view, no copy) to [batch, length, C]."""
        if length < 1 or batch < 1:
            raise ValueError(f"null_states needs length >= 1 and batch >= 1, got {length}, {batch}")
        return self.null_embedding.weight[None, :, :].expand(batch, length, -1)
