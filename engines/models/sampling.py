"""Counter-based randomness: every draw is a pure function of (seed, domain, counters).

A request's noise and sampling decisions must not depend on what else shares the
batch, on the device, or on how many draws happened before. So instead of a stateful
generator we hash integer keys (a 32-bit avalanche mixer applied in int64 tensor ops,
which run identically on CPU and CUDA and never leave the device) into uniforms, and
derive normals (Box-Muller) and Gumbel noise (for sampling) from them.
"""

from __future__ import annotations

import math

import torch

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
                 vocab: int, dtype=torch.float32) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, vocab] for rows keyed by per-row seeds and counters.

    ``seed_lo``/``seed_hi``/``counters`` are int64 [B] tensors on the target device
    (counters typically pack frame index and codebook group). Stays on the device.
    """
    ids = torch.arange(vocab, device=counters.device, dtype=torch.int64)[None, :]
    u = keyed_uniform(seed_lo[:, None], seed_hi[:, None], domain, counters[:, None], ids,
                      device=counters.device, dtype=torch.float32)
    return (-torch.log(-torch.log(u))).to(dtype)


def sample_logits(logits: torch.Tensor, gumbel: torch.Tensor | None, temperature: torch.Tensor | float,
                  top_k: int | None, top_p: torch.Tensor | float | None, greedy: torch.Tensor | None) -> torch.Tensor:
    """On-device sampling: argmax(logits/T + Gumbel) over the top-k / top-p set.

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
    if top_k is not None and 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None:
        p = top_p if isinstance(top_p, torch.Tensor) else torch.full((x.shape[0],), float(top_p), device=x.device)
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep a token while the mass before it is < p (always keeps the top one).
        drop_sorted = (probs.cumsum(-1) - probs) >= p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    sampled = (x + gumbel.float()).argmax(dim=-1)
    if greedy is None:
        return sampled
    return torch.where(greedy, greedy_ids, sampled)
