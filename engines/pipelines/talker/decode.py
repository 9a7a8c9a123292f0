"""The talker's decode step on the device (steps 1-3 of source.py's docstring) and the code-0
sampling prefill shares: no host read, the same ops at every batch size, so a CUDA graph can
replay it (engines/runtime/graphed_talker.py, handed :meth:`DecodeStep.spec`)."""

from __future__ import annotations

import torch

from engines.checkpoints.qwen3_tts import TalkerGenerationConfig
from engines.models.code_predictor import CodePredictor
from engines.models.paged_kv import PagedKVCache
from engines.models.sampling import FrameSampling, apply_talker_processors, sample_code0
from engines.models.talker import Talker
from engines.pipelines.talker.reference import frame_embedding
from engines.pipelines.talker.rows import HostIds, RowState
from engines.runtime.graphed_talker import StepSpec


class DecodeStep:
    """The device side of one talker step over rows of ``state``."""

    def __init__(self, talker: Talker, predictor: CodePredictor, generation: TalkerGenerationConfig,
                 state: RowState, cache: PagedKVCache, rope, max_seq_len: int, device, dtype: torch.dtype):
        self.talker = talker
        self.predictor = predictor
        self.generation = generation
        self.state = state
        self.cache = cache
        self.rope = rope
        self.max_seq_len = max_seq_len
        self.device = device
        self.dtype = dtype
        cfg = talker.cfg
        self.valid_ids = talker.valid_ids.to(device)  # [n_valid] compact column -> codec id
        self.eos_col = int((self.valid_ids == cfg.codec_eos_token_id).nonzero()[0, 0])
        self._true = torch.ones((), dtype=torch.bool, device=device)  # the value the penalty-set update writes
        # the quantized talker's frame in one native call on a CPU (engines/models/quantize_native.py)
        self.native_frame = getattr(talker, "native_frame", None) if device.type == "cpu" else None
        rows = state.h.shape[0]
        self._host = [torch.zeros(rows, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(2)]
        self._host_flip = 0

    def _sampling(self, idx: torch.Tensor, sub: bool, frame: torch.Tensor, all_greedy: bool,
                  any_top_p: bool) -> FrameSampling:
        st = self.state
        if sub:
            greedy, temp, top_k, top_p = st.sub_greedy, st.sub_temperature, st.sub_top_k, st.sub_top_p
        else:
            greedy, temp, top_k, top_p = st.greedy, st.temperature, st.top_k, st.top_p
        return FrameSampling(st.seed_lo[idx], st.seed_hi[idx], frame, greedy[idx], temp[idx], top_k[idx], top_p[idx],
                             all_greedy=all_greedy, any_top_p=any_top_p)

    def sample(self, h: torch.Tensor, idx: torch.Tensor, all_greedy: bool, any_top_p: bool) -> torch.Tensor:
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

    def copy_to_host(self, cols: torch.Tensor, request_ids: list[str], flip: bool = False) -> HostIds:
        """Start the sampled ids' copy to the host. ``flip``: into the other of the two step
        buffers (a decode step's); else into a fresh one (prefill's)."""
        n = cols.shape[0]
        if flip:
            self._host_flip = 1 - self._host_flip
            host = self._host[self._host_flip]
        else:
            host = torch.zeros(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        ids = self.valid_ids[cols]  # codec ids
        event = None
        if self.device.type == "cuda":
            host[:n].copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host[:n].copy_(ids)
        return HostIds(request_ids, host, event)

    def _text_inputs(self, idx: torch.Tensor, frame_idx: torch.Tensor) -> torch.Tensor:
        """The text part of each stepping row's next talker input [B, D]: THE place where the
        per-step text embedding is chosen (trailing text part k, then tts_pad)."""
        st = self.state
        return st.trail[idx, torch.minimum(frame_idx, st.trail_len[idx])]

    def __call__(self, idx: torch.Tensor, n_blocks: int, all_greedy: bool,
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
        if self.native_frame is not None and not any_top_p:  # steps 1-2 in one native call (top-p: below)
            return self._native_step(idx, code0, frame_idx, sub, all_greedy)
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
        return codes, self.sample(h, idx, all_greedy=all_greedy, any_top_p=any_top_p)

    def _native_step(self, idx: torch.Tensor, code0: torch.Tensor, frame_idx: torch.Tensor, sub: FrameSampling,
                     all_greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-2 as one call of the native frame (the same sampling keys), step 3 as above."""
        from engines.models.layers import prepare_rope
        from engines.models.quantize_native import predictor_gumbel

        st, frame = self.state, self.native_frame
        gumbel = None if all_greedy else predictor_gumbel(sub, frame.groups, frame.vocab)
        pos = st.pos[idx].clamp_max(self.max_seq_len - 1)
        cos, sin = prepare_rope(self.rope[0][pos][:, None], self.rope[1][pos][:, None])  # [B, 1, 1, hd]
        codes, h, _ = frame(st.h[idx], code0, sub, gumbel, self._text_inputs(idx, frame_idx),
                            (cos.flatten(1), sin.flatten(1)), self.cache, self.cache.slots(idx, pos[:, None])[:, 0],
                            self.cache.table[idx], pos + 1)
        st.h.index_copy_(0, idx, h)
        st.pos.index_copy_(0, idx, pos + 1)
        return codes, self.sample(h, idx, all_greedy=all_greedy, any_top_p=False)

    def spec(self, max_rows: int, scratch_row: int) -> StepSpec:
        """What a GraphedTalkerStep captures: this step and its static sizes."""
        def before_capture(rows: int) -> None:
            self.predictor.ensure_cache(rows, self.device, self.dtype)

        def compiled() -> bool:
            return self.predictor.layer_step is not None or self.talker.layer_step is not None

        def uncompile() -> None:
            self.predictor.layer_step = None
            self.talker.layer_step = None

        return StepSpec(step=self, max_rows=max_rows, scratch_row=scratch_row,
                        max_blocks_per_row=self.cache.max_blocks_per_row, device=self.device,
                        buffers_version=lambda: self.state.version, before_capture=before_capture,
                        compile_layers=lambda backend: self.predictor.compile_layers(backend=backend),
                        compiled=compiled, uncompile=uncompile,
                        bucket_blocks=not self.cache.reads_in_place)


__all__ = ["DecodeStep"]
