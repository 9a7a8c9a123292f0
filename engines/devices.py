"""Device names normalised once, so comparisons with tensors' devices hold."""

from __future__ import annotations

import torch


def canonical_device(device) -> torch.device:
    """``cuda`` -> ``cuda:N`` (the current device): tensors report an index, and
    ``torch.device("cuda") != torch.device("cuda:0")``."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d
