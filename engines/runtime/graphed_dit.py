"""The DiT forward behind static (rows, encoder-length) buckets; one CUDA graph per bucket.

``GraphedDiT(dit, max_rows, frames, enc_buckets)`` calls like FlowDiT,
``dit(x [R, T, D], positions [R, T], context_mask, frame_mask, t [R], enc [R, L, C],
enc_mask [R, L]) -> v [R, T, D]``, and exposes ``.cfg``, so the Denoiser uses it
unchanged. The padded shape is fixed per bucket:

* frames: ONE padded length ``frames`` (context + the largest chunk the preset plans,
  see :func:`max_chunk_frames`); every call pads T up to it;
* rows: ``row_buckets`` (1, 2, 4, ... up to ``max_rows``, ``max_rows`` included);
* encoder length: ``enc_buckets`` (at most 4, e.g. (32, 64, 128, 202) for the default
  text config, see :func:`default_enc_buckets`).

Static buffers. Inputs are allocated once for ``max_rows`` rows; x / positions / masks / t
are shared by all buckets (a bucket of r rows uses the first r rows, a contiguous view)
and each encoder-length bucket owns ``enc`` [max_rows, Le, C] / ``enc_mask``. Their
``data_ptr``s never change. A call copies its inputs into the smallest (rows, Le)
bucket that holds them and resets the padding:

* real rows, frames >= T: x 0, positions 0, context False, frame_mask False;
* real rows, encoder positions >= L: enc 0, enc_mask False;
* padding rows (R <= r < bucket): all of the above, t 0, EXCEPT frame_mask[r, 0] and
  enc_mask[r, 0] are True. A row whose keys are all masked makes SDPA's softmax run
  over only -inf, which is NaN; one unmasked (zero) key per padding row keeps every
  value finite. Padding rows' outputs are never returned.

FlowDiT masks padded frames (as self-attention keys) and padded encoder positions, and
rows never mix, so the first R rows and T frames of the bucket output equal the
unpadded forward up to GEMM summation order (~1e-6 in fp32; tests/engines/runtime/test_graphed_dit.py).

Output: a VIEW ``out[:R, :T]`` of the bucket's static output tensor, valid until the
next call of this wrapper (the next call overwrites it). The Denoiser's fused
path consumes it within the tick, and its two-pass path copies the first output out
before the second forward (ARCHITECTURE.md, tick-loop rule 1). Copy it if you keep it.

CUDA: each (rows, Le) bucket is captured once as a ``torch.cuda.CUDAGraph`` over its
static inputs, all graphs in one memory pool (``torch.cuda.graph_pool_handle()``); they
run one at a time on one stream, so the pool costs about one graph's activations, and
each graph's output stays referenced here, never reused by another. A call is: copies
and fills into the static inputs (device-to-device, no host sync), ``replay()``, return
the view. CPU: exactly the same static path runs the module eagerly and copies its
result into a static output (same aliasing contract), which is what the CPU tests
compare against the plain module.

Inputs larger than every bucket (more rows, more frames or a longer encoder) run the
plain module eagerly - never wrong, just not graphed - with a one-time warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engines.runtime.cuda_graphs import BucketedGraphs, GraphedWrapper, resolve_use_graphs, smallest_bucket

log = logging.getLogger("streamvox.graphed_dit")

WARMUP_ITERS = 3  # eager runs on a side stream before each capture (cuBLAS/SDPA init, allocator)
MAX_ENC_BUCKETS = 4
BASE_ENC_BUCKETS = (32, 64, 128, 256)


def max_chunk_frames(stream_cfg) -> int:
    """The most noisy frames one chunk can have under ``stream_cfg``.

    ``planner.chunk_layout`` cuts a clause into a first chunk (``first_chunk_frames`` for
    the first clause, ``chunk_frames`` after) then ``chunk_frames`` chunks, and a last
    chunk shorter than ``first_chunk_frames`` joins the one before it."""
    return max(stream_cfg.first_chunk_frames, stream_cfg.chunk_frames) + stream_cfg.first_chunk_frames - 1


def max_encoder_tokens(text_cfg) -> int:
    """The longest encoder-state sequence the planner makes: a clause's tokens plus bos/eos."""
    return min(text_cfg.max_clause_tokens, text_cfg.max_text_tokens - 2) + 2


