"""The Qwen3-TTS talker as a latent source: continuous batching of utterances.

    source = TalkerSource.from_bundle(TalkerBundle.from_checkpoint(path, device, dtype), max_slots=8)
    source.admit(request)              # between ticks: tokenize, build the prompt, prefill, sample code 0
    frames = source.tick()             # ONE talker step for every active utterance
    # -> [TalkerFrames(request_id, codes [n, G], frame_start, is_last), ...]

State lives in device tensors with one row per active utterance, rows 0..n-1 always the
active ones (finished or cancelled rows are filled by moving the last rows into the
holes, so a step never touches a dead row); ``rows`` is the row -> request map.
Per row: a static KV cache [KVH, L, hd] per layer, the last talker hidden h, the
current code-0 column, its position, its token count, the repetition-penalty set, its
trailing text parts and its sampling settings.

One tick, for the n active rows (all on the device, no host reads until step 4):
 1. code predictor on [h, emb(code 0)] -> codes 1..G-1: frame k of every row;
 2. next talker input = sum of the frame's G code embeddings + the row's text part
    for step k (trailing text, then tts_pad); one talker forward at each row's position;
 3. code-0 logits over the compact valid range only (codebook + EOS), the official
    processors (repetition penalty over the row's generated ids, EOS blocked before
    min_new_tokens) and on-device sampling; the new ids go to the *other* of two id
    buffers, whose copy to the host starts right away (non_blocking + event on CUDA);
 4. the host reads the ids of the PREVIOUS step (copied while this step was queued):
    a row whose code 0 was EOS ends (its frame from step 1 is dropped, EOS is not a
    frame) with an empty ``is_last`` TalkerFrames; any other row emits its frame;
    a row that reached max_new_tokens - 1 frames ends with that frame (``is_last``).
So EOS is noticed one step late (one wasted row-step per utterance) in exchange for
never waiting on the device inside a step.

Greedy codes equal :func:`engines.pipelines.talker.reference.generate_codes` (and the official
``generate_custom_voice``) whatever shares the batch; sampled codes too, since the noise is
keyed by (seed, token index, id) (engines/models/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.checkpoints.qwen3_tts import TalkerGenerationConfig
from engines.contract import SynthesisRequest
from engines.devices import canonical_device, upload
from engines.models.code_predictor import CodePredictor
from engines.models.sampling import (
    FrameSampling,
    apply_talker_processors,
    sample_code0,
    split_seed,
)
from engines.models.talker import Talker
from engines.pipelines.talker.live_text import LiveText
from engines.pipelines.talker.prompt import PromptBuilder
from engines.pipelines.talker.reference import (
    TalkerBundle,
    frame_embedding,
    prompt_tensors,
)


@dataclass(frozen=True)
class TalkerFrames:
    request_id: str
    codes: torch.Tensor  # [n, G] int64 on the device: frames finished this tick (n = 1, or 0 on an EOS end)
    frame_start: int  # global index of codes[0] in the utterance
    is_last: bool  # EOS reached (or max tokens): the utterance is complete


@dataclass
class _Utterance:
    request: SynthesisRequest
    prompt_len: int
    max_frames: int  # max_new_tokens - 1 (bounded by the cache length)
    next_pos: int  # host copy of the row's next talker position
    frames: int = 0  # frames emitted so far
    code0: int | None = None  # host value of the row's current code 0, once its copy landed
    live: LiveText | None = None  # issue 16: text still arriving (live_text.py)
    fed: int = 0  # live: trailing text parts written into the row's ``trail`` so far

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
    """Per-row device state, capacity R rows; rows [0, n) are active."""

    h: torch.Tensor  # [R, D] talker hidden after the final norm, last position
    ids: list[torch.Tensor]  # 2 x [R] int64 compact code-0 columns (alternating buffers)
    pos: torch.Tensor  # [R] int64 next talker position
    ntok: torch.Tensor  # [R] int64 code-0 tokens sampled so far
    seen: torch.Tensor  # [R, n_valid] bool: repetition-penalty set
    trail: torch.Tensor  # [R, Tcap, D] trailing text parts; trail[r, trail_len[r]] = tts_pad part
    trail_len: torch.Tensor  # [R] int64
    seed_lo: torch.Tensor
    seed_hi: torch.Tensor
    greedy: torch.Tensor  # [R] bool (talker)
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    sub_greedy: torch.Tensor  # [R] bool (code predictor)
    sub_temperature: torch.Tensor
    sub_top_k: torch.Tensor
    sub_top_p: torch.Tensor
    per_row: tuple[str, ...] = field(default=("h", "pos", "ntok", "seen", "trail", "trail_len", "seed_lo", "seed_hi",
                                              "greedy", "temperature", "top_k", "top_p", "sub_greedy",
                                              "sub_temperature", "sub_top_k", "sub_top_p"))


class TalkerSource:
    """Continuous batching of talker utterances (see the module docstring)."""

    def __init__(self, talker: Talker, predictor: CodePredictor, prompt: PromptBuilder,
                 generation: TalkerGenerationConfig, device, dtype: torch.dtype, max_slots: int = 8,
                 max_seq_len: int = 2048):
        if max_slots <= 0:
            raise ValueError(f"max_slots must be > 0, got {max_slots}")
        self.talker = talker.eval()
        self.predictor = predictor.eval()
        self.prompt = prompt
        self.generation = generation
        self.device = canonical_device(device)
        self.dtype = dtype
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        cfg = talker.cfg
        self.num_code_groups = cfg.num_code_groups
        self.valid_ids = talker.valid_ids.to(self.device)  # [n_valid] compact column -> codec id
        n_valid = self.valid_ids.numel()
        self.eos_col = int((self.valid_ids == cfg.codec_eos_token_id).nonzero()[0, 0])
        self.cache = talker.new_cache(max_slots, max_seq_len, self.device, dtype)
        r, d, dev = max_slots, cfg.hidden_size, self.device

        def z(*shape, dt=torch.int64):
            return torch.zeros(*shape, dtype=dt, device=dev)

        self.state = _Rows(
            h=z(r, d, dt=dtype), ids=[z(r), z(r)], pos=z(r), ntok=z(r), seen=z(r, n_valid, dt=torch.bool),
            trail=z(r, 8, d, dt=dtype), trail_len=z(r), seed_lo=z(r), seed_hi=z(r), greedy=z(r, dt=torch.bool),
            temperature=z(r, dt=torch.float32), top_k=z(r), top_p=z(r, dt=torch.float32),
            sub_greedy=z(r, dt=torch.bool), sub_temperature=z(r, dt=torch.float32), sub_top_k=z(r),
            sub_top_p=z(r, dt=torch.float32))
        self._flip = 0  # which id buffer holds the current code-0 columns
        cuda = self.device.type == "cuda"
        self._host = [torch.zeros(r, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._rows: list[_Utterance] = []
        self._pending: list[_HostIds] = []
        self._last_batch_rows = 0
        self._any_sampled = False
        self._any_top_p = False
        self._pad_part: torch.Tensor | None = None  # live text: the tts_pad text part

    @classmethod
    def from_bundle(cls, bundle: TalkerBundle, max_slots: int = 8, max_seq_len: int = 2048) -> "TalkerSource":
        return cls(bundle.talker, bundle.predictor, bundle.prompt, bundle.generation, bundle.device, bundle.dtype,
                   max_slots=max_slots, max_seq_len=max_seq_len)

    # ---------------------------------------------------------------- introspection

    def voices(self) -> list[str]:
        return self.prompt.voices()

    def languages(self) -> list[str]:
        return self.prompt.languages()

    def free_slots(self) -> int:
        return self.max_slots - len(self._rows)

    @property
    def active_slots(self) -> int:
        return len(self._rows)

    @property
    def last_batch_rows(self) -> int:
        """Rows in the last tick's talker forward (= active utterances then)."""
        return self._last_batch_rows

    @property
    def rows(self) -> list[str]:
        """Active row -> request id (the compact batch order of the next tick)."""
        return [u.request_id for u in self._rows]

    # ---------------------------------------------------------------- admission

    def _ensure_trail(self, length: int) -> None:
        s = self.state
        if s.trail.shape[1] >= length:
            return
        bigger = torch.zeros(s.trail.shape[0], max(length, 2 * s.trail.shape[1]), s.trail.shape[2],
                             dtype=s.trail.dtype, device=s.trail.device)
        bigger[:, : s.trail.shape[1]] = s.trail
        s.trail = bigger

    @torch.no_grad()
    def admit(self, request: SynthesisRequest, max_new_tokens: int | None = None,
              non_streaming_mode: bool | None = None, instruct: str | None = None,
              live: LiveText | None = None) -> None:
        """Tokenize, build the prompt, prefill (K/V for every prompt position, the head only
        for the last) and sample code 0. ValueError for an unknown voice/language or a
        prompt that does not fit; RuntimeError when no slot is free."""
        if any(u.request_id == request.id for u in self._rows):
            raise ValueError(f"request {request.id!r} is already active")
        if not self.free_slots():
            raise RuntimeError("no free talker slot")
        gen = self.generation
        if live is not None:  # --- live text (issue 16): the prompt of the text committed so far
            prompt = live.prompt(request, instruct=instruct)
        else:
            prompt = self.prompt.for_request(request, non_streaming_mode, instruct)  # task, clone, instructions
        x, trailing, pad = prompt_tensors(self.talker, prompt, self.device)
        s_len = x.shape[0]
        n_max = gen.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        # Frame k's input sits at position s_len + k; the cache bounds k.
        n_max = min(n_max, self.max_seq_len - s_len + 1)
        if n_max < 1:
            raise ValueError(f"prompt of {s_len} positions does not fit max_seq_len {self.max_seq_len}")
        r = len(self._rows)
        st = self.state
        h = self.talker(x[None], torch.arange(s_len, device=self.device)[None], self.cache, row0=r,
                        attend_len=s_len)  # [1, D]
        st.h[r] = h[0]
        t = trailing.shape[0]
        self._ensure_trail(t + 1)
        st.trail[r, :t] = trailing
        st.trail[r, t] = pad
        st.trail_len[r] = t
        lo, hi = split_seed(request.seed)
        talker_greedy = request.greedy or not gen.do_sample
        st.seed_lo[r], st.seed_hi[r] = lo, hi
        st.greedy[r] = talker_greedy
        st.temperature[r], st.top_k[r], st.top_p[r] = request.temperature, request.top_k, request.top_p
        sub_greedy = request.greedy or not gen.subtalker_dosample
        st.sub_greedy[r] = sub_greedy
        st.sub_temperature[r], st.sub_top_k[r] = gen.subtalker_temperature, gen.subtalker_top_k
        st.sub_top_p[r] = gen.subtalker_top_p
        st.pos[r] = s_len
        st.ntok[r] = 0
        st.seen[r] = False
        self._any_sampled |= not talker_greedy or not sub_greedy
        self._any_top_p |= request.top_p < 1.0 or gen.subtalker_top_p < 1.0
        cols = self._sample(h, slice(r, r + 1))  # code 0 of frame 0
        st.ids[self._flip][r] = cols[0]
        st.ntok[r] = 1
        self._rows.append(_Utterance(request, s_len, max_frames=n_max - 1, next_pos=s_len, live=live))
        self._pending.append(self._copy_to_host(cols, [request.id], buffer=None))

    # ---------------------------------------------------------------- steps

    def _sampling(self, rows: slice, sub: bool, frame: torch.Tensor) -> FrameSampling:
        st = self.state
        if sub:
            greedy, temp, top_k, top_p = st.sub_greedy, st.sub_temperature, st.sub_top_k, st.sub_top_p
        else:
            greedy, temp, top_k, top_p = st.greedy, st.temperature, st.top_k, st.top_p
        return FrameSampling(st.seed_lo[rows], st.seed_hi[rows], frame, greedy[rows], temp[rows], top_k[rows],
                             top_p[rows], all_greedy=not self._any_sampled, any_top_p=self._any_top_p)

    def _sample(self, h: torch.Tensor, rows: slice) -> torch.Tensor:
        """Code-0 columns [B] for hidden h [B, D] of rows ``rows``; updates the penalty set."""
        st = self.state
        logits = self.talker.valid_logits(h)  # [B, n_valid]
        ntok = st.ntok[rows]
        scores = apply_talker_processors(logits, st.seen[rows], self.generation.repetition_penalty, self.eos_col,
                                         ntok < self.generation.min_new_tokens)
        cols = sample_code0(scores, self.valid_ids, self._sampling(rows, sub=False, frame=ntok))
        st.seen[rows].scatter_(1, cols[:, None], True)
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

    @torch.no_grad()
    def tick(self) -> list[TalkerFrames]:
        """One talker step (and the code predictor for its frames) for all active utterances."""
        out: list[TalkerFrames] = []
        # Utterances allowed no frame at all (max_new_tokens <= 1) end before any compute.
        empty = [i for i, u in enumerate(self._rows) if u.max_frames <= 0]
        if empty:
            out += [self._final(self._rows[i]) for i in empty]
            self._remove(empty)
        b = len(self._rows)
        # --- live text (issue 16): new text parts into ``trail``; rows still waiting for
        # their next text id sit this step out (masked below: no state change, no frame).
        waiting = self._feed_live_text()
        self._last_batch_rows = b - len(waiting)
        if b == 0 or len(waiting) == b:
            return out
        step_mask = None
        if waiting:
            step_mask = upload([i not in waiting for i in range(b)], torch.bool, self.device)
            seen_before = self.state.seen[:b].clone()
        # --- end live text
        st, rows = self.state, slice(0, b)
        cur, nxt = self._flip, 1 - self._flip

        # 1. codes 1..G-1 of frame k for every row (k = ntok - 1).
        cols = st.ids[cur][:b]
        code0 = self.valid_ids[cols]  # [B]
        frame_idx = st.ntok[:b] - 1
        rest = self.predictor.predict(st.h[:b], self.talker.codec_part(code0),
                                      self._sampling(rows, sub=True, frame=frame_idx))
        codes = torch.cat([code0[:, None], rest], dim=1)  # [B, G]
        # 2. talker step at each row's own position.
        text = st.trail[torch.arange(b, device=self.device), torch.minimum(frame_idx, st.trail_len[:b])]
        x = frame_embedding(self.talker, self.predictor, codes) + text  # [B, D]
        attend = max(u.next_pos for u in self._rows) + 1
        h = self.talker(x[:, None], st.pos[:b, None], self.cache, row0=0, attend_len=attend)
        # 3. code 0 of frame k+1 into the other buffer; its host copy starts now.
        new_cols = self._sample(h, rows)
        if step_mask is not None:  # live text: waiting rows keep their state (their K/V write at
            # ``pos`` is overwritten when they really take this step)
            h = torch.where(step_mask[:, None], h, st.h[:b])
            new_cols = torch.where(step_mask, new_cols, cols)
            st.seen[:b] = torch.where(step_mask[:, None], st.seen[:b], seen_before)
            st.pos[:b] += step_mask
            st.ntok[:b] += step_mask
        else:
            st.pos[:b] += 1
            st.ntok[:b] += 1
        st.h[:b] = h
        for i, u in enumerate(self._rows):
            if i not in waiting:
                u.next_pos += 1
        st.ids[nxt][:b] = new_cols
        self._flip = nxt
        in_flight = self._copy_to_host(new_cols, self.rows, buffer=nxt)

        # 4. host: the previous step's ids (admission or last tick) decide who ends.
        by_id = {u.request_id: u for u in self._rows}
        for record in self._pending:
            for rid, value in zip(record.request_ids, record.resolve()):
                if rid in by_id:
                    by_id[rid].code0 = value
        self._pending = [in_flight]
        eos = self.talker.cfg.codec_eos_token_id
        done: list[int] = []
        for i, u in enumerate(self._rows):
            if u.code0 is None:
                raise RuntimeError(f"talker: code 0 of {u.request_id!r} never reached the host")
            if u.code0 == eos:
                out.append(self._final(u))
                done.append(i)
                continue
            if i in waiting:  # live text: frame k is emitted when the row takes its step
                continue
            last = u.frames + 1 >= u.max_frames
            out.append(TalkerFrames(u.request_id, codes[i:i + 1], u.frames, last))
            u.frames += 1
            if last:
                done.append(i)
        for u in self._rows:
            u.code0 = None  # the value for the next step arrives with ``in_flight``
        if done:
            self._remove(done)
        return out

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
        for i, u in enumerate(self._rows):
            if u.live is None:
                continue
            u.live.pull()
            ids = u.live.trailing_ids()
            if len(ids) > u.fed:
                new = torch.tensor(ids[u.fed:], dtype=torch.long).to(self.device, non_blocking=True)
                self._ensure_trail(len(ids) + 1)
                st.trail[i, u.fed:len(ids)] = self.talker.text_part(new)
                u.fed = len(ids)
                st.trail_len[i] = u.fed
                if u.live.done:
                    st.trail[i, u.fed] = self.pad_part
            steps = u.next_pos - u.prompt_len  # decode step k of the row's next tick
            if not u.live.done and steps >= u.fed:
                waiting.add(i)
        return waiting

    def _final(self, u: _Utterance) -> TalkerFrames:
        empty = torch.zeros(0, self.num_code_groups, dtype=torch.int64, device=self.device)
        return TalkerFrames(u.request_id, empty, u.frames, True)

    # ---------------------------------------------------------------- removal / compaction

    def cancel(self, request_id: str) -> bool:
        for i, u in enumerate(self._rows):
            if u.request_id == request_id:
                self._remove([i])
                return True
        return False

    def _remove(self, indices: list[int]) -> None:
        """Drop rows; the last surviving rows move into the holes (state, ids and KV cache)."""
        n = len(self._rows)
        gone = set(indices)
        n_new = n - len(gone)
        holes = sorted(i for i in gone if i < n_new)
        movers = sorted(i for i in range(n_new, n) if i not in gone)
        if movers:
            src = upload(movers, torch.int64, self.device)  # no stream sync for the upload
            dst = upload(holes, torch.int64, self.device)
            length = max(self._rows[i].next_pos for i in movers)
            self.cache.move_rows(src, dst, length)
            st = self.state
            for name in st.per_row:
                t = getattr(st, name)
                t[dst] = t[src]
            for buf in st.ids:
                buf[dst] = buf[src]
            for m, h in zip(movers, holes):
                self._rows[h] = self._rows[m]
        del self._rows[n_new:]
        if not self._rows:
            self._any_sampled = self._any_top_p = False


__all__ = ["TalkerFrames", "TalkerSource"]
