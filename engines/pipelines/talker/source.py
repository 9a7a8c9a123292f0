"""The Qwen3-TTS talker as a latent source: continuous batching of utterances over a paged KV cache.

    source = TalkerSource.from_bundle(TalkerBundle.from_checkpoint(path, device, dtype), max_slots=64)
    source.admit(request)              # tokenize, build the prompt, take KV blocks for it, queue its prefill
    plan = scheduler.step_plan(source.capacity())   # engines/core/scheduler.py decides the budgets
    frames = source.tick(plan)         # the planned prefill chunks, then ONE decode step
    # -> [TalkerFrames(request_id, codes [n, G], frame_start, is_last, error), ...]

Rows are stable: an utterance keeps its row (and its KV blocks, engines/models/paged_kv.py)
from admission to its end; a finished row returns its blocks to the pool and nothing moves.
Per row (device tensors indexed by row): the last talker hidden h, the current code-0
column, its position, its token count, the repetition-penalty set, its trailing text parts
and its resolved sampling settings (the checkpoint's generation_config.json with the
request's overrides, engines/models/sampling.py ``SamplingSettings``).

One tick:
 0. **prefill**: queued prompts go through the talker together, as many positions of each as
    the step's plan says (the scheduler's prefill token budget: a long prompt takes several
    ticks), so an arriving request never stalls the streams already speaking; a prompt that
    completes samples its code 0 and joins the decode step of the same tick.
 1. **decode**, for the rows that step (every decoding row but a live one whose next text has not
    arrived, or one the KV pool cannot grow: it sits the step out without any state change):
    code predictor on [h, emb(code 0)] -> codes 1..G-1 of frame k;
 2. next talker input = sum of the frame's G code embeddings + the row's text part for step
    k (decode.py `_text_inputs`: trailing text, then tts_pad); one talker forward over the paged
    cache at each row's position;
 3. code-0 logits over the compact valid range (codebook + EOS), the official processors
    (repetition penalty over the row's generated ids, EOS blocked before min_new_tokens)
    and on-device sampling; the new ids' copy to the host starts right away;
 4. the host reads the ids of the PREVIOUS step (copied while this step was queued): a row
    whose code 0 was EOS ends (its frame from step 1 is dropped, EOS is not a frame) with an
    empty ``is_last`` TalkerFrames; any other row emits its frame; a row that reached its frame
    limit (its text's budget, budget.py; max_new_tokens - 1; its positions) ends with that frame
    (``is_last``, ``truncated`` naming the bound), and so does a row whose code 0 has fallen into
    a loop (the runaway guard, guard.py: ``truncated`` "loop").
So EOS is noticed one step late (one wasted row-step per utterance) in exchange for never
waiting on the device inside a step. Steps 1-3 are :meth:`decode_step`: device ops only, the
same ops at every batch size, run eagerly or by ``step_runner`` (a
:class:`~engines.runtime.graphed_talker.GraphedTalkerStep`: static buckets, CUDA graphs).

KV memory: a row takes the blocks of its prompt at admission and one more block whenever its
position crosses a block boundary. ``capacity()`` reports free rows and blocks, and the
scheduler admits only the rows the pool can give the longest waiting prompt plus one block of
growth (after one block of growth per decoding row), so new requests wait in the engine's queue (``kv_cache_stats()["admission_waits"]`` counts the
ticks that happened). A decoding row whose next block is not free sits the step out and steps
again once other streams have freed blocks (``stalls``); only when every row waits that way
does the youngest end with ``kv_cache_exhausted`` (it outgrew the pool), never corrupting another.

Prompt prefixes (engines/models/prefix_cache.py): a prompt whose first positions equal an
earlier prompt's under the same owner (``SynthesisRequest.prefix_owner``, else ``tenant``; a
cloned voice needs one) shares that prompt's full KV blocks, copies its partially matched
block, and prefills only the rest; every completed prompt is indexed, within
``prefix_cache_fraction`` of the pool (least recently used blocks nobody holds are evicted
first, also when the pool runs short). ``kv_cache_stats()`` counts hits, misses, evictions.

The host side - rows, admission, capacity, the order of a tick, live rows waiting for text, how
an utterance ends (step 4), release - is batch.py's, whatever the device; this module is the real
device's runner (:class:`DeviceRunner`: the KV pool, prefill.py, decode.py, live.py's text parts)
and :class:`TalkerSource`, the batch over it. The virtual device is another runner under the same
batch (engines/virtual/talker.py). rows.py holds row state, settings and an utterance's
bookkeeping. The budgets - who is admitted, how many prompt positions each queued prompt
prefills, the prefill token budget itself - are the scheduler's (engines/core/scheduler.py),
decided from :meth:`TalkerSource.capacity`.

Greedy codes equal :func:`engines.pipelines.talker.reference.generate_codes` (and the official
``generate_custom_voice``) whatever shares the batch; sampled codes too, since the noise is
keyed by (seed, token index, codebook, id) (engines/models/sampling.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from engines.checkpoints.qwen3_tts import TalkerGenerationConfig
from engines.contract import SynthesisRequest
from engines.hardware.devices import canonical_device, upload
from engines.models.code_predictor import CodePredictor
from engines.models.paged_kv import PagedKVCache
from engines.models.prefix_cache import PrefixCache
from engines.models.talker import Talker
from engines.pipelines.talker.batch import UtteranceBatch
from engines.pipelines.talker.decode import DecodeStep
from engines.pipelines.talker.live import TextParts
from engines.pipelines.talker.prefill import Prefill, prefix_keys, take_blocks
from engines.pipelines.talker.prompt import PromptBuilder, TalkerPrompt
from engines.pipelines.talker.reference import TalkerBundle, batch_prompt_tensors
from engines.pipelines.talker.rows import (
    HostIds,
    RowSettings,
    RowState,
    TalkerFrames,
    Utterance,
    resolve_settings,
)
from engines.runtime.graphed_prefill import PrefillSpec
from engines.runtime.graphed_talker import StepSpec

DEFAULT_KV_CACHE_GB_CPU = 1.0
DEFAULT_KV_FRACTION_CUDA = 0.4  # of the device memory free when the source is built
DEFAULT_BLOCK_SIZE = 16
DEFAULT_PREFIX_CACHE_FRACTION = 0.25  # of the KV pool's blocks the prompt-prefix index may keep
# Trailing text parts a row holds before its buffer must grow. Captured step graphs read that
# buffer by address, so growing it drops every graph and each is captured again on first use,
# while streams are playing (on an H200 that stalled the step and underran every stream): a
# source that hands out a step spec sizes the buffer for this many first.
GRAPHED_TRAIL_CAPACITY = 1024


@dataclass(frozen=True)
class SourceRunners:
    """How a source runs its device work, picked by the adapter from the device and switches
    (engines/pipelines/talker/adapter.py): each maker is called once while the source is built,
    with what it wraps. None: eager."""

    step: Callable[[StepSpec], Any] | None = None
    """The whole decode step per static bucket (engines/runtime/graphed_talker.py GraphedTalkerStep)."""
    prefill: Callable[[PrefillSpec], Any] | None = None
    """The prompts' first chunks per (prompts, width) bucket (engines/runtime/graphed_prefill.py)."""
    predictor_kernels: Callable[[CodePredictor], Any] | None = None
    """The code predictor's frame as fused kernels (engines/models/fused_predictor.py), inside the step."""
    predictor_graphs: Callable[[CodePredictor], Any] | None = None
    """The code predictor graphed on its own, the talker step eager (GraphedCodePredictor)."""
    batched_admission: bool | None = None
    """The rows admitted since the last tick start in one pass (batch.py); None: on CUDA, where it
    is launch bound."""


