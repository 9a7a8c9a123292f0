"""Transformer pieces shared by every model in streamvox (parameter names match Qwen3's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: the Qwen3 MLP (``gate_proj/up_proj/down_proj``)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def compile_block_call(fn, backend: str):
    """``torch.compile`` for a function that calls one repeated block (a layer as its first
    argument): one compiled graph serves every block, step and batch size (dynamic shapes;
    sizes 0 and 1 are specialised, so a handful of variants), so the recompile limit is
    raised above what those variants can reach. ``fullgraph``: a graph break is an error."""
    import torch._dynamo

    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    return torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)
