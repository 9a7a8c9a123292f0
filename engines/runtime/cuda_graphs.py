"""CUDA graphs over static buckets: the capture recipe and the per-wrapper graph cache.

Every graphed wrapper (code predictor, DiT, codec decoder, talker step) owns static input
buffers per bucket and says how inputs are copied in and outputs read out; what they share
lives here: ``capture()`` (warm up on a side stream, capture into a pool), the compile
fallback, and :class:`BucketedGraphs`, the cache of one graph per bucket key.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Hashable, Iterable

import torch

log = logging.getLogger("streamvox.cuda_graphs")


def capture(fn: Callable[[], Any], device: torch.device, stream: "torch.cuda.Stream", pool,
            warmup_iters: int) -> tuple["torch.cuda.CUDAGraph", Any]:
    """Run ``fn`` ``warmup_iters`` times on the side ``stream`` (cuBLAS / cuDNN / SDPA
    initialisation, allocator, torch.compile), then capture one call into ``pool``.
    Returns the graph and the output the capture wrote (what each replay rewrites)."""
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


def smallest_bucket(buckets: Iterable[int], size: int) -> int | None:
    """The smallest of the (sorted) ``buckets`` that holds ``size``; None when none does."""
    return next((b for b in buckets if b >= size), None)


def resolve_use_graphs(use_graphs: bool | None, device: torch.device, what: str) -> bool:
    """None: graphs on CUDA, the same static path eagerly elsewhere; True off CUDA is an error."""
    if use_graphs is None:
        return device.type == "cuda"
    if use_graphs and device.type != "cuda":
        raise ValueError(f"CUDA graphs need the {what} on a CUDA device, it is on {device}")
    return use_graphs


Key = Hashable


class BucketedGraphs:
    """One CUDA graph per bucket key, captured on first use; on CPU the same step runs eagerly.

    ``step(key)`` runs the wrapper's computation for ``key`` over its static input buffers
    and returns a tensor or a tuple of tensors. With graphs, ``run(key)`` captures it the
    first time (``before_capture(key)`` then ``capture()``, then ``after_capture(key)``, all
    graphs in ONE memory pool on one side stream: they run one at a time, so the pool costs
    about one graph's scratch) and replays it; without, it runs ``step(key)`` eagerly and
    copies the result into a static output per key. Either way the caller gets the key's
    static output, rewritten by the next call of that key (or, with graphs, of any key that
    shares the pool's scratch): copy what must outlive it.

    ``version()`` (optional): changes when a buffer the graphs read was reallocated; every
    graph is dropped then and recaptured on use. ``captures`` counts captures;
    ``late_captures`` those after ``capture_all`` (engine start): each one stalls every stream
    while it runs, so serving should never cause one. Without graphs the same bookkeeping runs
    over the keys a capture would have taken, so a CPU test sees what a GPU would capture late.
    """

    def __init__(self, step: Callable[[Key], Any], device: torch.device, use_graphs: bool, warmup_iters: int,
                 before_capture: Callable[[Key], None] | None = None,
                 after_capture: Callable[[Key], None] | None = None,
                 version: Callable[[], Hashable] | None = None, name: str = "step"):
        self.step = step
        self.device = device
        self.use_graphs = use_graphs
        self.warmup_iters = warmup_iters
        self.before_capture, self.after_capture = before_capture, after_capture
        self.version = version
        self.name = name  # what the log calls these graphs
        self._version = version() if version is not None else None
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.stream = torch.cuda.Stream(device) if use_graphs else None
        self.graphs: dict[Key, "torch.cuda.CUDAGraph"] = {}
        self.serving = False  # set by capture_all: a capture after it stalls every stream, and is logged
        # Static outputs per key: with graphs the output a captured graph writes; without, a
        # buffer the eager result is copied into (same contract: valid until the next call).
        self.outputs: dict[Key, Any] = {}
        self.captures = 0
        self.late_captures = 0
        self._seen: set[Key] = set()  # without graphs: the keys a capture would have taken

    @property
    def captured(self) -> tuple[Key, ...]:
        """The keys that have a CUDA graph, sorted."""
        return tuple(sorted(self.graphs))

    def drop(self) -> None:
        """Forget every graph and static output (a buffer they read moved, or the step changed)."""
        self.graphs.clear()
        self.outputs.clear()
        self._seen.clear()

    def ensure(self, key: Key) -> None:
        """Drop every graph if the buffers moved; capture ``key`` if it has no graph (without
        graphs: note the key, counting a late capture where a GPU would have captured one)."""
        if self.version is not None and self._version != self.version():
            self.drop()
            self._version = self.version()
        if not self.use_graphs:
            if key not in self._seen:
                self._seen.add(key)
                self.late_captures += self.serving
            return
        if key not in self.graphs:
            self.capture(key)

    def capture(self, key: Key) -> None:
        """Warm up on the side stream, then capture ``step(key)`` into the shared pool."""
        started = time.perf_counter()
        if self.before_capture is not None:
            self.before_capture(key)
        with torch.no_grad():
            graph, out = capture(lambda: self.step(key), self.device, self.stream, self.pool, self.warmup_iters)
        if self.serving:
            self.late_captures += 1
            log.warning("captured the %s graph %s after start, on first use, in %.0f ms (every stream "
                        "waited for it)", self.name, key, (time.perf_counter() - started) * 1e3)
        if self.after_capture is not None:
            self.after_capture(key)
        self.graphs[key] = graph
        self.outputs[key] = out
        self.captures += 1

    def run(self, key: Key) -> Any:
        """The key's static output after one step: a graph replay, or the eager step copied in."""
        self.ensure(key)
        if self.use_graphs:
            self.graphs[key].replay()
            return self.outputs[key]
        result = self.step(key)
        static = self.outputs.get(key)
        if isinstance(result, tuple):
            if static is None:
                static = self.outputs[key] = tuple(torch.empty_like(t) for t in result)
            for dst, src in zip(static, result):
                dst.copy_(src)
        else:
            if static is None:
                static = self.outputs[key] = torch.empty_like(result)
            static.copy_(result)
        return static

    def capture_all(self, keys: Iterable[Key], compiled: bool = False, uncompile: Callable[[], None] | None = None,
                    what: str = "layers") -> None:
        """Capture every key in ``keys`` that has no graph (engine start); without graphs, note them.
        ``compiled``: the step runs torch.compile'd code; if capturing it fails, ``uncompile()``,
        drop what was captured and capture the plain step (warned, see ``capture_or_uncompiled``)."""
        keys = list(keys)
        if not self.use_graphs:
            for key in keys:
                self.ensure(key)
            self.serving = True
            return

        def capture_missing() -> None:
            for key in keys:
                self.ensure(key)

        def back_to_plain() -> None:
            if uncompile is not None:
                uncompile()
            self.drop()

        capture_or_uncompiled(capture_missing, compiled, back_to_plain, what)
        self.serving = True


class GraphedWrapper:
    """What every graphed wrapper answers from its ``graphs`` (a :class:`BucketedGraphs`)."""

    graphs: BucketedGraphs

    @property
    def use_graphs(self) -> bool:
        """Whether calls replay CUDA graphs (else the same static path runs eagerly)."""
        return self.graphs.use_graphs

    @property
    def captured(self) -> tuple:
        """The bucket keys that have a CUDA graph, sorted."""
        return self.graphs.captured

    @property
    def late_captures(self) -> int:
        """Captures after engine start (each stalled every stream); see :class:`BucketedGraphs`."""
        return self.graphs.late_captures
