"""Deterministic random initialisation for any module (tests, benchmarks, untrained models).

``init_module_(module, seed)`` gives every parameter a value that keeps activations
at a sensible scale (fan-in scaled weights, norms near 1) and makes outputs depend on
inputs: the official Qwen3-TTS initialisers leave codebooks, SnakeBeta and LayerScale
at zeros/constants, which would make comparisons blind.

A model can set ``init_gain`` on a Linear/Conv to scale its random weights (e.g. the
last conv of a residual branch), keeping deep residual stacks from growing.

Each parameter draws from its own generator seeded by (seed, parameter name), so the
result does not depend on parameter order, on the device, or on other modules.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def _normal(shape, std: float, g: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean


def _uniform(shape, lo: float, hi: float, g: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=g, dtype=torch.float32) * (hi - lo) + lo


def _fan_in(module: nn.Module, weight: torch.Tensor) -> float:
    if isinstance(module, nn.ConvTranspose1d):
        # weight [C_in, C_out/groups, k]: each output sample sums C_in * k / stride terms.
        return weight.shape[0] * weight.shape[2] / module.stride[0]
    if isinstance(module, nn.Conv1d):
        return weight.shape[1] * weight.shape[2]  # [C_out, C_in/groups, k]
    return float(weight.shape[-1]) if weight.dim() >= 2 else 1.0


def _value_for(module: nn.Module, pname: str, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    kind = type(module).__name__
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.ConvTranspose1d)):
        if pname == "weight":
            # ``init_gain`` (optional attribute set by the model) damps residual branches / outputs.
            gain = float(getattr(module, "init_gain", 1.0))
            return _normal(p.shape, gain / math.sqrt(_fan_in(module, p)), g)
        return _normal(p.shape, 0.02, g)  # bias
    if isinstance(module, nn.Embedding):
        return _normal(p.shape, 1.0, g)
    if isinstance(module, nn.LayerNorm) or "Norm" in kind:
        if pname == "weight":
            return _normal(p.shape, 0.05, g, mean=1.0)
        return _normal(p.shape, 0.02, g)
    if pname == "embedding_sum":  # VQ codebook (divided by cluster_usage)
        return _normal(p.shape, 1.0, g)
    if pname == "cluster_usage":
        return _uniform(p.shape, 0.5, 1.5, g)
    if pname in ("alpha", "beta"):  # SnakeBeta, log-parameterised: exp(N(0, 0.2)) ~ 1
        return _normal(p.shape, 0.2, g)
    if pname == "scale":  # LayerScale
        return _uniform(p.shape, 0.02, 0.1, g)
    if pname == "gamma":  # ConvNeXt residual scale
        return _uniform(p.shape, 0.05, 0.2, g)
    if p.dim() >= 2:
        return _normal(p.shape, 1.0 / math.sqrt(p.shape[-1]), g)
    return _normal(p.shape, 0.02, g)


@torch.no_grad()
def init_module_(module: nn.Module, seed: int) -> nn.Module:
    """Re-initialise every parameter of ``module`` in place; returns the module."""
    for mod_name, mod in module.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            value = _value_for(mod, pname, p, _generator(seed, full))
            p.copy_(value.to(device=p.device, dtype=p.dtype))
    return module
