"""The stream tick loop: many frame chunks denoised together, each at its own step.

A *slot* holds one chunk of one request: its noisy frames, the clean context frames
before them, its own shifted schedule and its guidance settings. Every :meth:`tick`
advances every active slot by one Euler step with ONE batched DiT forward (positive
and negative CFG rows together when they fit the batch ceiling, else two passes).

Rules this module keeps (ARCHITECTURE.md, "Tick-loop rules"):

1. one batched forward per tick; the first output is copied out before a second pass;
2. padded encoder states are memoized across ticks, keyed by the identity of the
   rows' tensors (the memo holds references, so ids cannot be recycled);
3. no host reads in the tick: every decision comes from host-known values (step
   counters, schedules, flags) set at admission;
4. Euler updates are ``torch._foreach_*`` launches with host-side ``dt`` scalars;
5. noise, schedule and the guidance flag are decided once, in :meth:`admit`.

Randomness: a chunk's initial noise is ``keyed_normal(seed, DOMAIN_NOISE, global
frame indices)``, so it depends only on the request's seed and the frames' positions,
never on what else shares the batch.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engines.hardware.devices import canonical_device, upload
from engines.models.configs import StreamConfig
from engines.models.dit import FlowDiT
from engines.models.sampling import DOMAIN_NOISE, keyed_normal

GUIDANCE_MODES = ("none", "cfg", "apg")
GUIDANCE_TIMINGS = ("full", "initialize")
APG_MOMENTUM = -0.75
APG_NORM_THRESHOLD = 2.5


@dataclass(frozen=True)
class ChunkJob:
    key: tuple[str, int]  # (request id, chunk index)
    enc: torch.Tensor  # [L, C] positive encoder states (same object for all chunks of a clause)
    enc_null: torch.Tensor | None  # [L, C] null states, None when guidance is off for this job
    context: torch.Tensor  # [Tc, D] clean tail of the previous chunk (Tc may be 0)
    frame_start: int  # global index of the first noisy frame
    num_frames: int
    seed: int
    steps: int
    guidance_scale: float


@dataclass(frozen=True)
class FinishedChunk:
    key: tuple[str, int]
    latents: torch.Tensor  # [num_frames, D] fp32, unit RMS per frame


def shifted_schedule(steps: int, shift: float) -> list[float]:
    """linspace(1, 0, steps + 1) warped by t' = s t / (1 + (s - 1) t) (more time near noise)."""
    ts = [1.0 - i / steps for i in range(steps + 1)]
    return [shift * t / (1.0 + (shift - 1.0) * t) for t in ts]


