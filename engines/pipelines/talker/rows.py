"""The talker batch's rows: per-row device state, a request's resolved decoding settings, one
utterance's host-side bookkeeping, and the in-flight copies of sampled ids.

Rows are stable: an utterance keeps its row from admission to its end. Row ``max_slots`` is the
scratch row: padding of a static batch bucket steps it (its block table stays null); it never
holds an utterance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.checkpoints.qwen3_tts import TalkerGenerationConfig
from engines.contract import SynthesisRequest
from engines.models.sampling import SamplingSettings, split_seed
from engines.pipelines.talker.guard import LoopGuard
from engines.pipelines.talker.live_text import LiveText
from engines.pipelines.talker.prompt import TalkerPrompt


@dataclass(frozen=True)
class TalkerFrames:
    request_id: str
    codes: torch.Tensor  # [n, G] int64 on the device: frames finished this tick (n = 1, or 0 on an end)
    frame_start: int  # global index of codes[0] in the utterance
    is_last: bool  # EOS reached (or max tokens, or an error): the utterance is complete
    error: str | None = None  # the utterance failed (e.g. the KV pool could not hold it)
    truncated: str | None = None  # it ended before EOS: what cut it (Utterance.limit_reason, or "loop")


@dataclass(frozen=True)
class RowSettings:
    """A request's sampling, resolved against the checkpoint's generation config (its frame limit is
    its planned budget: budget.py)."""

    talker: SamplingSettings  # code 0
    predictor: SamplingSettings  # codes 1..G-1
    repetition_penalty: float

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
    return RowSettings(talker, predictor, penalty)


@dataclass
class Utterance:
    request: SynthesisRequest
    row: int
    settings: RowSettings
    prompt: torch.Tensor | None  # [S, D] prefill inputs from its start until prefilled
    prompt_len: int
    max_frames: int  # the most frames it may take: its text's budget, max_new_tokens - 1, its positions
    limit_reason: str = "max_new_tokens"  # which of them sets max_frames ("budget", "max_new_tokens", "max_seq_len")
    budgeted: bool = True  # its text's budget applies (False: admitted with an exact max_new_tokens)
    prefilled: int = 0  # prompt positions in the cache
    decoding: bool = False  # prefill done, code 0 of frame 0 sampled
    next_pos: int = 0  # host copy of the row's next talker position
    frames: int = 0  # frames emitted so far
    code0: int | None = None  # host value of the row's current code 0, once its copy landed
    admitted: int = 0  # admission order (the youngest ends first when the pool is deadlocked)
    live: LiveText | None = None  # text still arriving (live_text.py)
    fed: int = 0  # live: trailing text parts written into the row's ``trail`` so far
    prefix_keys: list[bytes] | None = None  # per-position prefix-cache keys (None: not cacheable)
    guard: LoopGuard = field(default_factory=LoopGuard)  # its code-0 loop test (guard.py)
    talker_prompt: TalkerPrompt | None = None  # the prompt's ids, admitted until its row starts (batch.py)

    @property
    def request_id(self) -> str:
        return self.request.id


@dataclass
class HostIds:
    """A device->host copy of sampled code-0 ids in flight: which request each entry is for."""

    request_ids: list[str]
    host: torch.Tensor  # [n] int64 (pinned on CUDA)
    event: object | None = None  # torch.cuda.Event on CUDA

    def resolve(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()  # type: ignore[attr-defined]
        return self.host[: len(self.request_ids)].tolist()


@dataclass
class RowState:
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


    version: int = 0  # bumped when a per-row buffer is reallocated (captured graphs must recapture)

    @classmethod
    def allocate(cls, rows: int, hidden: int, n_valid: int, dtype: torch.dtype, device) -> "RowState":
        """Zeroed state for ``rows`` rows (the slots plus the scratch row)."""
        def z(*shape, dt=torch.int64):
            return torch.zeros(*shape, dtype=dt, device=device)

        r, d, f32 = rows, hidden, torch.float32
        return cls(
            h=z(r, d, dt=dtype), code0=z(r), pos=z(r), ntok=z(r), seen=z(r, n_valid, dt=torch.bool),
            trail=z(r, 8, d, dt=dtype), trail_len=z(r), seed_lo=z(r), seed_hi=z(r), penalty=z(r, dt=f32),
            greedy=z(r, dt=torch.bool), temperature=z(r, dt=f32), top_k=z(r), top_p=z(r, dt=f32),
            sub_greedy=z(r, dt=torch.bool), sub_temperature=z(r, dt=f32), sub_top_k=z(r), sub_top_p=z(r, dt=f32))

    def ensure_trail(self, length: int) -> None:
        """Room for ``length`` trailing text parts per row (the buffer doubles; ``version`` changes)."""
        if self.trail.shape[1] >= length:
            return
        bigger = torch.zeros(self.trail.shape[0], max(length, 2 * self.trail.shape[1]), self.trail.shape[2],
                             dtype=self.trail.dtype, device=self.trail.device)
        bigger[:, : self.trail.shape[1]] = self.trail
        self.trail = bigger
        self.version += 1

    def start(self, rows: list[int], requests: list[SynthesisRequest], settings: list[RowSettings],
              trailings: list[torch.Tensor], pad: torch.Tensor, prompt_lens: list[int]) -> None:
        """New utterances' rows: their trailing text parts, seeds, sampling settings, positions,
        written with one indexed copy per field whatever the number of rows (each write is a
        kernel launch on a GPU)."""
        lengths = [t.shape[0] for t in trailings]
        self.ensure_trail(max(lengths) + 1)
        device = self.trail.device
        idx = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        # trail[row, :t] = its trailing parts, trail[row, t] = tts_pad: one scatter for all rows
        cols = torch.cat([torch.arange(t + 1) for t in lengths]).to(device, non_blocking=True)
        at = torch.tensor([r for r, t in zip(rows, lengths) for _ in range(t + 1)]).to(device, non_blocking=True)
        self.trail[at, cols] = torch.cat([part for t in trailings for part in (t, pad[None])])

        def put(field: torch.Tensor, values: list) -> None:
            field[idx] = torch.tensor(values, dtype=field.dtype).to(device, non_blocking=True)

        seeds = [split_seed(r.seed) for r in requests]
        put(self.trail_len, lengths)
        put(self.seed_lo, [lo for lo, _ in seeds])
        put(self.seed_hi, [hi for _, hi in seeds])
        put(self.penalty, [s.repetition_penalty for s in settings])
        put(self.greedy, [s.talker.greedy for s in settings])
        put(self.temperature, [s.talker.temperature for s in settings])
        put(self.top_k, [s.talker.top_k for s in settings])
        put(self.top_p, [s.talker.top_p for s in settings])
        put(self.sub_greedy, [s.predictor.greedy for s in settings])
        put(self.sub_temperature, [s.predictor.temperature for s in settings])
        put(self.sub_top_k, [s.predictor.top_k for s in settings])
        put(self.sub_top_p, [s.predictor.top_p for s in settings])
        put(self.pos, prompt_lens)
        self.ntok[idx] = 0
        self.seen[idx] = False


__all__ = ["HostIds", "RowSettings", "RowState", "TalkerFrames", "Utterance", "resolve_settings"]