class DeviceRunner:
    """The talker's device work on a real device (batch.py :class:`TalkerRunner`): the paged KV
    pool and its prefix cache, the rows' device state, prefill (prefill.py), the decode step
    (decode.py) and live rows' text parts (live.py)."""

    def __init__(self, talker: Talker, predictor: CodePredictor, generation: TalkerGenerationConfig,
                 tts_pad_token_id: int, device, dtype: torch.dtype, max_slots: int, max_seq_len: int,
                 kv_cache_gb: float | None = None, block_size: int = DEFAULT_BLOCK_SIZE, kv_blocks: int | None = None,
                 prefix_cache_fraction: float = DEFAULT_PREFIX_CACHE_FRACTION, paged_attention: bool = True,
                 runners: SourceRunners = SourceRunners()):
        self.device = canonical_device(device)
        self.talker = talker.eval()
        self.dtype = dtype
        self.max_slots, self.max_seq_len = max_slots, max_seq_len
        cfg = talker.cfg
        self.eos_id = cfg.codec_eos_token_id
        n_valid = talker.valid_ids.numel()  # compact code-0 columns (codebook + EOS)
        kv_shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        if kv_blocks is not None:  # an exact pool (tests, benchmarks); else sized in bytes
            self.cache = PagedKVCache(*kv_shape, kv_blocks, block_size, max_slots + 1, max_seq_len, self.device, dtype,
                                      paged_attention)
        else:  # paged_attention: decode attention reads the pool in place where the kernel runs
            self.cache = PagedKVCache.for_budget(*kv_shape, kv_cache_bytes(kv_cache_gb, self.device), block_size,
                                                 max_slots + 1, max_seq_len, self.device, dtype, paged_attention)
        if not 0.0 <= prefix_cache_fraction <= 1.0:
            raise ValueError(f"prefix_cache_fraction must be in [0, 1], got {prefix_cache_fraction}")
        # Shared prompt prefixes' K/V, inside the pool (engines/models/prefix_cache.py); 0 = off.
        self.prefix = PrefixCache(self.cache, int(prefix_cache_fraction * self.cache.capacity_blocks)) if (
            prefix_cache_fraction > 0) else None
        talker.fuse_projections()  # one GEMM for q/k/v and one for gate/up per layer (views: no extra memory)
        self.rope = talker.rope_table(max_seq_len, dtype)  # precomputed once: a step only gathers
        # Row max_slots is the scratch row: padding of a static batch bucket steps it (its
        # block table stays null); it never holds an utterance.
        self.scratch_row = max_slots
        self.state = RowState.allocate(max_slots + 1, cfg.hidden_size, n_valid, dtype, self.device)
        predictor = predictor.eval()
        if runners.predictor_kernels is not None:
            predictor = runners.predictor_kernels(predictor)
        graphed_predictor = runners.predictor_graphs(predictor) if runners.predictor_graphs is not None else None
        self.decoder = DecodeStep(self.talker, graphed_predictor or predictor, generation, self.state, self.cache,
                                  self.rope, max_seq_len, self.device, dtype)
        # decode_step's runner: None = eager; a GraphedTalkerStep replays it per static bucket
        self.step_runner = runners.step(self.step_spec()) if runners.step is not None else None
        self.prefill = Prefill(self.talker, self.cache, self.prefix, self.rope, self.decoder, self.device,
                               runner=runners.prefill, scratch_row=self.scratch_row)
        # the graph wrappers it replays (captured at start)
        self.graphed = tuple(g for g in (self.step_runner, self.prefill.runner, graphed_predictor) if g is not None)
        self.text = TextParts(self.talker, self.state, tts_pad_token_id, self.device)
        self.batched_admission = (self.device.type == "cuda" if runners.batched_admission is None
                                  else runners.batched_admission)  # launch bound there (batch.py)

    def step_spec(self) -> StepSpec:
        """What a GraphedTalkerStep captures: the decode step and its static sizes (the
        trailing-text buffer sized first, so that ordinary requests never move it)."""
        self.state.ensure_trail(min(self.max_seq_len, GRAPHED_TRAIL_CAPACITY))
        return self.decoder.spec(self.max_slots, self.scratch_row)

    def prefill_spec(self) -> PrefillSpec:
        """What a GraphedPrefill captures: the prompt forward, its padding row and sizes."""
        return self.prefill.spec(self.scratch_row)

    def kv_cache_stats(self) -> dict[str, float]:
        """The prefix cache's hits, misses, evictions, positions not prefilled, blocks indexed."""
        return self.prefix.stats() if self.prefix is not None else {}

    def take_blocks(self, row: int, request: SynthesisRequest, prompt: TalkerPrompt,
                    prompt_len: int) -> tuple[int, list[bytes] | None]:
        """The prompt's blocks (shared prefixes adopted: prefill.py)."""
        keys = prefix_keys(self.prefix, request, prompt)
        return take_blocks(self.cache, self.prefix, row, prompt_len, keys), keys  # raises before anything changes

    def start(self, utts: list[Utterance]) -> None:
        """The prompts' inputs and the rows' device state, for all of ``utts`` at once."""
        xs, trailings, pad = batch_prompt_tensors(self.talker, [u.talker_prompt for u in utts], self.device)
        for u, x in zip(utts, xs):
            u.prompt = x
        self.state.start([u.row for u in utts], [u.request for u in utts], [u.settings for u in utts],
                         trailings, pad, [u.prompt_len for u in utts])

    def prefill_chunks(self, work: list[tuple[Utterance, int]]) -> HostIds | None:
        """The planned prompt chunks in one padded forward (prefill.py)."""
        return self.prefill.run(work)

    def write_text(self, u: Utterance, ids: list[int], done: bool) -> None:
        self.text.write(u, ids, done)

    def eager_step(self, rows: list[int], n_blocks: int, all_greedy: bool,
                   any_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
        idx = upload(rows, torch.int64, self.device)  # no stream sync for the upload
        return self.decoder(idx, n_blocks, all_greedy, any_top_p)

    def decode(self, utts: list[Utterance]) -> tuple[torch.Tensor, HostIds]:
        """Steps 1-3 of the module docstring for ``utts`` (eager, or replayed by ``step_runner``);
        the new code-0 ids' copy to the host starts now."""
        n_blocks = max(self.cache.row_blocks(u.row) for u in utts)
        run = self.step_runner or self.eager_step
        codes, new_cols = run([u.row for u in utts], n_blocks, not any(u.settings.sampled for u in utts),
                              any(u.settings.any_top_p for u in utts))
        return codes, self.decoder.copy_to_host(new_cols, [u.request_id for u in utts], flip=True)


class TalkerSource(UtteranceBatch):
    """Continuous batching of talker utterances on the real device (the module docstring): the
    host side (batch.py, every rule of it) over a :class:`DeviceRunner`. It overrides nothing; the
    properties below name the device's parts for the adapter, tests and benchmarks."""

    def __init__(self, talker: Talker, predictor: CodePredictor, prompt: PromptBuilder,
                 generation: TalkerGenerationConfig, device, dtype: torch.dtype, max_slots: int = 8,
                 max_seq_len: int = 4096, kv_cache_gb: float | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 kv_blocks: int | None = None,
                 prefix_cache_fraction: float = DEFAULT_PREFIX_CACHE_FRACTION, paged_attention: bool = True,
                 runners: SourceRunners = SourceRunners()):
        if max_slots <= 0:
            raise ValueError(f"max_slots must be > 0, got {max_slots}")
        runner = DeviceRunner(talker, predictor, generation, prompt.config.tts_pad_token_id, device, dtype, max_slots,
                              max_seq_len, kv_cache_gb, block_size, kv_blocks, prefix_cache_fraction, paged_attention,
                              runners)
        super().__init__(prompt, generation, talker.cfg.num_code_groups, runner, max_slots, max_seq_len)

    @classmethod
    def from_bundle(cls, bundle: TalkerBundle, max_slots: int = 8, max_seq_len: int = 4096,
                    kv_cache_gb: float | None = None, **kwargs) -> "TalkerSource":
        return cls(bundle.talker, bundle.predictor, bundle.prompt, bundle.generation, bundle.device, bundle.dtype,
                   max_slots=max_slots, max_seq_len=max_seq_len, kv_cache_gb=kv_cache_gb, **kwargs)

    # ---------------------------------------------------------------- the device's parts

    talker = property(lambda self: self.runner.talker)
    dtype = property(lambda self: self.runner.dtype)
    state = property(lambda self: self.runner.state)
    rope = property(lambda self: self.runner.rope)
    prefix = property(lambda self: self.runner.prefix)
    decoder = property(lambda self: self.runner.decoder)
    prefill = property(lambda self: self.runner.prefill)  # prefill.py's Prefill (its ``runner``: graphed buckets)
    scratch_row = property(lambda self: self.runner.scratch_row)
    graphed = property(lambda self: self.runner.graphed)  # the graph wrappers it replays (captured at start)

    @property
    def predictor(self) -> CodePredictor:
        """The decode step's code predictor (as its runners wrapped it: fused, graphed)."""
        return self.runner.decoder.predictor

    @predictor.setter
    def predictor(self, predictor: CodePredictor) -> None:  # (benchmarks that compare predictors)
        self.runner.decoder.predictor = predictor

    @property
    def step_runner(self):
        """The decode step's runner: None = eager; a GraphedTalkerStep replays it per static bucket."""
        return self.runner.step_runner

    @step_runner.setter
    def step_runner(self, runner) -> None:
        self.runner.step_runner = runner

    @property
    def buffers_version(self) -> int:
        """Changes when a per-row buffer is reallocated (captured graphs must recapture)."""
        return self.runner.state.version

    def decode_step(self, idx: torch.Tensor, n_blocks: int, all_greedy: bool,
                    any_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-3 for rows ``idx`` on the device (decode.py :class:`DecodeStep`)."""
        return self.runner.decoder(idx, n_blocks, all_greedy, any_top_p)

    def step_spec(self) -> StepSpec:
        return self.runner.step_spec()

    def prefill_spec(self) -> PrefillSpec:
        return self.runner.prefill_spec()


def kv_cache_bytes(kv_cache_gb: float | None, device: torch.device) -> float:
    """The pool's size: ``kv_cache_gb`` GiB, or by default a fixed size on CPU and a fraction of
    the free device memory on CUDA."""
    if kv_cache_gb is not None:
        if not kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {kv_cache_gb}")
        return kv_cache_gb * 2**30
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return DEFAULT_KV_FRACTION_CUDA * free
    return DEFAULT_KV_CACHE_GB_CPU * 2**30


__all__ = ["DeviceRunner", "RowSettings", "SourceRunners", "TalkerFrames", "TalkerSource", "kv_cache_bytes", "resolve_settings"]

