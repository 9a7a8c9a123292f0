"""Sampling: counter-based randomness and the one on-device sampler (top-k, top-p,
temperature, Gumbel-max), with the talker's logits processors.

Counter-based randomness: every draw is a pure function of (seed, domain, counters).

A request's noise and sampling decisions must not depend on what else shares the
batch, on the device, or on how many draws happened before. So instead of a stateful
generator we hash integer keys (a 32-bit avalanche mixer applied in int64 tensor ops,
which run identically on CPU and CUDA and never leave the device) into uniforms, and
derive normals (Box-Muller) and Gumbel noise (for sampling) from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engines.hardware.devices import upload

_M32 = 0xFFFFFFFF

# Domain tags keep independent uses of one seed apart.
DOMAIN_NOISE = 1  # DiT initial noise: counters (frame, channel)
DOMAIN_CODE0 = 2  # code 0 sampling: counters (frame, vocab id)
DOMAIN_CODES = 3  # code predictor sampling: counters (frame, group, vocab id)
DOMAIN_TALKER = 4  # talker sampling


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 avalanche on values in [0, 2^32) held in int64 (products wrap; low bits stay exact)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    x = x ^ (x >> 16)
    return x


def split_seed(seed: int) -> tuple[int, int]:
    """A Python int seed (any size, any sign) as two 32-bit words."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return s & _M32, (s >> 32) & _M32


def hash_keys(*keys: torch.Tensor | int, device: torch.device | str | None = None) -> torch.Tensor:
    """Hash broadcastable int keys (each in [0, 2^32)) into 32-bit values (int64 tensor).

    Python-int keys are mixed on the host (exact integer math, the same low 32 bits the
    int64 tensor ops give) and enter the tensor math as scalars: no host->device tensor
    is created, so the hash is safe inside CUDA graph capture and never syncs.
    """
    h: torch.Tensor | int | None = None
    for i, k in enumerate(keys):
        kt = k.to(torch.int64) & _M32 if isinstance(k, torch.Tensor) else int(k) & _M32
        if h is None:
            h = _mix32(kt + 0x9E3779B9)
        else:
            h = _mix32(h ^ _mix32(kt + (0x9E3779B9 * (i + 1)) & _M32))
    assert h is not None, "hash_keys needs at least one key"
    return h if isinstance(h, torch.Tensor) else torch.tensor(h, dtype=torch.int64, device=device)


