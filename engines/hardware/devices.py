"""Device names normalised once, so comparisons with tensors' devices hold; dtypes by name."""

from __future__ import annotations

import torch


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_named(name: str) -> torch.dtype:
    """``float32`` / ``bfloat16`` -> the torch dtype; ValueError naming the choices."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be {' or '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def canonical_device(device) -> torch.device:
    """``cuda`` -> ``cuda:N`` (the current device): tensors report an index, and
    ``torch.device("cuda") != torch.device("cuda:0")``."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def stage(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor -> the same values on ``device`` without waiting for the device.

    ``tensor.to("cuda")`` from pageable memory synchronises the stream, so every admission
    would drain the queued ticks; staging through page-locked memory and copying
    ``non_blocking`` does not (the caching host allocator keeps the staging block alive
    until the copy has run)."""
    device = canonical_device(device)
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host values (a list) -> a tensor on ``device``, staged as in :func:`stage`."""
    return stage(torch.tensor(values, dtype=dtype), device)