def default_enc_buckets(max_tokens: int) -> tuple[int, ...]:
    """At most 4 encoder-length buckets ending at ``max_tokens``: the (32, 64, 128, 256)
    below it (the largest three) plus ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    below = [b for b in BASE_ENC_BUCKETS if b < max_tokens]
    return tuple(below[-(MAX_ENC_BUCKETS - 1):]) + (max_tokens,)


def default_row_buckets(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``max_rows``, and ``max_rows``."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return tuple(out) + (max_rows,)


@dataclass
class _Inputs:
    """Static inputs for ``rows`` rows x ``frames`` frames (views of the shared buffers)."""

    x: torch.Tensor  # [rows, F, D] model dtype
    positions: torch.Tensor  # [rows, F] int64
    context_mask: torch.Tensor  # [rows, F] bool
    frame_mask: torch.Tensor  # [rows, F] bool
    t: torch.Tensor  # [rows] fp32
    enc: torch.Tensor  # [rows, Le, C] model dtype
    enc_mask: torch.Tensor  # [rows, Le] bool

    NAMES = ("x", "positions", "context_mask", "frame_mask", "t", "enc", "enc_mask")

    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, n) for n in self.NAMES)


class GraphedDiT(GraphedWrapper):
    """FlowDiT's call over static (rows, encoder-length) buckets; CUDA graphs on CUDA, the same path eagerly on CPU.

    Attributes it does not define (``cfg``, ``parameters``, ...) are the wrapped module's.
    """

    def __init__(self, dit, max_rows: int, frames: int, enc_buckets: tuple[int, ...],
                 row_buckets: tuple[int, ...] | None = None, use_graphs: bool | None = None,
                 warmup_iters: int = WARMUP_ITERS, compile_backend: str | None = None):
        """``compile_backend`` ("inductor" on CUDA in the engine): run the DiT blocks through
        ``torch.compile`` first (``FlowDiT.compile_blocks``); each capture's warm-up runs
        compile its shapes, so nothing compiles inside a capture."""
        if max_rows < 1 or frames < 1:
            raise ValueError(f"max_rows and frames must be >= 1, got {max_rows}, {frames}")
        enc_buckets = tuple(sorted({int(b) for b in enc_buckets}))
        if not enc_buckets or enc_buckets[0] < 1 or len(enc_buckets) > MAX_ENC_BUCKETS:
            raise ValueError(f"need 1 to {MAX_ENC_BUCKETS} positive encoder-length buckets, got {enc_buckets}")
        row_buckets = default_row_buckets(max_rows) if row_buckets is None else tuple(sorted({int(b) for b in row_buckets}))
        if not row_buckets or row_buckets[0] < 1 or row_buckets[-1] != max_rows:
            raise ValueError(f"row buckets must be positive and end at max_rows={max_rows}, got {row_buckets}")
        param = next(dit.parameters())
        self.dit = dit
        self.cfg = dit.cfg
        self.device, self.dtype = param.device, param.dtype
        use_graphs = resolve_use_graphs(use_graphs, self.device, "DiT")
        if compile_backend:
            dit.compile_blocks(backend=compile_backend)
        self.max_rows, self.frames = max_rows, frames
        self.row_buckets, self.enc_buckets = row_buckets, enc_buckets
        D, C, dev = self.cfg.latent_dim, self.cfg.cond_dim, self.device
        self._x = torch.zeros(max_rows, frames, D, dtype=self.dtype, device=dev)
        self._positions = torch.zeros(max_rows, frames, dtype=torch.int64, device=dev)
        self._context_mask = torch.zeros(max_rows, frames, dtype=torch.bool, device=dev)
        self._frame_mask = torch.zeros(max_rows, frames, dtype=torch.bool, device=dev)
        self._t = torch.zeros(max_rows, dtype=torch.float32, device=dev)
        self._enc = {le: torch.zeros(max_rows, le, C, dtype=self.dtype, device=dev) for le in enc_buckets}
        self._enc_mask = {le: torch.zeros(max_rows, le, dtype=torch.bool, device=dev) for le in enc_buckets}
        self.graphs = BucketedGraphs(self._step, dev, use_graphs, warmup_iters, name="DiT")  # per (rows, Le), one pool
        self.fallback_calls = 0  # calls that did not fit any bucket (ran the plain module)
        self._warned = False

    @classmethod
    def for_config(cls, dit, model_cfg, max_rows: int | None = None, **kwargs) -> "GraphedDiT":
        """Buckets from a ModelConfig: frames = context + the largest planned chunk, encoder
        buckets up to the longest clause, rows up to the stream batch ceiling."""
        frames = model_cfg.dit.context_frames + max_chunk_frames(model_cfg.stream)
        enc = default_enc_buckets(max_encoder_tokens(model_cfg.text))
        return cls(dit, max_rows or model_cfg.stream.batch_ceiling, frames, enc, **kwargs)

    # ------------------------------------------------------------------ public API

    def __getattr__(self, name):  # only called for names not found on the wrapper
        if name == "dit":  # not set yet (during __init__ errors): avoid recursion
            raise AttributeError(name)
        return getattr(self.dit, name)

    def to(self, *args, **kwargs) -> "GraphedDiT":  # static buffers fix device and dtype
        return self

    def eval(self) -> "GraphedDiT":
        return self

    def bucket_for(self, rows: int, frames: int, enc_len: int) -> tuple[int, int] | None:
        """The smallest (rows, enc length) bucket holding the shape; None when none does."""
        if rows > self.max_rows or frames > self.frames or enc_len > self.enc_buckets[-1]:
            return None
        return smallest_bucket(self.row_buckets, rows), smallest_bucket(self.enc_buckets, enc_len)

    def static_pointers(self) -> dict[str, int]:
        """data_ptr of every static input buffer (they must never change)."""
        out = {n: getattr(self, "_" + n).data_ptr() for n in ("x", "positions", "context_mask", "frame_mask", "t")}
        for le in self.enc_buckets:
            out[f"enc{le}"], out[f"enc_mask{le}"] = self._enc[le].data_ptr(), self._enc_mask[le].data_ptr()
        return out

    def static_inputs(self, rows: int, enc_len: int) -> _Inputs:
        """The static inputs of bucket (rows, enc_len) (what its graph reads)."""
        return _Inputs(self._x[:rows], self._positions[:rows], self._context_mask[:rows], self._frame_mask[:rows],
                       self._t[:rows], self._enc[enc_len][:rows], self._enc_mask[enc_len][:rows])

    @torch.no_grad()
    def capture_all(self) -> None:
        """Capture every (rows, enc length) bucket now (engine start, before /readyz). CPU: no-op.

        torch.compile is an optimisation, never a reason not to start: if warming up or
        capturing the compiled blocks fails, the plain blocks are captured instead (warned)."""
        self.graphs.capture_all([(rows, le) for rows in self.row_buckets for le in self.enc_buckets],
                                getattr(self.dit, "block_step", None) is not None, self._uncompile, "DiT blocks")

    def _uncompile(self) -> None:
        self.dit.block_step = None  # BucketedGraphs drops the graphs captured so far

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, positions: torch.Tensor, context_mask: torch.Tensor,
                 frame_mask: torch.Tensor, t: torch.Tensor, enc: torch.Tensor, enc_mask: torch.Tensor) -> torch.Tensor:
        R, T, D = x.shape
        L = enc.shape[1]
        if D != self.cfg.latent_dim or enc.shape[-1] != self.cfg.cond_dim or enc.shape[0] != R:
            raise ValueError(f"expected x [R, T, {self.cfg.latent_dim}] and enc [R, L, {self.cfg.cond_dim}], "
                             f"got {tuple(x.shape)} and {tuple(enc.shape)}")
        if R == 0:
            return self.dit(x, positions, context_mask, frame_mask, t, enc, enc_mask)
        key = self.bucket_for(R, T, L)
        if key is None:
            self.fallback_calls += 1
            if not self._warned:
                self._warned = True
                log.warning("DiT input rows=%d frames=%d enc_len=%d is outside the graphed buckets (rows <= %d, "
                            "frames <= %d, enc_len <= %d): running the eager module (warned once)",
                            R, T, L, self.max_rows, self.frames, self.enc_buckets[-1])
            return self.dit(x, positions, context_mask, frame_mask, t, enc, enc_mask)
        rows, le = key
        self._load(rows, le, x, positions, context_mask, frame_mask, t, enc, enc_mask)
        out = self.graphs.run(key)  # a capture reads the static inputs, never writes them
        return out[:R, :T]

    forward = __call__

    # ------------------------------------------------------------------ internals

    def _load(self, rows, le, x, positions, context_mask, frame_mask, t, enc, enc_mask) -> None:
        """Copy the inputs into bucket (rows, le) and reset its padding (device-side copies and fills only)."""
        R, T = x.shape[:2]
        L = enc.shape[1]
        s = self.static_inputs(rows, le)
        for dst, src in ((s.x, x), (s.positions, positions), (s.context_mask, context_mask),
                         (s.frame_mask, frame_mask)):
            dst[:R, :T].copy_(src)
            if T < self.frames:
                dst[:R, T:].zero_()
        s.t[:R].copy_(t)
        s.enc[:R, :L].copy_(enc)
        s.enc_mask[:R, :L].copy_(enc_mask)
        if L < le:
            s.enc[:R, L:].zero_()
            s.enc_mask[:R, L:].zero_()
        if R < rows:  # padding rows: zeros, one unmasked dummy frame and encoder position (no NaN)
            for dst in (s.x, s.positions, s.context_mask, s.frame_mask, s.t, s.enc, s.enc_mask):
                dst[R:].zero_()
            s.frame_mask[R:, 0].fill_(True)
            s.enc_mask[R:, 0].fill_(True)

    def _step(self, key: tuple[int, int]) -> torch.Tensor:
        """The forward of bucket ``key`` = (rows, Le) over its static inputs (what a graph captures)."""
        return self.dit(*self.static_inputs(*key).args())
