"""The code predictor behind static, batch-bucketed buffers; one CUDA graph per bucket and mode.

``GraphedCodePredictor(predictor)`` has CodePredictor's call,
``predict(h, code0_emb, sampling) -> codes [B, G-1]``. Per batch bucket (1, 2, 4, ..., 512
by default) it owns STATIC inputs (``h``, ``code0_emb`` and every ``FrameSampling``
tensor) whose addresses never change. A call copies its rows into the smallest bucket
that fits (padding rows: zeros, greedy; their outputs are ignored), runs the bucket and
returns a copy of the first B rows; a batch larger than the largest bucket is split into
pieces of the largest bucket plus one smaller piece for the rest.

On CUDA each (bucket, mode) is captured once as a ``torch.cuda.CUDAGraph`` - the whole
frame, prefill plus every decode step over the predictor's static KV cache, sampling
included - and a call is: copy inputs, ``replay()``, copy out. No host sync, no
allocation other than the returned copy. On CPU exactly the same static-buffer path
runs eagerly; that is what the CPU tests check against plain ``predictor.predict``.

Modes. ``FrameSampling.all_greedy`` and ``any_top_p`` are host flags that change which
ops ``predict`` issues, so a graph is captured per (bucket, mode) with mode one of
``greedy`` (all rows greedy: argmax only), ``sampled`` (top-k + Gumbel; greedy rows
through the per-row ``greedy`` mask) and ``top_p`` (sampled plus the top-p filter).
One general top-p graph per bucket would need fewer captures, but (a) it would make
every greedy batch - the engine default - pay a vocab sort and a [B, V] hash per step,
and (b) the top-p filter with p = 1 is not a no-op in fp32 (the running mass can reach
1.0 before the tail, dropping tail tokens), so its codes could differ from eager
``predict``. All graphs share one memory pool (``torch.cuda.graph_pool_handle()``);
they only ever run one at a time on one stream, so the pool costs about one graph's
scratch, and each graph's output stays referenced here, never reused by another.

Capture safety of ``CodePredictor.predict`` (checked; tests/engines/runtime/test_graphed_predictor.py
runs it under a mode that rejects host reads and host->device tensor creation): control
flow depends only on shapes and host flags; positions, RoPE and masks come from
``torch.arange`` (device kernels); sampling is on the device and the counter-hash takes
its constant keys as scalars (``engines.models.sampling.hash_keys``); the KV cache is
allocated once for the largest bucket before any capture (``ensure_cache``) and a
capture never allocates it. If something else later makes the predictor reallocate its
cache (an eager call with more rows than the largest bucket), the graphs would point at
the old one: every call checks that and recaptures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.models.code_predictor import CodePredictor
from engines.models.sampling import FrameSampling
from engines.runtime.cuda_graphs import BucketedGraphs, GraphedWrapper, resolve_use_graphs, smallest_bucket

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MODES = ("greedy", "sampled", "top_p")
WARMUP_ITERS = 3  # eager runs on a side stream before each capture (cuBLAS/cuDNN/SDPA init, allocator)


def sampling_mode(sampling: FrameSampling) -> str:
    """Which graph a batch needs, from its host flags only (never from tensor values)."""
    if sampling.all_greedy:
        return "greedy"
    return "top_p" if sampling.any_top_p else "sampled"


@dataclass
class _Bucket:
    """Static inputs for ``rows`` frames; the addresses are fixed for the wrapper's life."""

    rows: int
    h: torch.Tensor  # [rows, D_talker]
    code0_emb: torch.Tensor  # [rows, D_talker]
    seed_lo: torch.Tensor
    seed_hi: torch.Tensor
    frame: torch.Tensor
    greedy: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    TENSORS = ("h", "code0_emb", "seed_lo", "seed_hi", "frame", "greedy", "temperature", "top_k", "top_p")
    # Padding rows: zero inputs, greedy, neutral sampling settings.
    PAD = {"h": 0.0, "code0_emb": 0.0, "seed_lo": 0, "seed_hi": 0, "frame": 0, "greedy": True,
           "temperature": 1.0, "top_k": 0, "top_p": 1.0}

    @staticmethod
    def allocate(rows: int, width: int, device: torch.device, dtype: torch.dtype) -> "_Bucket":
        def full(value, dt, *shape):
            return torch.full((rows, *shape), value, dtype=dt, device=device)

        return _Bucket(rows, full(0.0, dtype, width), full(0.0, dtype, width), full(0, torch.int64),
                       full(0, torch.int64), full(0, torch.int64), full(True, torch.bool),
                       full(1.0, torch.float32), full(0, torch.int64), full(1.0, torch.float32))

    def sampling(self, mode: str) -> FrameSampling:
        """A FrameSampling over the whole static bucket (the graph reads these tensors)."""
        return FrameSampling(self.seed_lo, self.seed_hi, self.frame, self.greedy, self.temperature, self.top_k,
                             self.top_p, all_greedy=mode == "greedy", any_top_p=mode == "top_p")

    def load(self, h: torch.Tensor, code0_emb: torch.Tensor, sampling: FrameSampling) -> None:
        """Copy a piece's rows in (device-to-device, no sync); reset the padding rows."""
        b = h.shape[0]
        for name in self.TENSORS:
            dst = getattr(self, name)
            src = h if name == "h" else code0_emb if name == "code0_emb" else getattr(sampling, name)
            dst[:b].copy_(src)
            if b < self.rows:
                dst[b:].fill_(self.PAD[name])

    def pointers(self) -> dict[str, int]:
        return {name: getattr(self, name).data_ptr() for name in self.TENSORS}


