"""The talker's whole decode step behind static buffers, one CUDA graph per bucket.

    source.step_runner = GraphedTalkerStep(source.step_spec())    # the pipeline says what to capture
    codes, cols = source.step_runner(rows, n_blocks, all_greedy, any_top_p)

The pipeline hands this wrapper a :class:`StepSpec`: the step to capture and the static sizes
it needs; the runtime knows nothing else of the pipeline. The talker's ``spec.step(idx, n_blocks,
all_greedy, any_top_p)`` is the whole step on the
device - code predictor (15 steps), frame embedding + text part, talker forward over the
paged KV cache, code-0 logits processing and sampling, state updates - with no host read.
This wrapper runs it over a STATIC row-index buffer per (rows bucket, KV-blocks bucket,
sampling mode): the rows are copied into the smallest rows bucket that fits (1, 2, 4, ...,
the slot count), the rest of the bucket is the spec's scratch row (its own state, a null
block table), and ``n_blocks`` is rounded up to a power of two. Every per-row tensor the step
touches has a fixed address for the pipeline's lifetime (state rows, block table, KV pool,
rotary table), except the trailing-text buffer, which grows: ``spec.buffers_version()``
changes then and every graph is dropped and recaptured.

On CUDA a (bucket, blocks, mode) is captured the first time it is needed (``capture_all``
captures the small-block ones at start): warm-up and capture run with the index buffer full
of the scratch row, so they never advance a real stream. A replay is: copy the rows in,
``replay()``, copy out the first B rows of the outputs. On CPU exactly the same padded path runs
eagerly: that is what the CPU tests check against the plain step (tests/engines/pipelines/talker/test_talker_paged.py).
The code predictor runs inside the graph (a graph cannot replay another graph), its layers
through ``torch.compile`` when ``compile_backend`` is given (as ``GraphedCodePredictor`` does),
so on CUDA the engine uses this instead of ``GraphedCodePredictor``: eager, a talker step
issues thousands of small kernels and the GPU idled ~80 % of each step (H200, 64 streams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engines.hardware.devices import upload
from engines.runtime.cuda_graphs import BucketedGraphs, GraphedWrapper, smallest_bucket

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
WARMUP_ITERS = 2


@dataclass(frozen=True)
class StepSpec:
    """What the pipeline hands the runtime to capture: the step and the static sizes around it."""

    step: Callable[[torch.Tensor, int, bool, bool], tuple[torch.Tensor, torch.Tensor]]  # (idx, blocks, greedy, top-p)
    max_rows: int  # rows the largest bucket holds (the slot count)
    scratch_row: int  # a row padding may step: it writes only its own state and the null block
    max_blocks_per_row: int  # the KV-block bucket never exceeds it
    device: torch.device
    buffers_version: Callable[[], int]  # changes when a buffer the step reads moved: recapture
    before_capture: Callable[[int], None]  # (largest bucket) sizes caches the step uses before a capture
    compile_layers: Callable[[str], None]  # (backend) compiles the layers the step runs
    compiled: Callable[[], bool]  # whether compiled layers run inside the step
    uncompile: Callable[[], None]  # back to the plain layers (their capture failed)
    # False: the step reads each row's KV length on the device (a paged-attention kernel), so one
    # graph serves every length and the KV-blocks bucket is not part of a graph's key
    bucket_blocks: bool = True


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """The rows buckets of a step over at most ``max_rows`` rows: the defaults below it, and it."""
    return tuple(b for b in DEFAULT_BUCKETS if b < max_rows) + (max_rows,)


def kv_bucket(n_blocks: int, max_blocks_per_row: int, bucket_blocks: bool = True) -> int:
    """The KV-blocks part of a step's graph key for ``n_blocks`` blocks per row: a power of two,
    or the one shape every length shares where the step reads lengths on the device."""
    if not bucket_blocks:
        return max_blocks_per_row
    return min(_pow2_at_least(n_blocks), max_blocks_per_row)


SAMPLING_MODES = ((True, False), (False, False), (False, True))  # (all_greedy, any_top_p) a step can take


def start_keys(buckets: tuple[int, ...], max_blocks_per_row: int, max_blocks: int = 8, bucket_blocks: bool = True,
               every_bucket: bool = False) -> list[tuple]:
    """The (rows, KV blocks, all_greedy, any_top_p) keys captured at engine start: every rows
    bucket in every sampling mode, at the one KV shape where the step reads lengths on the device.
    With KV-block buckets (the gather fallback) a capture each would lengthen the start many times
    over: buckets up to ``max_blocks`` (the first seconds of a stream), or all of them when
    ``every_bucket`` (nothing is captured: noting a key costs nothing)."""
    if not bucket_blocks:
        block_keys = [max_blocks_per_row]
    else:
        top = max_blocks_per_row if every_bucket else min(max_blocks, max_blocks_per_row)
        block_keys = sorted({kv_bucket(1 << i, max_blocks_per_row) for i in range(top.bit_length())} | {top})
    return [(bucket, blocks, greedy, top_p) for blocks in block_keys for bucket in buckets
            for greedy, top_p in SAMPLING_MODES]


class GraphedTalkerStep(GraphedWrapper):
    def __init__(self, spec: StepSpec, buckets: tuple[int, ...] | None = None, warmup_iters: int = WARMUP_ITERS,
                 compile_backend: str | None = None):
        """``compile_backend`` ("inductor" in the engine, CUDA only): the code predictor's layers
        run through ``torch.compile`` inside the graphs; if capturing them fails, the plain
        layers are captured instead (warned)."""
        self.spec = spec
        slots = spec.max_rows
        self.buckets = buckets or row_buckets(slots)
        self.device = spec.device
        self.cuda = self.device.type == "cuda"
        self._idx = {b: torch.full((b,), spec.scratch_row, dtype=torch.int64, device=self.device)
                     for b in self.buckets}
        # One graph per (bucket, blocks, all_greedy, any_top_p), all in one pool; a moved state
        # buffer (spec.buffers_version) drops them all.
        self.graphs = BucketedGraphs(self._step, self.device, self.cuda, warmup_iters,
                                     before_capture=self._before_capture, version=spec.buffers_version,
                                     name="talker step")
        if self.cuda and compile_backend:
            spec.compile_layers(compile_backend)

    @property
    def captures(self) -> int:
        """How many graphs were captured (recaptures after a moved buffer included)."""
        return self.graphs.captures

    def shape(self, rows: int, n_blocks: int) -> tuple[int, int]:
        """The static (rows bucket, KV blocks) a step of ``rows`` rows over ``n_blocks`` runs at."""
        bucket = smallest_bucket(self.buckets, rows)
        if bucket is None:
            raise ValueError(f"{rows} rows exceed the largest bucket {self.buckets[-1]}")
        return bucket, kv_bucket(n_blocks, self.spec.max_blocks_per_row, self.spec.bucket_blocks)

    def __call__(self, rows: list[int], n_blocks: int, all_greedy: bool,
                 any_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(rows)
        bucket, blocks = self.shape(n, n_blocks)
        key = (bucket, blocks, all_greedy, any_top_p)
        padded = rows + [self.spec.scratch_row] * (bucket - n)
        self.graphs.ensure(key)  # before the rows go in: warm-up and capture step only the scratch row
        self._idx[bucket].copy_(upload(padded, torch.int64, self.device))
        codes, cols = self.graphs.run(key)
        # The outputs are static: the next replay rewrites them, and every graph's scratch shares
        # one pool, so a replay of another bucket can overwrite them too. The frames outlive this
        # step (the vocoder reads them ticks later): copy them out now. (On CPU the step's results
        # are copied into static buffers per key, as a replay leaves them, so the CPU tests check
        # the same contract.)
        return codes[:n].clone(), cols[:n].clone()

    def _step(self, key: tuple[int, int, bool, bool]) -> tuple[torch.Tensor, torch.Tensor]:
        bucket, blocks, all_greedy, any_top_p = key
        return self.spec.step(self._idx[bucket], blocks, all_greedy, any_top_p)

    def _before_capture(self, key: tuple[int, int, bool, bool]) -> None:
        self._idx[key[0]].fill_(self.spec.scratch_row)  # warm-up and capture step only the scratch row
        self.spec.before_capture(self.buckets[-1])

    def capture_all(self, max_blocks: int = 8) -> None:
        """Capture the start keys (``start_keys``): every key a step can reach where the step reads
        KV lengths on the device; with KV-block buckets, CUDA captures those up to ``max_blocks``
        and a longer stream captures its bucket on first use (counted in ``late_captures``)."""
        keys = start_keys(self.buckets, self.spec.max_blocks_per_row, max_blocks, self.spec.bucket_blocks,
                          every_bucket=not self.cuda)
        self.graphs.capture_all(keys, self.spec.compiled(), self.spec.uncompile, "talker and predictor layers")


__all__ = ["GraphedTalkerStep", "StepSpec", "kv_bucket", "row_buckets", "start_keys"]
