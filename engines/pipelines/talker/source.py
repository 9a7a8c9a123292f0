"""The Qwen3-TTS talker as a latent source: continuous batching of utterances over a paged KV cache.

    source = TalkerSource.from_bundle(TalkerBundle.from_checkpoint(path, device, dtype), max_slots=64)
    source.admit(request)              # tokenize, build the prompt, take KV blocks for it, queue its prefill
    plan = Scheduler.step_plan(source.capacity())   # engines/core/scheduler.py decides the budgets
    frames = source.tick(plan)         # the planned prefill chunks, then ONE decode step
    # -> [TalkerFrames(request_id, codes [n, G], frame_start, is_last, error), ...]

Rows are stable: an utterance keeps its row (and its KV blocks, engines/models/paged_kv.py)
from admission to its end; a finished row returns its blocks to the pool and nothing moves.
Per row (device tensors indexed by row): the last talker hidden h, the current code-0
column, its position, its token count, the repetition-penalty set, its trailing text parts
and its resolved sampling settings (the checkpoint's generation_config.json with the
request's overrides, engines/models/sampling.py ``SamplingSettings``).

One tick:
 0. **prefill**: queued prompts go through the talker together, at most
    ``prefill_token_budget`` positions per tick (a long prompt takes several ticks; the
    scheduler says how many each gets), so an arriving request never stalls the streams already speaking; a prompt that completes
    samples its code 0 and joins the decode step of the same tick.
 1. **decode**, for the rows chosen by :meth:`_rows_to_step` (every decoding row today; a row
    may sit a step out without any state change, e.g. while its next text has not arrived):
    code predictor on [h, emb(code 0)] -> codes 1..G-1 of frame k;
 2. next talker input = sum of the frame's G code embeddings + the row's text part for step
    k (:meth:`_text_inputs`: trailing text, then tts_pad); one talker forward over the paged
    cache at each row's position;
 3. code-0 logits over the compact valid range (codebook + EOS), the official processors
    (repetition penalty over the row's generated ids, EOS blocked before min_new_tokens)
    and on-device sampling; the new ids' copy to the host starts right away;
 4. the host reads the ids of the PREVIOUS step (copied while this step was queued): a row
    whose code 0 was EOS ends (its frame from step 1 is dropped, EOS is not a frame) with an
    empty ``is_last`` TalkerFrames; any other row emits its frame; a row that reached
    max_new_tokens - 1 frames ends with that frame (``is_last``).
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

Greedy codes equal :func:`engines.pipelines.talker.reference.generate_codes` (and the official
``generate_custom_voice``) whatever shares the batch; sampled codes too, since the noise is
keyed by (seed, token index, codebook, id) (engines/models/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.nn.utils.rnn import pad_sequence

from engines.checkpoints.qwen3_tts import TalkerGenerationConfig
from engines.contract import SynthesisRequest
from engines.devices import canonical_device, upload
from engines.models.code_predictor import CodePredictor
from engines.models.paged_kv import KVPoolExhausted, PagedKVCache
from engines.models.prefix_cache import PrefixCache, position_keys
from engines.models.sampling import (
    FrameSampling,
    SamplingSettings,
    apply_talker_processors,
    sample_code0,
    split_seed,
)
from engines.models.talker import Talker
from engines.pipelines.base import Capacity, StepPlan
from engines.pipelines.talker.live_text import LiveText
from engines.pipelines.talker.prompt import PromptBuilder
from engines.pipelines.talker.reference import (
    TalkerBundle,
    frame_embedding,
    prompt_tensors,
)
from engines.runtime.graphed_talker import StepSpec

DEFAULT_KV_CACHE_GB_CPU = 1.0
DEFAULT_KV_FRACTION_CUDA = 0.4  # of the device memory free when the source is built
DEFAULT_BLOCK_SIZE = 16
DEFAULT_PREFILL_TOKEN_BUDGET = 512
DEFAULT_PREFIX_CACHE_FRACTION = 0.25  # of the KV pool's blocks the prompt-prefix index may keep


@dataclass(frozen=True)
class TalkerFrames:
    request_id: str
    codes: torch.Tensor  # [n, G] int64 on the device: frames finished this tick (n = 1, or 0 on an end)
    frame_start: int  # global index of codes[0] in the utterance
    is_last: bool  # EOS reached (or max tokens, or an error): the utterance is complete
    error: str | None = None  # the utterance failed (e.g. the KV pool could not hold it)


@dataclass(frozen=True)
class RowSettings:
    """A request's decoding settings, resolved against the checkpoint's generation config."""

    talker: SamplingSettings  # code 0
    predictor: SamplingSettings  # codes 1..G-1
    repetition_penalty: float
    max_new_tokens: int

    @property
    def sampled(self) -> bool:
        return not (self.talker.greedy and self.predictor.greedy)

    @property
    def any_top_p(self) -> bool:
        return (not self.talker.greedy and self.talker.top_p < 1.0) or (
            not self.predictor.greedy and self.predictor.top_p < 1.0)


def resolve_settings(gen: TalkerGenerationConfig, request: SynthesisRequest) -> RowSettings:
    """The checkpoint's ``generation_config.json`` with the request's overrides: temperature,
    top_k, top_p apply to code 0 (the official ``generate()`` keeps the code predictor's own
    ``subtalker_*`` settings); greedy (``temperature`` 0 or ``greedy``) applies to both."""
    talker = SamplingSettings(not gen.do_sample, gen.temperature, gen.top_k, gen.top_p).for_request(request)
    predictor = SamplingSettings(not gen.subtalker_dosample, gen.subtalker_temperature, gen.subtalker_top_k,
                                 gen.subtalker_top_p)
    if request.greedy or request.temperature == 0:
        predictor = predictor.override(greedy=True)
    penalty = gen.repetition_penalty if request.repetition_penalty is None else float(request.repetition_penalty)
    max_new = gen.max_new_tokens if request.max_new_tokens is None else int(request.max_new_tokens)
    return RowSettings(talker, predictor, penalty, max_new)


@dataclass
class _Utterance:
    request: SynthesisRequest
    row: int
    settings: RowSettings
    prompt: torch.Tensor | None  # [S, D] prefill inputs until prefilled
    prompt_len: int
    max_frames: int  # max_new_tokens - 1 (bounded by the per-stream position limit)
    prefilled: int = 0  # prompt positions in the cache
    decoding: bool = False  # prefill done, code 0 of frame 0 sampled
    next_pos: int = 0  # host copy of the row's next talker position
    frames: int = 0  # frames emitted so far
    code0: int | None = None  # host value of the row's current code 0, once its copy landed
    admitted: int = 0  # admission order (the youngest ends first when the pool is deadlocked)
    live: LiveText | None = None  # issue 16: text still arriving (live_text.py)
    fed: int = 0  # live: trailing text parts written into the row's ``trail`` so far
    prefix_keys: list[bytes] | None = None  # per-position prefix-cache keys (None: not cacheable)

    @property
    def request_id(self) -> str:
        return self.request.id


@dataclass
class _HostIds:
    """A device->host copy of sampled code-0 ids in flight: which request each entry is for."""

    request_ids: list[str]
    host: torch.Tensor  # [n] int64 (pinned on CUDA)
    event: object | None = None  # torch.cuda.Event on CUDA

    def resolve(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()  # type: ignore[attr-defined]
        return self.host[: len(self.request_ids)].tolist()


@dataclass
class _Rows:
    """Per-row device state, R rows (stable: a row belongs to one utterance until it ends)."""

    h: torch.Tensor  # [R, D] talker hidden after the final norm, last position
    code0: torch.Tensor  # [R] int64 compact code-0 column of the row's current frame
    pos: torch.Tensor  # [R] int64 next talker position
    ntok: torch.Tensor  # [R] int64 code-0 tokens sampled so far
    seen: torch.Tensor  # [R, n_valid] bool: repetition-penalty set
    trail: torch.Tensor  # [R, Tcap, D] trailing text parts; trail[r, trail_len[r]] = tts_pad part
    trail_len: torch.Tensor  # [R] int64
    seed_lo: torch.Tensor
    seed_hi: torch.Tensor
    penalty: torch.Tensor  # [R] float32 repetition penalty
    greedy: torch.Tensor  # [R] bool (talker)
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    sub_greedy: torch.Tensor  # [R] bool (code predictor)
    sub_temperature: torch.Tensor
    sub_top_k: torch.Tensor
    sub_top_p: torch.Tensor


class TalkerSource:
    """Continuous batching of talker utterances (see the module docstring)."""

    def __init__(self, talker: Talker, predictor: CodePredictor, prompt: PromptBuilder,
                 generation: TalkerGenerationConfig, device, dtype: torch.dtype, max_slots: int = 8,
                 max_seq_len: int = 4096, kv_cache_gb: float | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 prefill_token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET, kv_blocks: int | None = None,
                 prefix_cache_fraction: float = DEFAULT_PREFIX_CACHE_FRACTION):
        if max_slots <= 0:
            raise ValueError(f"max_slots must be > 0, got {max_slots}")
        if prefill_token_budget <= 0:
            raise ValueError(f"prefill_token_budget must be > 0, got {prefill_token_budget}")
        self.talker = talker.eval()
        self.predictor = predictor.eval()
        self.prompt = prompt
        self.generation = generation
        self.device = canonical_device(device)
        self.dtype = dtype
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len  # positions per stream (prompt + frames)
        self.prefill_token_budget = prefill_token_budget
        cfg = talker.cfg
        self.num_code_groups = cfg.num_code_groups
        self.valid_ids = talker.valid_ids.to(self.device)  # [n_valid] compact column -> codec id
        n_valid = self.valid_ids.numel()
        self.eos_col = int((self.valid_ids == cfg.codec_eos_token_id).nonzero()[0, 0])
        kv_shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        if kv_blocks is not None:  # an exact pool (tests, benchmarks); else sized in bytes
            self.cache = PagedKVCache(*kv_shape, kv_blocks, block_size, max_slots + 1, max_seq_len, self.device, dtype)
        else:
            self.cache = PagedKVCache.for_budget(*kv_shape, kv_cache_bytes(kv_cache_gb, self.device), block_size,
                                                 max_slots + 1, max_seq_len, self.device, dtype)
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
        r, d, dev = max_slots + 1, cfg.hidden_size, self.device

        def z(*shape, dt=torch.int64):
            return torch.zeros(*shape, dtype=dt, device=dev)

        f32 = torch.float32
        self.state = _Rows(
            h=z(r, d, dt=dtype), code0=z(r), pos=z(r), ntok=z(r), seen=z(r, n_valid, dt=torch.bool),
            trail=z(r, 8, d, dt=dtype), trail_len=z(r), seed_lo=z(r), seed_hi=z(r), penalty=z(r, dt=f32),
            greedy=z(r, dt=torch.bool), temperature=z(r, dt=f32), top_k=z(r), top_p=z(r, dt=f32),
            sub_greedy=z(r, dt=torch.bool), sub_temperature=z(r, dt=f32), sub_top_k=z(r), sub_top_p=z(r, dt=f32))
        self._true = torch.ones((), dtype=torch.bool, device=dev)  # the value the penalty-set update writes
        cuda = self.device.type == "cuda"
        self._host = [torch.zeros(r, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._host_flip = 0
        self._utts: dict[int, _Utterance] = {}  # row -> utterance
        self._prefill_queue: list[_Utterance] = []  # admission order
        self._pending: list[_HostIds] = []
        self._last_batch_rows = 0
        self._waiting_prompt_blocks = 0  # set by the pipeline: blocks the longest waiting prompt needs
        self.admission_waits = 0  # ticks in which a free row waited for KV blocks
        # decode_step's runner: None = eager; a GraphedTalkerStep replays it per static bucket
        self.step_runner = None
        self.buffers_version = 0  # bumped when a per-row buffer is reallocated (graphs must recapture)
        self.kv_stalls = 0  # row-steps skipped because the pool had no block for the row's next position
        self._admissions = 0
        self._pad_part: torch.Tensor | None = None  # live text: the tts_pad text part

    @classmethod
    def from_bundle(cls, bundle: TalkerBundle, max_slots: int = 8, max_seq_len: int = 4096,
                    kv_cache_gb: float | None = None, **kwargs) -> "TalkerSource":
        return cls(bundle.talker, bundle.predictor, bundle.prompt, bundle.generation, bundle.device, bundle.dtype,
                   max_slots=max_slots, max_seq_len=max_seq_len, kv_cache_gb=kv_cache_gb, **kwargs)

    # ---------------------------------------------------------------- introspection

    def voices(self) -> list[str]:
        return self.prompt.voices()

    def languages(self) -> list[str]:
        return self.prompt.languages()

    def free_rows(self) -> int:
        return self.max_slots - len(self._utts)

    def capacity(self) -> Capacity:
        """What the scheduler decides from (engines/core/scheduler.py): free rows, free KV blocks,
        the decoding rows' growth, the blocks the longest waiting prompt needs, and the prompt
        positions each queued prompt has left (oldest first) under the step's prefill budget."""
        return Capacity(free_rows=self.free_rows(), free_blocks=self.cache.free_blocks,
                        growth_blocks=self._growth_reserve(), waiting_blocks=self._waiting_prompt_blocks,
                        prefill_waiting=tuple(u.prompt_len - u.prefilled for u in self._prefill_queue
                                              if u.max_frames > 0),
                        prefill_budget=self.prefill_token_budget)

    def check_fits(self, prompt_positions: int) -> None:
        """ValueError for a prompt this source could never admit (longer than the per-stream
        position limit, or more blocks than the whole pool): it must fail, not wait forever."""
        if prompt_positions >= self.max_seq_len:
            raise ValueError(f"prompt of {prompt_positions} positions does not fit max_seq_len {self.max_seq_len}")
        need = self.cache.blocks_for(prompt_positions + 1) + 1
        if need > self.cache.capacity_blocks:
            raise ValueError(f"prompt of {prompt_positions} positions needs {need} KV cache blocks; the pool has "
                             f"{self.cache.capacity_blocks} (raise --kv-cache-gb)")

    def wait_for(self, prompt_positions: int) -> None:
        """The longest prompt waiting for a row, in positions (the scheduler keeps room for it)."""
        self._waiting_prompt_blocks = self.cache.blocks_for(prompt_positions + 1) if prompt_positions else 0

    def _growth_reserve(self) -> int:
        return sum(1 for u in self._utts.values() if u.decoding)

    @property
    def active_slots(self) -> int:
        return len(self._utts)

    @property
    def last_batch_rows(self) -> int:
        """Rows in the last tick's decode step."""
        return self._last_batch_rows

    @property
    def rows(self) -> list[str]:
        """Occupied rows' request ids, by row."""
        return [self._utts[r].request_id for r in sorted(self._utts)]

    def kv_cache_stats(self) -> dict[str, float]:
        c = self.cache
        stats = {"blocks_total": c.capacity_blocks, "blocks_used": c.used_blocks, "block_size": c.block_size,
                 "bytes": c.memory_bytes(), "admission_waits": self.admission_waits, "stalls": self.kv_stalls}
        if self.prefix is not None:  # hits, misses, evictions, positions not prefilled, blocks indexed
            stats.update(self.prefix.stats())
        return stats

    # ---------------------------------------------------------------- admission

    def prompt_positions(self, request: SynthesisRequest, non_streaming_mode: bool | None = None,
                         instruct: str | None = None) -> int:
        """Positions the request's prompt takes (tokenizes; no device work). A live utterance's
        prompt holds its first text id only (streaming-text mode), as an empty text's does."""
        if request.text_feed is not None:
            non_streaming_mode = False
        return len(self.prompt.for_request(request, non_streaming_mode, instruct).text_ids)

    def _ensure_trail(self, length: int) -> None:
        s = self.state
        if s.trail.shape[1] >= length:
            return
        bigger = torch.zeros(s.trail.shape[0], max(length, 2 * s.trail.shape[1]), s.trail.shape[2],
                             dtype=s.trail.dtype, device=s.trail.device)
        bigger[:, : s.trail.shape[1]] = s.trail
        s.trail = bigger
        self.buffers_version += 1

    @torch.no_grad()
    def admit(self, request: SynthesisRequest, max_new_tokens: int | None = None,
              non_streaming_mode: bool | None = None, instruct: str | None = None,
              live: LiveText | None = None) -> None:
        """Tokenize, build the prompt, take a row and the KV blocks of the prompt, queue its
        prefill (done in the next ticks). ValueError for an unknown voice/language or a prompt
        that does not fit; RuntimeError when no row is free; KVPoolExhausted when the pool
        cannot hold the prompt."""
        if any(u.request_id == request.id for u in self._utts.values()):
            raise ValueError(f"request {request.id!r} is already active")
        if not self.free_rows():
            raise RuntimeError("no free talker slot")
        if max_new_tokens is not None:
            request = replace(request, max_new_tokens=max_new_tokens)
        settings = resolve_settings(self.generation, request)
        if live is not None:  # --- live text (issue 16): the prompt of the text committed so far
            prompt = live.prompt(request, instruct=instruct)
        else:
            prompt = self.prompt.for_request(request, non_streaming_mode, instruct)  # task, clone, instructions
        x, trailing, pad = prompt_tensors(self.talker, prompt, self.device)
        s_len = x.shape[0]
        # Frame k's input sits at position s_len + k; the per-stream position limit bounds k.
        n_max = min(settings.max_new_tokens, self.max_seq_len - s_len + 1)
        if n_max < 1:
            raise ValueError(f"prompt of {s_len} positions does not fit max_seq_len {self.max_seq_len}")
        row = min(set(range(self.max_slots)) - set(self._utts))
        keys = self._prefix_keys(request, prompt)
        cached = self._take_blocks(row, s_len, keys)  # raises before anything changes
        st = self.state
        t = trailing.shape[0]
        self._ensure_trail(t + 1)
        st.trail[row, :t] = trailing
        st.trail[row, t] = pad
        st.trail_len[row] = t
        lo, hi = split_seed(request.seed)
        st.seed_lo[row], st.seed_hi[row] = lo, hi
        st.penalty[row] = settings.repetition_penalty
        a, b = settings.talker, settings.predictor
        st.greedy[row], st.temperature[row], st.top_k[row], st.top_p[row] = a.greedy, a.temperature, a.top_k, a.top_p
        st.sub_greedy[row], st.sub_temperature[row] = b.greedy, b.temperature
        st.sub_top_k[row], st.sub_top_p[row] = b.top_k, b.top_p
        st.pos[row] = s_len
        st.ntok[row] = 0
        st.seen[row] = False
        self._admissions += 1
        u = _Utterance(request, row, settings, x, s_len, max_frames=n_max - 1, prefilled=cached, next_pos=s_len,
                       admitted=self._admissions, live=live, prefix_keys=keys)
        self._utts[row] = u
        self._prefill_queue.append(u)

    def _prefix_keys(self, request: SynthesisRequest, prompt) -> list[bytes] | None:
        """The prompt's per-position prefix-cache keys under the request's owner; None when the
        cache is off, or for a cloned voice whose owner is unknown (never shared by accident)."""
        if self.prefix is None:
            return None
        owner = request.prefix_owner if request.prefix_owner is not None else request.tenant
        if request.clone is not None and not owner:
            return None
        return position_keys(owner, prompt.position_inputs())

    def _take_blocks(self, row: int, s_len: int, keys: list[bytes] | None) -> int:
        """The row's blocks for its prompt: an indexed prefix's full blocks shared, its partial
        block copied, the rest new. -> the positions already in the cache (prefill starts
        there). KVPoolExhausted with nothing taken when the pool cannot hold the prompt."""
        cache = self.cache
        if keys is None:
            cache.reserve(row, s_len)
            return 0
        hit = self.prefix.lookup(keys, limit=s_len - 1)
        source = hit.partial[0] if hit.partial else None
        cache.adopt(row, hit.blocks)  # held now: an eviction while reserving cannot take them
        if source is not None:
            cache.hold(source)
        try:
            cache.reserve(row, s_len)
            if source is not None:  # copy-on-write: the row writes its next positions into this block
                cache.copy_positions(source, cache.owned(row)[len(hit.blocks)], hit.partial[1])
        except KVPoolExhausted:
            cache.release(row)
            raise
        finally:
            if source is not None:
                cache.drop(source)
        return hit.positions(cache.block_size)

    # ---------------------------------------------------------------- sampling

    def _sampling(self, idx: torch.Tensor, sub: bool, frame: torch.Tensor, all_greedy: bool,
                  any_top_p: bool) -> FrameSampling:
        st = self.state
        if sub:
            greedy, temp, top_k, top_p = st.sub_greedy, st.sub_temperature, st.sub_top_k, st.sub_top_p
        else:
            greedy, temp, top_k, top_p = st.greedy, st.temperature, st.top_k, st.top_p
        return FrameSampling(st.seed_lo[idx], st.seed_hi[idx], frame, greedy[idx], temp[idx], top_k[idx], top_p[idx],
                             all_greedy=all_greedy, any_top_p=any_top_p)

    def _sample(self, h: torch.Tensor, idx: torch.Tensor, all_greedy: bool, any_top_p: bool) -> torch.Tensor:
        """Code-0 columns [B] for hidden h [B, D] of rows ``idx``; updates the penalty sets."""
        st = self.state
        logits = self.talker.valid_logits(h)  # [B, n_valid]
        ntok = st.ntok[idx]
        scores = apply_talker_processors(logits, st.seen[idx], st.penalty[idx], self.eos_col,
                                         ntok < self.generation.min_new_tokens)
        sampling = self._sampling(idx, sub=False, frame=ntok, all_greedy=all_greedy, any_top_p=any_top_p)
        cols = sample_code0(scores, self.valid_ids, sampling)
        st.seen.index_put_((idx, cols), self._true)  # a device value: no host copy (capture-safe, no sync)
        st.code0.index_copy_(0, idx, cols)  # index_copy_: the same ops at every batch size
        st.ntok.index_copy_(0, idx, ntok + 1)
        return cols

    def _copy_to_host(self, cols: torch.Tensor, request_ids: list[str], buffer: int | None) -> _HostIds:
        n = cols.shape[0]
        host = self._host[buffer] if buffer is not None else torch.zeros(n, dtype=torch.int64,
                                                                        pin_memory=self.device.type == "cuda")
        ids = self.valid_ids[cols]  # codec ids
        event = None
        if self.device.type == "cuda":
            host[:n].copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host[:n].copy_(ids)
        return _HostIds(request_ids, host, event)

    # ---------------------------------------------------------------- prefill

    def _prefill(self, takes: tuple[int, ...]) -> None:
        """Chunks of queued prompts, ``takes`` positions each (oldest first, as the scheduler
        planned under the prefill budget), in one padded talker forward (padding writes into the
        null block); completed prompts sample their code 0 and start decoding."""
        work = [(u, u.prefilled, take) for u, take in zip(self._prefill_queue, takes)]
        if not work:
            return
        self.cache.flush()  # the prompts' blocks (taken at admission) into the device table
        dev = self.device
        x = pad_sequence([u.prompt[start:start + take] for u, start, take in work], batch_first=True)
        width = x.shape[1]
        pos_host = [list(range(start, start + take)) + [0] * (width - take) for _, start, take in work]
        real_host = [[True] * take + [False] * (width - take) for _, _, take in work]
        rows = upload([u.row for u, _, _ in work], torch.int64, dev)
        positions = upload(pos_host, torch.int64, dev)
        slots = torch.where(upload(real_host, torch.bool, dev), self.cache.slots(rows, positions), 0)
        last = upload([take - 1 for _, _, take in work], torch.int64, dev)
        n_blocks = max(self.cache.blocks_for(start + take) for _, start, take in work)
        h = self.talker.forward_paged(x, positions, self.cache, rows, n_blocks, self.rope, last=last,
                                      write_slots=slots)
        done = []
        for i, (u, start, take) in enumerate(work):
            u.prefilled = start + take
            if u.prefilled == u.prompt_len:
                done.append(i)
                if u.prefix_keys is not None:  # its prompt's K/V is queued: later requests may share it
                    self.prefix.insert(u.prefix_keys, self.cache.owned(u.row), u.prompt_len)
                    u.prefix_keys = None
        if not done:
            return
        keep = upload(done, torch.int64, dev)
        utts = [work[i][0] for i in done]
        idx = rows[keep]
        self.state.h.index_copy_(0, idx, h[keep])
        cols = self._sample(h[keep], idx, all_greedy=not any(u.settings.sampled for u in utts),
                            any_top_p=any(u.settings.any_top_p for u in utts))  # code 0 of frame 0
        self._pending.append(self._copy_to_host(cols, [u.request_id for u in utts], buffer=None))
        for u in utts:
            u.prompt = None
            u.decoding = True
        self._prefill_queue = [u for u in self._prefill_queue if not u.decoding]

    # ---------------------------------------------------------------- decode step

    def _rows_to_step(self) -> list[_Utterance]:
        """The utterances that take a decode step this tick, by row. A row left out keeps its
        state untouched and steps again in a later tick: a live row whose next text id has
        not arrived yet (issue 16) sits out until it does."""
        waiting = self._feed_live_text()
        return [self._utts[r] for r in sorted(self._utts) if self._utts[r].decoding and r not in waiting]

    # ---------------------------------------------------------------- live text (issue 16)

    @property
    def pad_part(self) -> torch.Tensor:
        if self._pad_part is None:
            pad = torch.tensor([self.prompt.config.tts_pad_token_id], dtype=torch.long, device=self.device)
            self._pad_part = self.talker.text_part(pad)[0]
        return self._pad_part

    def _feed_live_text(self) -> set[int]:
        """Write newly committed text parts of live rows into ``trail``; -> the rows whose
        next decode step needs a text id that has not arrived yet."""
        waiting: set[int] = set()
        st = self.state
        for row, u in self._utts.items():
            if u.live is None:
                continue
            u.live.pull()
            ids = u.live.trailing_ids()
            if len(ids) > u.fed:
                new = torch.tensor(ids[u.fed:], dtype=torch.long).to(self.device, non_blocking=True)
                self._ensure_trail(len(ids) + 1)
                st.trail[row, u.fed:len(ids)] = self.talker.text_part(new)
                u.fed = len(ids)
                st.trail_len[row] = u.fed
                if u.live.done:
                    st.trail[row, u.fed] = self.pad_part
            steps = u.next_pos - u.prompt_len  # decode step k of the row's next tick
            if not u.live.done and steps >= u.fed:
                waiting.add(row)
        return waiting

    def _text_inputs(self, idx: torch.Tensor, frame_idx: torch.Tensor) -> torch.Tensor:
        """The text part of each stepping row's next talker input [B, D]: THE place where the
        per-step text embedding is chosen (trailing text part k, then tts_pad)."""
        st = self.state
        return st.trail[idx, torch.minimum(frame_idx, st.trail_len[idx])]

    def _grow(self, utts: list[_Utterance]) -> tuple[list[_Utterance], list[TalkerFrames]]:
        """Blocks for each stepping row's next position. A row the pool cannot serve now sits
        this step out (its state is untouched; blocks free up as other streams end). Only when
        no row at all could step (every one waits for blocks, so none would ever free any) the
        youngest waiting stream ends with ``kv_cache_exhausted``: it has outgrown the pool."""
        ok, blocked, failed = [], [], []
        for u in utts:
            try:
                self.cache.reserve(u.row, u.next_pos + 1)
                ok.append(u)
            except KVPoolExhausted as exc:
                blocked.append((u, exc))
        self.kv_stalls += len(blocked)
        if blocked and not ok and not self._prefill_queue:
            u, exc = max(blocked, key=lambda item: item[0].admitted)
            self._release(u)
            failed.append(replace(self._final(u), error=f"kv_cache_exhausted: {exc}"))
        return ok, failed

    def decode_step(self, idx: torch.Tensor, n_blocks: int, all_greedy: bool,
                    any_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-3 for rows ``idx`` [B] (device), all on the device, no host read: the static
        unit a CUDA graph replays (engines/runtime/graphed_talker.py). ``n_blocks`` (host) KV
        blocks are read per row; ``all_greedy`` / ``any_top_p`` pick the sampling ops. Rows may
        repeat the scratch row (padding to a bucket): it writes only into its own state and the
        null block. -> codes of frame k [B, G], code-0 columns of frame k+1 [B]."""
        st = self.state
        # 1. codes 1..G-1 of frame k for every row (k = ntok - 1).
        code0 = self.valid_ids[st.code0[idx]]  # [B]
        frame_idx = st.ntok[idx] - 1
        sub = self._sampling(idx, sub=True, frame=frame_idx, all_greedy=all_greedy, any_top_p=any_top_p)
        rest = self.predictor.predict(st.h[idx], self.talker.codec_part(code0), sub)
        codes = torch.cat([code0[:, None], rest], dim=1)  # [B, G]
        # 2. talker step at each row's own position, over the paged cache (the clamp only ever
        # holds the scratch row inside the rotary table: real rows end before max_seq_len).
        x = frame_embedding(self.talker, self.predictor, codes) + self._text_inputs(idx, frame_idx)  # [B, D]
        pos = st.pos[idx].clamp_max(self.max_seq_len - 1)
        h = self.talker.forward_paged(x[:, None], pos[:, None], self.cache, idx, n_blocks, self.rope)
        st.h.index_copy_(0, idx, h)
        st.pos.index_copy_(0, idx, pos + 1)
        # 3. code 0 of frame k+1.
        return codes, self._sample(h, idx, all_greedy=all_greedy, any_top_p=any_top_p)

    def step_spec(self) -> StepSpec:
        """What a :class:`GraphedTalkerStep` captures: :meth:`decode_step` and its static sizes."""
        def before_capture(rows: int) -> None:
            self.predictor.ensure_cache(rows, self.device, self.dtype)

        def compiled() -> bool:
            return self.predictor.layer_step is not None or self.talker.layer_step is not None

        def uncompile() -> None:
            self.predictor.layer_step = None
            self.talker.layer_step = None

        return StepSpec(step=self.decode_step, max_rows=self.max_slots, scratch_row=self.scratch_row,
                        max_blocks_per_row=self.cache.max_blocks_per_row, device=self.device,
                        buffers_version=lambda: self.buffers_version, before_capture=before_capture,
                        compile_layers=lambda backend: self.predictor.compile_layers(backend=backend),
                        compiled=compiled, uncompile=uncompile)

    def _eager_step(self, rows: list[int], n_blocks: int, all_greedy: bool,
                    any_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
        idx = upload(rows, torch.int64, self.device)  # no stream sync for the upload
        return self.decode_step(idx, n_blocks, all_greedy, any_top_p)

    def _decode(self, utts: list[_Utterance]) -> list[TalkerFrames]:
        """One decode step of ``utts`` (steps 1-4 of the module docstring)."""
        n_blocks = max(self.cache.row_blocks(u.row) for u in utts)
        run = self.step_runner or self._eager_step
        codes, new_cols = run([u.row for u in utts], n_blocks, not any(u.settings.sampled for u in utts),
                              any(u.settings.any_top_p for u in utts))
        for u in utts:
            u.next_pos += 1
        self._host_flip = 1 - self._host_flip  # the new ids' host copy starts now
        in_flight = self._copy_to_host(new_cols, [u.request_id for u in utts], buffer=self._host_flip)

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
            last = u.frames + 1 >= u.max_frames
            out.append(TalkerFrames(u.request_id, frames[i], u.frames, last))
            u.frames += 1
            u.code0 = None  # the value for the next step arrives with ``in_flight``
            if last:
                self._release(u)
        return out

    @torch.no_grad()
    def tick(self, plan: StepPlan) -> list[TalkerFrames]:
        """The scheduler's prefill positions (``plan``, from :meth:`capacity`), then one decode
        step of the rows that step."""
        out: list[TalkerFrames] = []
        # Utterances allowed no frame at all (max_new_tokens <= 1) end before any compute
        # (``capacity`` left them out of the prefill queue it reported).
        for u in [u for u in self._utts.values() if u.max_frames <= 0]:
            out.append(self._final(u))
            self._release(u)
        self.admission_waits += plan.kv_wait
        self._prefill(plan.prefill)
        utts, failed = self._grow(self._rows_to_step())
        self.cache.flush()
        out += failed
        self._last_batch_rows = len(utts)
        if utts:
            out += self._decode(utts)
        return out

    def _final(self, u: _Utterance) -> TalkerFrames:
        empty = torch.zeros(0, self.num_code_groups, dtype=torch.int64, device=self.device)
        return TalkerFrames(u.request_id, empty, u.frames, True)

    # ---------------------------------------------------------------- removal

    def cancel(self, request_id: str) -> bool:
        for u in list(self._utts.values()):
            if u.request_id == request_id:
                self._release(u)
                return True
        return False

    def _release(self, u: _Utterance) -> None:
        """The row and its KV blocks are free again; nothing else moves."""
        if self._utts.get(u.row) is u:
            del self._utts[u.row]
            self.cache.release(u.row)
            if u in self._prefill_queue:
                self._prefill_queue.remove(u)


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
