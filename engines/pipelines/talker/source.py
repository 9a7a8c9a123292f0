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
 1. **decode**, for the rows chosen by :meth:`_rows_to_step` (every decoding row today; a row
    may sit a step out without any state change, e.g. while its next text has not arrived):
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

The batch is split by concern: batch.py (the host side: rows, admission, capacity, the order
of a tick, release; shared with the virtual device's source), rows.py (row state, settings,
an utterance's bookkeeping), prefill.py (prompt blocks, prefix-cache hits, chunked prefill),
decode.py (the device step), live.py (text still arriving); this module coordinates them. The budgets - who is admitted,
how many prompt positions each queued prompt prefills, the prefill token budget itself - are
the scheduler's (engines/core/scheduler.py), decided from :meth:`TalkerSource.capacity`.

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
from engines.pipelines.talker.budget import frame_budget
from engines.pipelines.talker.decode import DecodeStep
from engines.pipelines.talker.live import LiveRows
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


class TalkerSource(UtteranceBatch):
    """Continuous batching of talker utterances (see the module docstring): the coordinator of
    the rows (batch.py, rows.py), prefill (prefill.py), the decode step (decode.py) and live
    text (live.py)."""

    def __init__(self, talker: Talker, predictor: CodePredictor, prompt: PromptBuilder,
                 generation: TalkerGenerationConfig, device, dtype: torch.dtype, max_slots: int = 8,
                 max_seq_len: int = 4096, kv_cache_gb: float | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 kv_blocks: int | None = None,
                 prefix_cache_fraction: float = DEFAULT_PREFIX_CACHE_FRACTION, paged_attention: bool = True,
                 runners: SourceRunners = SourceRunners()):
        super().__init__(prompt, generation, talker.cfg.num_code_groups, max_slots, max_seq_len,
                         canonical_device(device))
        self.talker = talker.eval()
        self.dtype = dtype
        cfg = talker.cfg
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
        self.live_rows = LiveRows(self.talker, self.state, prompt.config.tts_pad_token_id, self.device)
        self._pending: list[HostIds] = []
        self.batched_admission = (self.device.type == "cuda" if runners.batched_admission is None
                                  else runners.batched_admission)

    @property
    def predictor(self) -> CodePredictor:
        """The decode step's code predictor (as its runners wrapped it: fused, graphed)."""
        return self.decoder.predictor

    @predictor.setter
    def predictor(self, predictor: CodePredictor) -> None:
        """Benchmarks swap variants on one built source (the engine picks its runners at build)."""
        self.decoder.predictor = predictor

    @property
    def buffers_version(self) -> int:
        """Changes when a per-row buffer is reallocated (captured graphs must recapture)."""
        return self.state.version

    def decode_step(self, idx: torch.Tensor, n_blocks: int, all_greedy: bool,
                    any_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-3 for rows ``idx`` on the device (decode.py :class:`DecodeStep`)."""
        return self.decoder(idx, n_blocks, all_greedy, any_top_p)

    def step_spec(self) -> StepSpec:
        """What a GraphedTalkerStep captures: the decode step and its static sizes (the
        trailing-text buffer sized first, so that ordinary requests never move it)."""
        self.state.ensure_trail(min(self.max_seq_len, GRAPHED_TRAIL_CAPACITY))
        return self.decoder.spec(self.max_slots, self.scratch_row)

    def prefill_spec(self) -> PrefillSpec:
        """What a GraphedPrefill captures: the prompt forward, its padding row and sizes."""
        return self.prefill.spec(self.scratch_row)

    @classmethod
    def from_bundle(cls, bundle: TalkerBundle, max_slots: int = 8, max_seq_len: int = 4096,
                    kv_cache_gb: float | None = None, **kwargs) -> "TalkerSource":
        return cls(bundle.talker, bundle.predictor, bundle.prompt, bundle.generation, bundle.device, bundle.dtype,
                   max_slots=max_slots, max_seq_len=max_seq_len, kv_cache_gb=kv_cache_gb, **kwargs)

    def kv_cache_stats(self) -> dict[str, float]:
        stats = super().kv_cache_stats()
        if self.prefix is not None:  # hits, misses, evictions, positions not prefilled, blocks indexed
            stats.update(self.prefix.stats())
        return stats

    # ---------------------------------------------------------------- admission

    def _take_row(self, row: int, request: SynthesisRequest, prompt: TalkerPrompt, prompt_len: int) -> dict:
        """The prompt's blocks (shared prefixes adopted: prefill.py)."""
        keys = prefix_keys(self.prefix, request, prompt)
        cached = take_blocks(self.cache, self.prefix, row, prompt_len, keys)  # raises before anything changes
        return {"prompt": None, "prompt_len": prompt_len, "prefilled": cached, "prefix_keys": keys}

    def _start(self, utts: list[Utterance]) -> None:
        """The prompts' inputs and the rows' device state, for all of ``utts`` at once."""
        xs, trailings, pad = batch_prompt_tensors(self.talker, [u.talker_prompt for u in utts], self.device)
        for u, x in zip(utts, xs):
            u.prompt = x
        self.state.start([u.row for u in utts], [u.request for u in utts], [u.settings for u in utts],
                         trailings, pad, [u.prompt_len for u in utts])

    # ---------------------------------------------------------------- the tick's device work

    def _rows_to_step(self) -> list[Utterance]:
        """The utterances that take a decode step this tick, by row. A row left out keeps its
        state untouched and steps again in a later tick: a live row whose next text id has
        not arrived yet sits out until it does."""
        waiting = self.live_rows.feed(self._utts)
        return [self._utts[r] for r in sorted(self._utts) if self._utts[r].decoding and r not in waiting]

    def _eager_step(self, rows: list[int], n_blocks: int, all_greedy: bool,
                    any_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
        idx = upload(rows, torch.int64, self.device)  # no stream sync for the upload
        return self.decoder(idx, n_blocks, all_greedy, any_top_p)

    def _decode(self, utts: list[Utterance]) -> list[TalkerFrames]:
        """One decode step of ``utts`` (steps 1-4 of the module docstring)."""
        n_blocks = max(self.cache.row_blocks(u.row) for u in utts)
        run = self.step_runner or self._eager_step
        codes, new_cols = run([u.row for u in utts], n_blocks, not any(u.settings.sampled for u in utts),
                              any(u.settings.any_top_p for u in utts))
        for u in utts:
            u.next_pos += 1
        in_flight = self.decoder.copy_to_host(new_cols, [u.request_id for u in utts], flip=True)  # starts now

        # 4. host: the previous ids (admission or an earlier step) decide who ends.
        by_id = {u.request_id: u for u in self._utts.values()}
        for record in self._pending:
            for rid, value in zip(record.request_ids, record.resolve()):
                if rid in by_id:
                    by_id[rid].code0 = value
        self._pending = [in_flight]
        eos = self.talker.cfg.codec_eos_token_id
        out: list[TalkerFrames] = []
        frames = codes.split(1)  # one op for every row's [1, G] view
        for i, u in enumerate(utts):
            if u.code0 is None:
                raise RuntimeError(f"talker: code 0 of {u.request_id!r} never reached the host")
            if u.code0 == eos:
                out.append(self._final(u))
                self._release(u)
                continue
            limit, reason = self._frame_limit(u)
            looped = u.guard.add(u.code0)  # the runaway guard: its code 0 repeats one pattern
            last = looped or u.frames + 1 >= limit
            truncated = "loop" if looped else reason if last else None
            out.append(TalkerFrames(u.request_id, frames[i], u.frames, last, truncated=truncated))
            u.frames += 1
            u.code0 = None  # the value for the next step arrives with ``in_flight``
            if last:
                self._release(u)
        return out

    @staticmethod
    def _frame_limit(u: Utterance) -> tuple[int, str]:
        """The utterance's frame limit now: a live one's text budget applies once its text is complete."""
        if u.live is None or not u.live.done or not u.budgeted:
            return u.max_frames, u.limit_reason
        return min((frame_budget(len(u.live.ids)), "budget"), (u.max_frames, u.limit_reason), key=lambda b: b[0])

    def _prefill(self, takes: tuple[int, ...]) -> None:
        """The planned prefill positions of the queued prompts (prefill.py); completed ones leave the queue."""
        prefilled = self.prefill.run(self._prefill_queue, takes)
        if prefilled is not None:  # prompts completed: their code 0 is on its way to the host
            self._pending.append(prefilled)
            self._prefill_queue = [u for u in self._prefill_queue if not u.decoding]


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


__all__ = ["RowSettings", "TalkerFrames", "TalkerSource", "kv_cache_bytes", "resolve_settings"]