class GraphedCodePredictor(GraphedWrapper):
    """``predict`` over static per-bucket buffers; CUDA graphs on CUDA, the same path eagerly on CPU.

    Attributes it does not define (``cfg``, ``naive_predict``, ``parameters``, ...) are the
    wrapped predictor's, so it drops in wherever the vocalizer uses its predictor.
    """

    def __init__(self, predictor: CodePredictor, buckets=DEFAULT_BUCKETS, use_graphs: bool | None = None,
                 warmup_iters: int = WARMUP_ITERS, compile_backend: str | None = None):
        """``compile_backend`` ("inductor" on CUDA in the engine): run the predictor's layers
        through ``torch.compile`` before capture (``CodePredictor.compile_layers``); the
        warm-up iterations before each capture compile every shape, so nothing compiles
        inside a capture."""
        buckets = tuple(sorted({int(b) for b in buckets}))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        param = next(predictor.parameters())
        self.predictor = predictor
        self.device, self.dtype = param.device, param.dtype
        self.buckets = buckets
        self.max_rows = buckets[-1]
        use_graphs = resolve_use_graphs(use_graphs, self.device, "predictor")
        if compile_backend:
            predictor.compile_layers(backend=compile_backend)
        width = predictor.cfg.talker_hidden_size
        self._buckets = {b: _Bucket.allocate(b, width, self.device, self.dtype) for b in buckets}
        # One graph per (bucket, mode), all in one pool; the KV cache is checked around each capture.
        self.graphs = BucketedGraphs(self._step, self.device, use_graphs, warmup_iters,
                                     before_capture=self._before_capture, after_capture=self._after_capture,
                                     name="code predictor")
        self._cache = None
        self._bind_cache()

    # ------------------------------------------------------------------ public API

    def __getattr__(self, name):  # only called for names not found on the wrapper
        if name == "predictor":  # not set yet (during __init__ errors): avoid recursion
            raise AttributeError(name)
        return getattr(self.predictor, name)

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket holding ``rows`` (1 <= rows <= max_rows)."""
        bucket = smallest_bucket(self.buckets, rows)
        if bucket is None:
            raise ValueError(f"{rows} rows exceed the largest bucket {self.max_rows}")
        return bucket

    def static_pointers(self) -> dict[int, dict[str, int]]:
        """data_ptr of every static input, per bucket (they must never change)."""
        return {b: buf.pointers() for b, buf in self._buckets.items()}

    @torch.no_grad()
    def capture_all(self, modes=MODES) -> None:
        """Capture every (bucket, mode) graph now (engine warm-up, before /readyz). CPU: no-op."""
        if not self.use_graphs:
            return
        self._bind_cache()
        self.graphs.capture_all([(b, mode) for b in self.buckets for mode in modes],
                                self.predictor.layer_step is not None, self._uncompile, "predictor layers")

    def _uncompile(self) -> None:
        self.predictor.layer_step = None
        self._bind_cache()  # drops the graphs captured so far

    @torch.no_grad()
    def predict(self, h: torch.Tensor, code0_emb: torch.Tensor, sampling: FrameSampling,
                return_logits: bool = False) -> torch.Tensor:
        """h, code0_emb [B, D_talker]; sampling with B rows -> codes [B, G-1] int64 (a fresh tensor)."""
        if return_logits:
            raise ValueError("GraphedCodePredictor.predict does not return logits; call the wrapped "
                             "predictor's predict(..., return_logits=True)")
        d = self.predictor.cfg.talker_hidden_size
        if h.shape != code0_emb.shape or h.dim() != 2 or h.shape[1] != d:
            raise ValueError(f"expected h and code0_emb [B, {d}], got {tuple(h.shape)} and {tuple(code0_emb.shape)}")
        n = h.shape[0]
        if len(sampling) != n:
            raise ValueError(f"sampling has {len(sampling)} rows for a batch of {n}")
        if n == 0:
            return torch.empty(0, self.predictor.cfg.num_code_groups - 1, dtype=torch.int64, device=self.device)
        if self.predictor.kv_cache is not self._cache:  # someone reallocated it: graphs are stale
            self._bind_cache()
        mode = sampling_mode(sampling)
        pieces = []
        for start in range(0, n, self.max_rows):
            sl = slice(start, min(n, start + self.max_rows))
            pieces.append(self._run_piece(h[sl], code0_emb[sl], sampling.rows(sl), mode))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    # ------------------------------------------------------------------ internals

    def _bind_cache(self) -> None:
        """Allocate the predictor's static KV cache for the largest bucket (before any capture);
        drop graphs captured against a previous cache."""
        self.graphs.drop()
        self._cache = self.predictor.ensure_cache(self.max_rows, self.device, self.dtype)

    def _eager(self, buf: _Bucket, mode: str) -> torch.Tensor:
        return self.predictor.predict(buf.h, buf.code0_emb, buf.sampling(mode))

    def _step(self, key: tuple[int, str]) -> torch.Tensor:
        """The whole frame of bucket ``key`` = (rows, mode) over its static inputs (what a graph captures)."""
        bucket, mode = key
        return self._eager(self._buckets[bucket], mode)

    def _run_piece(self, h, code0_emb, sampling: FrameSampling, mode: str) -> torch.Tensor:
        b = h.shape[0]
        bucket = self.bucket_for(b)
        self._buckets[bucket].load(h, code0_emb, sampling)
        out = self.graphs.run((bucket, mode))  # a capture reads the static inputs, never writes them
        return out[:b].clone()  # the static output is overwritten by the next call

    def _before_capture(self, key) -> None:
        if self.predictor.kv_cache is not self._cache:
            self._bind_cache()

    def _after_capture(self, key) -> None:
        if self.predictor.kv_cache is not self._cache:
            raise RuntimeError("the code predictor reallocated its KV cache during capture")