def unit_rms(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Each frame (last dim) scaled to RMS 1."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def apg_velocity(pos: torch.Tensor, neg: torch.Tensor, scale: float, momentum: torch.Tensor) -> torch.Tensor:
    """Adaptive projected guidance on per-frame vectors [T, D]; updates ``momentum``.

    The guidance delta is smoothed with a (negative) momentum, its per-frame norm is
    capped at APG_NORM_THRESHOLD, and only its component orthogonal to the
    conditional prediction is kept (the parallel part oversaturates)."""
    momentum.mul_(APG_MOMENTUM).add_(pos - neg)
    delta = momentum * torch.clamp(APG_NORM_THRESHOLD / (momentum.norm(dim=-1, keepdim=True) + 1e-12), max=1.0)
    direction = torch.nn.functional.normalize(pos, dim=-1)
    orthogonal = delta - (delta * direction).sum(dim=-1, keepdim=True) * direction
    return pos + (scale - 1.0) * orthogonal


class _Slot:
    """One chunk in flight. Identity matters (memo keys), so no dataclass equality."""

    def __init__(self, job: ChunkJob, ring_index: int, ts: list[float],
                 buf: torch.Tensor, positions: torch.Tensor, context_flags: torch.Tensor,
                 guided: bool, momentum: torch.Tensor | None):
        self.job = job
        self.ring_index = ring_index
        self.ts = ts  # host schedule [steps + 1]; a tick uploads the current t of every row at once
        self.buf = buf  # [Tc + Tn, D] fp32: clean context, then the noisy state
        self.positions = positions  # [Tc + Tn] int64 global frame indices
        self.context_flags = context_flags  # [Tc + Tn] bool
        self.guided = guided
        self.momentum = momentum  # APG running delta [Tn, D]
        self.cached_negative: torch.Tensor | None = None  # timing "initialize"
        self.step = 0
        self.num_context = buf.shape[0] - job.num_frames

    @property
    def noisy(self) -> torch.Tensor:  # [Tn, D] view of buf
        return self.buf[self.num_context:]

    @property
    def rows(self) -> int:
        return self.buf.shape[0]

    def encoder_states(self, negative: bool) -> torch.Tensor:
        return self.job.enc_null if negative else self.job.enc  # type: ignore[return-value]


@dataclass
class _Layout:
    """Per-slot-set batch inputs that only change when the slot set changes."""

    slots: tuple  # references keep the keyed ids alive
    x_in: torch.Tensor  # [R, Tmax, D] model dtype; rows are refilled every tick, padding stays 0
    row_views: list  # [T_r, D] views of x_in, one per row
    positions: torch.Tensor  # [R, Tmax] int64
    context_mask: torch.Tensor  # [R, Tmax] bool
    frame_mask: torch.Tensor  # [R, Tmax] bool


class Denoiser:
    """The DiT tick loop: slots at staggered denoising steps, fused CFG, Euler steps."""

    def __init__(self, dit: FlowDiT, cfg: StreamConfig, device, dtype: torch.dtype = torch.float32):
        if cfg.guidance not in GUIDANCE_MODES:
            raise ValueError(f"guidance must be one of {GUIDANCE_MODES}, got {cfg.guidance!r}")
        if cfg.guidance_timing not in GUIDANCE_TIMINGS:
            raise ValueError(f"guidance_timing must be one of {GUIDANCE_TIMINGS}, got {cfg.guidance_timing!r}")
        if not 1 <= cfg.max_slots <= cfg.batch_ceiling:
            raise ValueError(f"need 1 <= max_slots <= batch_ceiling, got {cfg.max_slots}, {cfg.batch_ceiling}")
        self.dit = dit
        self.cfg = cfg
        self.device = canonical_device(device)
        self.dtype = dtype
        self._ring: list[_Slot | None] = [None] * cfg.max_slots
        self._last_enc: list[torch.Tensor | None] = [None] * cfg.max_slots  # placement preference
        self._by_key: dict[tuple[str, int], _Slot] = {}
        self._enc_memo: OrderedDict[tuple, tuple[tuple, torch.Tensor, torch.Tensor]] = OrderedDict()
        self._layout_memo: OrderedDict[tuple, _Layout] = OrderedDict()
        self._forward_count = 0
        self._memo_rebuilds = 0
        self._last_rows = 0

    # ------------------------------------------------------------------ observers

    @property
    def active_slots(self) -> int:
        return len(self._by_key)

    @property
    def forward_count(self) -> int:
        """DiT forwards run so far (one per tick when the rows fit the ceiling)."""
        return self._forward_count

    @property
    def memo_rebuilds(self) -> int:
        """Padded encoder batches built so far (cache misses)."""
        return self._memo_rebuilds

    @property
    def last_batch_rows(self) -> int:
        """Rows of the last tick's forward(s): n positive + negative rows."""
        return self._last_rows

    def free_slots(self) -> int:
        return self.cfg.max_slots - len(self._by_key)

    # ------------------------------------------------------------------ admission

    @torch.no_grad()  # not inference_mode: that hides ops from dispatch-mode checks
    def admit(self, job: ChunkJob) -> None:
        """Put ``job`` in a free slot. Everything per-job is decided here, once."""
        self._validate(job)
        D = self.dit.cfg.latent_dim
        ring_index = self._pick_ring_index(job.enc)
        Tc, Tn = job.context.shape[0], job.num_frames
        frames = torch.arange(job.frame_start, job.frame_start + Tn, device=self.device)
        noise = keyed_normal(job.seed, DOMAIN_NOISE, frames, D)  # [Tn, D] fp32
        buf = torch.cat([job.context.to(device=self.device, dtype=torch.float32), noise])
        ts = shifted_schedule(job.steps, self.cfg.schedule_shift)
        guided = job.enc_null is not None and self.cfg.guidance != "none" and job.guidance_scale > 1.0
        slot = _Slot(
            job=job, ring_index=ring_index, ts=ts,
            buf=buf,
            positions=torch.arange(job.frame_start - Tc, job.frame_start + Tn, device=self.device),
            context_flags=torch.arange(Tc + Tn, device=self.device) < Tc,
            guided=guided,
            momentum=torch.zeros_like(noise) if guided and self.cfg.guidance == "apg" else None,
        )
        self._ring[ring_index] = slot
        self._last_enc[ring_index] = job.enc
        self._by_key[job.key] = slot

    def _validate(self, job: ChunkJob) -> None:
        D, C = self.dit.cfg.latent_dim, self.dit.cfg.cond_dim
        if job.key in self._by_key:
            raise ValueError(f"chunk {job.key} is already in a slot")
        if not self.free_slots():
            raise RuntimeError(f"no free slot ({self.cfg.max_slots} in use)")
        if job.steps < 1 or job.num_frames < 1:
            raise ValueError(f"steps and num_frames must be >= 1, got {job.steps}, {job.num_frames}")
        if job.enc.dim() != 2 or job.enc.shape[1] != C or job.enc.shape[0] < 1:
            raise ValueError(f"enc must be [L, {C}] with L >= 1, got {tuple(job.enc.shape)}")
        if job.enc.device != self.device:
            raise ValueError(f"enc is on {job.enc.device}, the denoiser on {self.device}")
        if job.enc_null is not None and (job.enc_null.shape != job.enc.shape or job.enc_null.device != self.device):
            raise ValueError(f"enc_null must match enc ({tuple(job.enc.shape)} on {self.device}), "
                             f"got {tuple(job.enc_null.shape)} on {job.enc_null.device}")
        if job.context.dim() != 2 or job.context.shape[1] != D:
            raise ValueError(f"context must be [Tc, {D}], got {tuple(job.context.shape)}")
        if not math.isfinite(job.guidance_scale):
            raise ValueError(f"guidance_scale must be finite, got {job.guidance_scale}")

    def _pick_ring_index(self, enc: torch.Tensor) -> int:
        # Prefer the position that last held this clause, so the row order (and the
        # padded-encoder memo key) survives the hand-over from one chunk to the next.
        free = [i for i, s in enumerate(self._ring) if s is None]
        for i in free:
            if self._last_enc[i] is enc:
                return i
        return free[0]

    def cancel(self, key: tuple[str, int]) -> bool:
        """Free the slot of ``key`` now; False when it is not in flight."""
        slot = self._by_key.pop(key, None)
        if slot is None:
            return False
        self._ring[slot.ring_index] = None
        return True

    # ------------------------------------------------------------------ the tick

    def _needs_negative(self, slot: _Slot) -> bool:
        return slot.guided and (self.cfg.guidance_timing == "full" or slot.step == 0)

    @torch.no_grad()
    def tick(self) -> list[FinishedChunk]:
        """One denoising step for every active slot; returns the chunks that finished."""
        slots = [s for s in self._ring if s is not None]
        if not slots:
            self._last_rows = 0
            return []
        negatives = [s for s in slots if self._needs_negative(s)]
        n, k = len(slots), len(negatives)
        self._last_rows = n + k
        if n + k <= self.cfg.batch_ceiling:
            v = self._forward([(s, False) for s in slots] + [(s, True) for s in negatives]).float()
            v_pos, v_neg = v[:n], v[n:]
        else:
            # Two passes; copy the first output out in case the backend reuses its buffer.
            v_pos = self._forward([(s, False) for s in slots]).to(torch.float32, copy=True)
            v_neg = self._forward([(s, True) for s in negatives]).float()
        velocities = self._guided_velocities(slots, negatives, v_pos, v_neg)
        # Euler: x <- x + (t_next - t) v, one multi-tensor launch for all slots.
        dts = [s.ts[s.step + 1] - s.ts[s.step] for s in slots]
        torch._foreach_add_([s.noisy for s in slots], torch._foreach_mul(velocities, dts))
        finished = []
        for s in slots:
            s.step += 1
            if s.step == s.job.steps:
                finished.append(FinishedChunk(key=s.job.key, latents=unit_rms(s.noisy)))
                self.cancel(s.job.key)
        return finished

    def _guided_velocities(self, slots: list[_Slot], negatives: list[_Slot],
                           v_pos: torch.Tensor, v_neg: torch.Tensor) -> list[torch.Tensor]:
        """Per-slot velocity [Tn, D] (fp32) after guidance."""
        def noisy_part(v: torch.Tensor, row: int, s: _Slot) -> torch.Tensor:
            return v[row, s.num_context:s.rows]

        velocities = [noisy_part(v_pos, i, s) for i, s in enumerate(slots)]
        fresh_neg = {id(s): noisy_part(v_neg, j, s) for j, s in enumerate(negatives)}
        guided = [(i, s) for i, s in enumerate(slots) if s.guided]
        if not guided:
            return velocities
        negs = []
        for _, s in guided:
            neg = fresh_neg.get(id(s))
            if neg is None:
                neg = s.cached_negative  # timing "initialize": step-0 negative, reused
            elif self.cfg.guidance_timing == "initialize":
                neg = s.cached_negative = neg.clone()
            negs.append(neg)
        pos = [velocities[i] for i, _ in guided]
        scales = [s.job.guidance_scale for _, s in guided]
        if self.cfg.guidance == "cfg":
            # neg + s (pos - neg) = s pos + (1 - s) neg
            out = torch._foreach_mul(pos, scales)
            torch._foreach_add_(out, torch._foreach_mul(negs, [1.0 - g for g in scales]))
        else:
            out = [apg_velocity(p, q, g, s.momentum) for p, q, g, (_, s) in zip(pos, negs, scales, guided)]
        for (i, _), vel in zip(guided, out):
            velocities[i] = vel
        return velocities

    def _forward(self, rows: list[tuple[_Slot, bool]]) -> torch.Tensor:
        """One DiT forward over ``rows`` (slot, is_negative) -> v [R, Tmax, D]."""
        layout = self._layout(rows)
        torch._foreach_copy_(layout.row_views, [s.buf for s, _ in rows])  # negative rows keep the context
        enc, enc_mask = self.padded_encoder_states(tuple(s.encoder_states(neg) for s, neg in rows))
        # [R] fp32: one page-locked non-blocking upload (no sync), not R device indexing ops
        t = upload([s.ts[s.step] for s, _ in rows], torch.float32, self.device)
        self._forward_count += 1
        return self.dit(layout.x_in, layout.positions, layout.context_mask, layout.frame_mask,
                        t, enc, enc_mask)

    # ------------------------------------------------------------------ memos

    def padded_encoder_states(self, encs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, Lmax, C] padded states and [R, Lmax] mask for ``encs``, memoized on the
        identity of the tensors; a hit returns the very same objects."""
        key = tuple(id(e) for e in encs)
        hit = self._enc_memo.get(key)
        if hit is not None:
            self._enc_memo.move_to_end(key)
            return hit[1], hit[2]
        L = max(e.shape[0] for e in encs)
        batch = torch.zeros((len(encs), L, encs[0].shape[1]), dtype=self.dtype, device=self.device)
        torch._foreach_copy_([batch[r, : e.shape[0]] for r, e in enumerate(encs)], list(encs))
        # One comparison against the uploaded lengths (page-locked, no stream sync), not one
        # fill kernel per row: a 256-row rebuild would otherwise launch 256 kernels.
        lengths = upload([e.shape[0] for e in encs], torch.int64, self.device)
        mask = torch.arange(L, device=self.device)[None, :] < lengths[:, None]
        self._enc_memo[key] = (tuple(encs), batch, mask)  # tuple(encs) pins the ids
        self._memo_rebuilds += 1
        while len(self._enc_memo) > self.cfg.memo_size:
            self._enc_memo.popitem(last=False)
        return batch, mask

    def _layout(self, rows: list[tuple[_Slot, bool]]) -> _Layout:
        key = tuple((id(s), neg) for s, neg in rows)
        layout = self._layout_memo.get(key)
        if layout is not None:
            self._layout_memo.move_to_end(key)
            return layout
        T = max(s.rows for s, _ in rows)
        R, D = len(rows), self.dit.cfg.latent_dim
        x_in = torch.zeros((R, T, D), dtype=self.dtype, device=self.device)
        positions = torch.zeros((R, T), dtype=torch.long, device=self.device)
        context_mask = torch.zeros((R, T), dtype=torch.bool, device=self.device)
        # Multi-tensor copies and one comparison, not three kernels per row: at 256 rows a
        # rebuild (every tick the slot set changes, i.e. most ticks under load) would otherwise
        # launch ~770 kernels.
        torch._foreach_copy_([positions[r, : s.rows] for r, (s, _) in enumerate(rows)], [s.positions for s, _ in rows])
        torch._foreach_copy_([context_mask[r, : s.rows] for r, (s, _) in enumerate(rows)],
                             [s.context_flags for s, _ in rows])
        lengths = upload([s.rows for s, _ in rows], torch.int64, self.device)
        frame_mask = torch.arange(T, device=self.device)[None, :] < lengths[:, None]
        layout = _Layout(slots=tuple(s for s, _ in rows), x_in=x_in,
                         row_views=[x_in[r, : s.rows] for r, (s, _) in enumerate(rows)],
                         positions=positions, context_mask=context_mask, frame_mask=frame_mask)
        self._layout_memo[key] = layout
        while len(self._layout_memo) > self.cfg.memo_size:
            self._layout_memo.popitem(last=False)
        return layout
