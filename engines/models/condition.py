"""Condition encoder: byte tokens + voice -> encoder states the DiT cross-attends to.

Also home of the small transformer pieces the DiT reuses (RMSNorm, RoPE, SwiGLU,
attention), written gpt-fast style. Shapes: B batch, L tokens, T frames, C / H
widths, h heads, hd head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engines.models.configs import TextEncoderConfig
from engines.models.layers import SwiGLU


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 (bf16 squares lose too much)."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return y * self.weight if self.weight is not None else y


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, hd/2] (fp32) for int positions [B, T] (any values, e.g. global frame ids)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # [B, 1, T, hd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [B, h, T, hd] (computed in fp32, cast back)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def key_padding_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, S] bool (True = real) -> SDPA mask [B, 1, 1, S] (True = may be attended)."""
    return mask[:, None, None, :]


class Attention(nn.Module):
    """Multi-head attention; self-attention when ``kv_dim`` is None, else cross-attention
    from queries [B, T, dim] to a memory [B, S, kv_dim]. RoPE only on self-attention."""

    def __init__(self, dim: int, num_heads: int, kv_dim: int | None = None):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(kv_dim or dim, dim, bias=False)
        self.v_proj = nn.Linear(kv_dim or dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, dim] -> [B, h, S, hd]
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, memory: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # x [B, T, dim]; memory [B, S, kv_dim] or None (= x); mask [B, 1, 1, S] bool
        src = x if memory is None else memory
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(src)), self._heads(self.v_proj(src))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, h, T, hd]
        return self.o_proj(y.transpose(1, 2).flatten(2))


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
        rope = rope_cos_sin(positions, self.layers[0].attn.head_dim if self.layers else 2, self.cfg.rope_theta)
        attn_mask = key_padding_mask(mask)
        for layer in self.layers:
            x = layer(x, attn_mask, rope)
        return self.norm(x)  # [B, L, C]

    def null_states(self, length: int, batch: int = 1) -> torch.Tensor:
        """The learned null embedding expanded (a view, no copy) to [batch, length, C]."""
        if length < 1 or batch < 1:
            raise ValueError(f"null_states needs length >= 1 and batch >= 1, got {length}, {batch}")
        return self.null_embedding.weight[None, :, :].expand(batch, length, -1)
