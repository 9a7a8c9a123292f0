"""The capture recipe every graphed wrapper (predictor, DiT, decoder) follows."""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("streamvox.cuda_graphs")


def capture(fn: Callable[[], torch.Tensor], device: torch.device, stream: "torch.cuda.Stream", pool,
            warmup_iters: int) -> tuple["torch.cuda.CUDAGraph", torch.Tensor]:
    """Run ``fn`` ``warmup_iters`` times on the side ``stream`` (cuBLAS / cuDNN / SDPA
    initialisation, allocator, torch.compile), then capture one call into ``pool``.
    Returns the graph and the output tensor the capture wrote (what each replay rewrites)."""
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for _ in range(warmup_iters):
            fn()
    current.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()
    return graph, out


def capture_or_uncompiled(capture_missing: Callable[[], None], compiled: bool, uncompile: Callable[[], None],
                          what: str) -> None:
    """``capture_missing()``; torch.compile is an optimisation, never a reason not to start:
    if capturing the compiled ``what`` fails, ``uncompile()`` (drop the compiled step and the
    graphs captured so far) and capture the plain modules instead, warned. Without
    compilation a failure propagates."""
    try:
        capture_missing()
    except Exception as exc:
        if not compiled:
            raise
        log.warning("capturing the torch.compile'd %s failed (%s: %s); capturing the plain %s",
                    what, type(exc).__name__, exc, what.split()[-1])
        uncompile()
        capture_missing()