def uniform_from_bits(bits: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map 32-bit hashes to uniforms strictly inside (0, 1) (24-bit resolution)."""
    return ((bits >> 8).to(torch.float64) + 0.5).div(2.0**24).to(dtype)


def keyed_uniform(*keys: torch.Tensor | int, device=None, dtype=torch.float32) -> torch.Tensor:
    return uniform_from_bits(hash_keys(*keys, device=device), dtype)


def keyed_normal(seed: int, domain: int, rows: torch.Tensor, width: int, dtype=torch.float32) -> torch.Tensor:
    """Standard normals [len(rows), width], row r depending only on (seed, domain, rows[r], column).

    ``rows`` is an int64 tensor of counters (e.g. global frame indices).
    """
    lo, hi = split_seed(seed)
    device = rows.device
    cols = torch.arange(width, device=device, dtype=torch.int64)
    r = rows.to(torch.int64)[:, None]
    u1 = keyed_uniform(lo, hi, domain, r, 2 * cols[None, :], device=device, dtype=torch.float64)
    u2 = keyed_uniform(lo, hi, domain, r, 2 * cols[None, :] + 1, device=device, dtype=torch.float64)
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
    return z.to(dtype)


def keyed_gumbel(seed_lo: torch.Tensor, seed_hi: torch.Tensor, domain: int, counters: torch.Tensor,
                 vocab: int, dtype=torch.float32, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, vocab] for rows keyed by per-row seeds and counters.

    ``seed_lo``/``seed_hi``/``counters`` are int64 [B] tensors on the target device
    (counters typically pack frame index and codebook group). Column j is keyed by token id
    ``ids[j]`` ([vocab] int64; default ``arange(vocab)``). Stays on the device.
    """
    if ids is None:
        ids = torch.arange(vocab, device=counters.device, dtype=torch.int64)
    u = keyed_uniform(seed_lo[:, None], seed_hi[:, None], domain, counters[:, None], ids[None, :],
                      device=counters.device, dtype=torch.float32)
    return (-torch.log(-torch.log(u))).to(dtype)


def sample_logits(logits: torch.Tensor, gumbel: torch.Tensor | None, temperature: torch.Tensor | float,
                  top_p: torch.Tensor | float | None, greedy: torch.Tensor | None) -> torch.Tensor:
    """On-device sampling: argmax(logits/T + Gumbel) over the top-p set (top-k: ``keep_top_k``
    first, as ``sample_rows`` does).

    ``greedy`` is a bool [B] mask (or None = all sampled); greedy rows take argmax of the
    raw logits. No host reads: every branch is a tensor op (``torch.where``).
    """
    greedy_ids = logits.argmax(dim=-1)
    if gumbel is None:
        return greedy_ids
    x = logits.float()
    if isinstance(temperature, torch.Tensor):
        x = x / temperature.clamp_min(1e-5)[:, None]
    else:
        x = x / max(float(temperature), 1e-5)
    if top_p is not None:
        p = top_p if isinstance(top_p, torch.Tensor) else torch.full((x.shape[0],), float(top_p), device=x.device)
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep a token while the mass before it is < p (always keeps the top one).
        # Rows at p = 1 keep everything (cumsum may reach 1.0 early in float): a row's draw
        # must not depend on whether a neighbour in the batch uses top-p.
        drop_sorted = ((probs.cumsum(-1) - probs) >= p[:, None]) & (p < 1.0)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    sampled = (x + gumbel.float()).argmax(dim=-1)
    if greedy is None:
        return sampled
    return torch.where(greedy, greedy_ids, sampled)


# --------------------------------------------------------------------------- request settings


@dataclass(frozen=True)
class SamplingSettings:
    """One decoder's settings for one request, resolved: what a row of ``FrameSampling`` holds."""

    greedy: bool
    temperature: float
    top_k: int  # <= 0: off
    top_p: float  # 1.0: off

    def override(self, greedy: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None) -> "SamplingSettings":
        """These defaults with a request's overrides (``None`` keeps the default). Greedy when
        ``greedy`` is True or ``temperature`` is 0; an explicit positive temperature (or
        ``greedy`` False) turns sampling on even where the default decodes greedily."""
        if greedy or temperature == 0:
            return SamplingSettings(True, self.temperature, self.top_k, self.top_p)
        sampled = greedy is False or temperature is not None or not self.greedy
        return SamplingSettings(not sampled, self.temperature if temperature is None else float(temperature),
                                self.top_k if top_k is None else int(top_k),
                                self.top_p if top_p is None else float(top_p))

    def for_request(self, request) -> "SamplingSettings":
        """``override`` with a :class:`~engines.contract.SynthesisRequest`'s fields."""
        return self.override(request.greedy, request.temperature, request.top_k, request.top_p)


GREEDY_SETTINGS = SamplingSettings(True, 0.9, 50, 1.0)  # greedy unless a request asks to sample


# --------------------------------------------------------------------------- per-row sampling


@dataclass(frozen=True)
class FrameSampling:
    """Per-row sampling settings for a batch of frames (all tensors [B] on the device).

    ``all_greedy`` is host-known, decided when the batch is built, so greedy batches skip
    the noise entirely without reading anything back from the device.
    """

    seed_lo: torch.Tensor  # int64
    seed_hi: torch.Tensor  # int64
    frame: torch.Tensor  # int64 global frame index (sampling counter)
    greedy: torch.Tensor  # bool
    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, <= 0 means off
    top_p: torch.Tensor  # float32
    all_greedy: bool
    any_top_p: bool  # some row has top_p < 1

    @staticmethod
    def for_stream(n_frames: int, seed: int, frame_offset: int, device, greedy: bool = True,
                   temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0) -> "FrameSampling":
        """Rows for frames ``frame_offset .. frame_offset + n_frames - 1`` of one stream."""
        return FrameSampling.for_streams([(n_frames, seed, frame_offset, greedy, temperature, top_k, top_p)], device)

    @staticmethod
    def for_streams(streams: list[tuple[int, int, int, bool, float, int, float]], device) -> "FrameSampling":
        """Rows of several streams at once, each ``(n_frames, seed, frame_offset, greedy,
        temperature, top_k, top_p)``: equal to ``cat`` of their ``for_stream``, but built on the
        host and uploaded once per field (7 copies, not 7 kernels per stream; no stream sync)."""
        cols: dict[str, list] = {k: [] for k in ("seed_lo", "seed_hi", "frame", "greedy", "temperature", "top_k",
                                                 "top_p")}
        for n, seed, offset, greedy, temperature, top_k, top_p in streams:
            lo, hi = split_seed(seed)
            for name, value in (("seed_lo", lo), ("seed_hi", hi), ("greedy", bool(greedy)),
                                ("temperature", float(temperature)), ("top_k", int(top_k)), ("top_p", float(top_p))):
                cols[name].extend([value] * n)
            cols["frame"].extend(range(offset, offset + n))
        dtypes = {"seed_lo": torch.int64, "seed_hi": torch.int64, "frame": torch.int64, "greedy": torch.bool,
                  "temperature": torch.float32, "top_k": torch.int64, "top_p": torch.float32}
        fields = {name: upload(values, dtypes[name], device) for name, values in cols.items()}
        return FrameSampling(**fields, all_greedy=all(s[3] for s in streams),
                             any_top_p=any((not s[3]) and s[6] < 1.0 for s in streams))

    @staticmethod
    def cat(parts: list["FrameSampling"]) -> "FrameSampling":
        def c(name):
            return torch.cat([getattr(p, name) for p in parts])
        return FrameSampling(c("seed_lo"), c("seed_hi"), c("frame"), c("greedy"), c("temperature"), c("top_k"),
                             c("top_p"), all(p.all_greedy for p in parts), any(p.any_top_p for p in parts))

    def rows(self, sl: slice) -> "FrameSampling":
        return FrameSampling(self.seed_lo[sl], self.seed_hi[sl], self.frame[sl], self.greedy[sl],
                             self.temperature[sl], self.top_k[sl], self.top_p[sl], self.all_greedy, self.any_top_p)

    def __len__(self) -> int:
        return self.frame.shape[0]


def keep_top_k(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Per-row top-k: x [B, V] with values below each row's k-th largest set to -inf;
    top_k [B] int64, <= 0 means off."""
    vocab = x.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(1, vocab)
    kth = torch.sort(x, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])  # [B, 1]
    return x.masked_fill(x < kth, float("-inf"))


def sample_rows(logits: torch.Tensor, sampling: FrameSampling, domain: int, counters: torch.Tensor,
                ids: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> column ids [B] (int64) on the device: per-row top-k, then
    ``sample_logits``; counters [B] int64 and the token ids of the columns (``ids`` [V],
    default 0..V-1) key the Gumbel noise."""
    if sampling.all_greedy:
        return logits.argmax(dim=-1)
    x = keep_top_k(logits.float(), sampling.top_k)
    gumbel = keyed_gumbel(sampling.seed_lo, sampling.seed_hi, domain, counters, x.shape[-1], ids=ids)
    top_p = sampling.top_p if sampling.any_top_p else None
    return sample_logits(x, gumbel, sampling.temperature, top_p, sampling.greedy)


# --------------------------------------------------------------------------- talker code 0


def apply_talker_processors(logits: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor,
                            eos_col: int, eos_blocked: torch.Tensor) -> torch.Tensor:
    """The official logits processors on compact logits [B, n] (float32):
    repetition penalty over the code-0 ids generated so far (``seen`` [B, n] bool), and
    EOS blocked where ``eos_blocked`` [B] (min_new_tokens). Suppression is the compact range."""
    x = logits.float()
    # A Python float stays a scalar operand: no host->device copy (and sync) per step.
    p = penalty.float().reshape(-1, 1) if isinstance(penalty, torch.Tensor) else float(penalty)
    penalised = torch.where(x < 0, x * p, x / p)
    x = torch.where(seen, penalised, x)
    x[:, eos_col] = torch.where(eos_blocked, torch.full_like(x[:, eos_col], float("-inf")), x[:, eos_col])
    return x


def sample_code0(scores: torch.Tensor, ids: torch.Tensor, sampling: FrameSampling) -> torch.Tensor:
    """The talker's code 0: scores [B, n] (processed) over token ids ``ids`` [n] -> compact column [B].

    Noise is keyed by (seed, DOMAIN_TALKER, token index, token id), so the draw does not
    depend on the batch, nor on whether the caller used the compact range or the full one.
    """
    return sample_rows(scores, sampling, DOMAIN_TALKER, sampling.frame, ids=ids)
