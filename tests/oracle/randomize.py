"""Fan-in-scaled random weights for the parts streamvox loads and compares.

Why not the models' own init (or N(0, 0.05))? Hugging Face init leaves codebooks at
zero, SnakeBeta at exp(0) = 1, LayerScale at 0.01 and ConvNeXt gamma at 1e-6, and a
small constant std at tiny widths shrinks every activation: the outputs then barely
depend on the inputs and a parity test would pass for a broken implementation.
Here every parameter of the compared modules is drawn so activations keep O(1)
scale: weights N(0, 1/sqrt(fan_in)), norms ~ 1, codebooks N(0, 1), cluster_usage
~ 1, log-space SnakeBeta around 0, LayerScale/gamma O(1). An unknown parameter
kind raises, so nothing silently keeps its init.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _fan_in(module: nn.Module, weight: torch.Tensor) -> float:
    if isinstance(module, nn.ConvTranspose1d):
        # weight [in, out/groups, k]; each output sample sees ~ in * k / stride inputs.
        return weight.shape[0] * weight.shape[2] / module.stride[0]
    return float(weight[0].numel())  # Linear [out, in], Conv1d [out, in/groups, k]


def _draw(module: nn.Module, name: str, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(p.shape, generator=g)

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(p.shape, generator=g)

    kind = type(module).__name__
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.ConvTranspose1d)):
        if name == "weight":
            return normal(1.0 / math.sqrt(_fan_in(module, p)))
        if name == "bias":
            return normal(0.1)
    if isinstance(module, nn.Embedding) and name == "weight":
        return normal(1.0)
    if isinstance(module, nn.LayerNorm) or kind.endswith("RMSNorm"):
        return normal(0.1, mean=1.0) if name == "weight" else normal(0.1)
    if kind == "EuclideanCodebook":
        if name == "embedding_sum":
            return normal(1.0)
        if name == "cluster_usage":
            return uniform(0.5, 2.0)
    if kind == "SnakeBeta" and name in ("alpha", "beta"):
        return normal(0.3)  # used as exp(alpha), exp(beta)
    if kind.endswith("LayerScale") and name == "scale":
        return uniform(0.3, 1.0)
    if kind.endswith("ConvNeXtBlock") and name == "gamma":
        return uniform(0.3, 1.0)
    raise ValueError(f"randomize: no rule for parameter {name!r} of {kind}")


@torch.no_grad()
def randomize_(root: nn.Module, generator: torch.Generator) -> None:
    """Redraw every parameter under ``root`` in place (dtype kept)."""
    for _, module in root.named_modules():
        for name, p in module.named_parameters(recurse=False):
            p.copy_(_draw(module, name, p, generator).to(p.dtype))
