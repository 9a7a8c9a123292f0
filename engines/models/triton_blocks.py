"""Triton device functions the fused kernels share (engines/models/fused_predictor.py, fused_talker.py).

Each *phase* below is one step of a layer's dependency chain over every token row of a batch,
written as a grid-stride loop over its tiles: ``for tile in range(pid, n_tiles, nprog)``. A
phase launched on its own (``pid`` = program id, ``nprog`` = grid size) is one kernel; a
persistent kernel calls them one after another with ``grid_barrier`` between them. Both run
the same code, so a persistent kernel under Triton's interpreter (one program, the barrier
trivially met) computes exactly what the phases launched one by one compute.

    qkv_rope_phase       RMSNorm + QKV + per-head q/k RMSNorm + RoPE (any table: 1-D, M-RoPE) +
                         K/V written at each token's KV slot (static cache or paged pool)
    attention_phase      each token's heads over its KV block (paged_attention.paged_attention_program)
    residual_linear_phase  x += A @ W^T (o_proj, down_proj)
    gate_up_phase        RMSNorm + gate/up + SiLU(gate) * up
    linear_phase         out = A @ W^T (+ bias) (the predictor's input projection, its heads)

Numerics follow the torch modules they replace (engines/models/layers.py): every Linear output
rounded to the weights' dtype, norms in fp32 then rounded and scaled in the dtype, RoPE in the
dtype, residual adds in the dtype; fp32 GEMMs in IEEE fp32 (no TF32). Tile sizes never depend
on the number of rows (``TileConfig``), so a row's result is the same alone or in any batch.

Activations another program of the same launch wrote are loaded with ``CACHE`` ".cg" (L2, not
the SM's L1, which is not coherent within a launch); weights load normally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.models.paged_attention import triton_interprets

try:  # Triton ships with CUDA builds of torch; the CPU build may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installed torch
    triton = None


def interpreting() -> bool:
    """Triton's CPU interpreter is on (it must be set before a kernel is defined: the tests run
    the kernels in a subprocess that sets it); asked of Triton, not of the environment."""
    return triton_interprets()


def kernels_run_on(device: torch.device) -> bool:
    """Whether the fused kernels can run on tensors of ``device``: CUDA with Triton, or any
    device under Triton's interpreter."""
    return triton is not None and (torch.device(device).type == "cuda" or interpreting())


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of the fused kernels; fixed per device kind, never per batch (batch invariance)."""

    block_m: int  # token rows per GEMM tile (tl.dot needs >= 16)
    block_n: int  # output columns per GEMM tile (at most: narrower for a narrower model)
    block_k: int  # reduction chunk (likewise)
    att_m: int  # tokens per attention tile
    sample_m: int  # rows per sampling tile
    num_warps: int


# The GPU's: small column tiles so a batch-1 GEMV spreads over every SM (tuned by the device step).
GPU_TILES = TileConfig(block_m=16, block_n=32, block_k=256, att_m=1, sample_m=1, num_warps=4)
# The interpreter's: few, large numpy operations (an interpreted op costs ~0.1 ms whatever its size).
INTERPRETER_TILES = TileConfig(block_m=64, block_n=256, block_k=1024, att_m=64, sample_m=64, num_warps=1)


def tiles_for(device: torch.device) -> TileConfig:
    return GPU_TILES if torch.device(device).type == "cuda" and not interpreting() else INTERPRETER_TILES


def stack_as_views(groups: list[list[torch.nn.Parameter]]) -> torch.Tensor:
    """[len(groups), ...]: each group's parameters concatenated along their first dimension, the
    groups stacked; every parameter becomes a view of its slice, so the modules compute what they
    did, a kernel indexes one base pointer, and no memory is added once the old storages go."""
    with torch.no_grad():
        stacked = torch.stack([torch.cat([p.detach() for p in group]) for group in groups]).contiguous()
    for group, block in zip(groups, stacked):
        for p, part in zip(group, block.split([p.shape[0] for p in group])):
            p.data = part
    return stacked


def pow2(n: int, least: int = 16) -> int:
    """The power of two >= n (and >= ``least``): a tl.arange extent."""
    return max(least, 1 << max(0, int(n) - 1).bit_length())


if triton is not None:

    # ------------------------------------------------------------------ tiles

    @triton.jit
    def linear_tile(a_ptr, a_rows, row_ok, a_stride, K, w_ptr, cols, col_ok, w2_ptr, cols2, col2_ok, w_stride,
                    norm_ptr, eps, NORM: tl.constexpr, DUAL: tl.constexpr, IEEE: tl.constexpr,
                    BM: tl.constexpr, BK: tl.constexpr, CACHE: tl.constexpr):
        """[BM, BN] fp32 = rmsnorm?(A[a_rows]) @ W[cols]^T, and with DUAL the same rows times
        W2[cols2]^T (gate and up; a head's two rotary halves). A row of A is normalised the
        RMSNorm way: fp32 sum of squares, scaled, rounded to the weights' dtype, times the norm
        weight in that dtype."""
        dtype = w_ptr.dtype.element_ty
        if NORM:
            ss = tl.zeros([BM], tl.float32)
            for k0 in range(0, K, BK):
                k = k0 + tl.arange(0, BK)
                a = tl.load(a_ptr + a_rows[:, None] * a_stride + k[None, :], mask=row_ok[:, None] & (k < K)[None, :],
                            other=0.0, cache_modifier=CACHE).to(tl.float32)
                ss += tl.sum(a * a, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros([BM, cols.shape[0]], tl.float32)
        acc2 = tl.zeros([BM, cols2.shape[0]], tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < K
            a = tl.load(a_ptr + a_rows[:, None] * a_stride + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0, cache_modifier=CACHE)
            if NORM:
                nw = tl.load(norm_ptr + k, mask=k_ok, other=0.0)
                a = (a.to(tl.float32) * rstd[:, None]).to(dtype) * nw[None, :]
            a = a.to(dtype)
            # W^T's tile [BK, BN] loaded as such (the interpreter's matmul is ~50x slower on a transposed view)
            w = tl.load(w_ptr + cols[None, :] * w_stride + k[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
            if DUAL:
                w2 = tl.load(w2_ptr + cols2[None, :] * w_stride + k[:, None], mask=col2_ok[None, :] & k_ok[:, None],
                             other=0.0)
                if IEEE:
                    acc2 = tl.dot(a, w2, acc2, input_precision="ieee")
                else:
                    acc2 = tl.dot(a, w2, acc2)
        return acc, acc2

    # ------------------------------------------------------------------ phases

    @triton.jit
    def qkv_rope_phase(pid, nprog, n_tok, x_ptr, x_stride, D, ln_ptr, eps, w_ptr, qk_norm_ptr, cos_ptr, sin_ptr,
                       rope_idx_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                       H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                       IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, CACHE: tl.constexpr):
        """One tile per (token rows, head of q | k | v): the input RMSNorm, the head's columns of
        the fused [q; k; v] weight (w [(H + 2 KVH) * HD, D]) as its two rotary halves, then for q
        and k the per-head RMSNorm (``qk_norm`` [2, HD]: q's weight, k's) and RoPE from the
        tables' row ``rope_idx[t]`` (cos, and sin with its first half negated: ``prepare_rope``);
        q goes to q [T, H, HD], k and v to the cache at slot ``slot[t]`` ([slots, KVH, HD])."""
        dtype = w_ptr.dtype.element_ty
        m_tiles = tl.cdiv(n_tok, BM)
        half = tl.arange(0, HALF)
        h_ok = half < HD // 2
        for tile in range(pid, m_tiles * (H + 2 * KVH), nprog):
            s = tile // m_tiles
            rows = (tile % m_tiles) * BM + tl.arange(0, BM)
            row_ok = rows < n_tok
            acc1, acc2 = linear_tile(x_ptr, rows, row_ok, x_stride, D, w_ptr, s * HD + half, h_ok,
                                     w_ptr, s * HD + HD // 2 + half, h_ok, D, ln_ptr, eps,
                                     NORM=True, DUAL=True, IEEE=IEEE, BM=BM, BK=BK, CACHE=CACHE)
            y1 = acc1.to(dtype)
            y2 = acc2.to(dtype)
            ok = row_ok[:, None] & h_ok[None, :]
            if s < H + KVH:  # q or k: per-head RMSNorm, then RoPE
                norm = qk_norm_ptr + (s >= H).to(tl.int32) * HD
                f1 = y1.to(tl.float32)
                f2 = y2.to(tl.float32)
                rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HD + eps)
                n1 = (f1 * rstd[:, None]).to(dtype) * tl.load(norm + half, mask=h_ok, other=0.0)[None, :]
                n2 = (f2 * rstd[:, None]).to(dtype) * tl.load(norm + HD // 2 + half, mask=h_ok, other=0.0)[None, :]
                ridx = tl.load(rope_idx_ptr + rows, mask=row_ok, other=0)
                tab = ridx[:, None] * HD + half[None, :]
                c1 = tl.load(cos_ptr + tab, mask=ok, other=0.0)
                c2 = tl.load(cos_ptr + tab + HD // 2, mask=ok, other=0.0)
                s1 = tl.load(sin_ptr + tab, mask=ok, other=0.0)
                s2 = tl.load(sin_ptr + tab + HD // 2, mask=ok, other=0.0)
                y1 = n1 * c1 + n2 * s1  # x * cos + roll(x, HD / 2) * sin, each product in the dtype
                y2 = n2 * c2 + n1 * s2
            # q to the q buffer, k and v to the cache (masked stores: no pointer chosen at run time)
            sv = (rows * 0 + s)[:, None]  # as a tensor: the interpreter cannot AND a scalar into a mask
            is_q = sv < H
            is_k = (sv >= H) & (sv < H + KVH)
            is_v = sv >= H + KVH
            q_at = q_ptr + (rows[:, None] * H + s) * HD + half[None, :]
            slot = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            kv_off = (slot[:, None] * KVH + tl.where(is_k, sv - H, sv - H - KVH)) * HD + half[None, :]
            y1 = y1.to(dtype)
            y2 = y2.to(dtype)
            tl.store(q_at, y1, mask=ok & is_q)
            tl.store(q_at + HD // 2, y2, mask=ok & is_q)
            tl.store(k_ptr + kv_off, y1, mask=ok & is_k)
            tl.store(k_ptr + kv_off + HD // 2, y2, mask=ok & is_k)
            tl.store(v_ptr + kv_off, y1, mask=ok & is_v)
            tl.store(v_ptr + kv_off + HD // 2, y2, mask=ok & is_v)

    @triton.jit
    def frame_attention_phase(pid, nprog, n_tok, q_ptr, k_ptr, v_ptr, blk_ptr, len_ptr, out_ptr, scale,
                              KVH: tl.constexpr, GROUP: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
                              BLOCK: tl.constexpr, TM: tl.constexpr, CACHE: tl.constexpr):
        """Attention of TM tokens per tile and one KV head: token t's GROUP query heads (q [T, H, HD])
        over its first ``len[t]`` positions, cache slots ``blk[t] * BLOCK + j`` ([slots, KVH, HD]),
        softmax in fp32 -> out [T, H * HD]. One block per token (a code-predictor frame has at most
        BLOCK positions): the single-block case of engines/models/paged_attention.py, for many
        tokens per tile."""
        H: tl.constexpr = KVH * GROUP
        m_tiles = tl.cdiv(n_tok, TM)
        d = tl.arange(0, HDP)
        j = tl.arange(0, BLOCK)
        d_ok = d < HD
        for tile in range(pid, m_tiles * KVH, nprog):
            kvh = tile // m_tiles
            toks = (tile % m_tiles) * TM + tl.arange(0, TM)
            ok = toks < n_tok
            blk = tl.load(blk_ptr + toks, mask=ok, other=0).to(tl.int64)
            length = tl.load(len_ptr + toks, mask=ok, other=1)
            valid = (j[None, :] < length[:, None]) & ok[:, None]  # [TM, BLOCK]
            at = ((blk[:, None] * BLOCK + j[None, :])[:, :, None] * KVH + kvh) * HD + d[None, None, :]
            kv_ok = valid[:, :, None] & d_ok[None, None, :]
            k = tl.load(k_ptr + at, mask=kv_ok, other=0.0, cache_modifier=CACHE).to(tl.float32)  # [TM, BLOCK, HD]
            v = tl.load(v_ptr + at, mask=kv_ok, other=0.0, cache_modifier=CACHE).to(tl.float32)
            for g in tl.static_range(GROUP):
                q_at = (toks[:, None] * H + kvh * GROUP + g) * HD + d[None, :]
                q_ok = ok[:, None] & d_ok[None, :]
                q = tl.load(q_ptr + q_at, mask=q_ok, other=0.0, cache_modifier=CACHE).to(tl.float32)
                q = (q * scale).to(tl.float32)
                sc = tl.where(valid, tl.sum(q[:, None, :] * k, axis=2), float("-inf"))  # [TM, BLOCK]
                top = tl.where(ok, tl.max(sc, axis=1), 0.0)  # padding tokens: no position at all
                e = tl.exp(sc - top[:, None])
                out = tl.sum(e[:, :, None] * v, axis=1) / tl.maximum(tl.sum(e, axis=1), 1e-30)[:, None]
                tl.store(out_ptr + q_at, out.to(out_ptr.dtype.element_ty), mask=q_ok)

    @triton.jit
    def residual_linear_phase(pid, nprog, n_tok, a_ptr, K, w_ptr, x_ptr, out_ptr, N, IEEE: tl.constexpr,
                              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CACHE: tl.constexpr):
        """out = x + (A @ W^T rounded to the dtype): a [T, K], w [N, K], x and out [T, N] (out may be x)."""
        dtype = w_ptr.dtype.element_ty
        m_tiles = tl.cdiv(n_tok, BM)
        for tile in range(pid, m_tiles * tl.cdiv(N, BN), nprog):
            rows = (tile % m_tiles) * BM + tl.arange(0, BM)
            cols = (tile // m_tiles) * BN + tl.arange(0, BN)
            row_ok = rows < n_tok
            col_ok = cols < N
            acc, _ = linear_tile(a_ptr, rows, row_ok, K, K, w_ptr, cols, col_ok, w_ptr, cols, col_ok, K, w_ptr, 0.0,
                                 NORM=False, DUAL=False, IEEE=IEEE, BM=BM, BK=BK, CACHE=CACHE)
            at = rows[:, None] * N + cols[None, :]
            ok = row_ok[:, None] & col_ok[None, :]
            x = tl.load(x_ptr + at, mask=ok, other=0.0, cache_modifier=CACHE)
            tl.store(out_ptr + at, x + acc.to(dtype), mask=ok)

    @triton.jit
    def gate_up_phase(pid, nprog, n_tok, x_ptr, D, ln_ptr, eps, wg_ptr, wu_ptr, act_ptr, N, IEEE: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CACHE: tl.constexpr):
        """act = silu(gate(rmsnorm(x))) * up(rmsnorm(x)): x [T, D], wg / wu [N, D], act [T, N]."""
        dtype = wg_ptr.dtype.element_ty
        m_tiles = tl.cdiv(n_tok, BM)
        for tile in range(pid, m_tiles * tl.cdiv(N, BN), nprog):
            rows = (tile % m_tiles) * BM + tl.arange(0, BM)
            cols = (tile // m_tiles) * BN + tl.arange(0, BN)
            row_ok = rows < n_tok
            col_ok = cols < N
            g, u = linear_tile(x_ptr, rows, row_ok, D, D, wg_ptr, cols, col_ok, wu_ptr, cols, col_ok, D, ln_ptr, eps,
                               NORM=True, DUAL=True, IEEE=IEEE, BM=BM, BK=BK, CACHE=CACHE)
            g = g.to(dtype).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dtype) * u.to(dtype)
            tl.store(act_ptr + rows[:, None] * N + cols[None, :], act, mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def linear_phase(pid, nprog, n_rows, a_ptr, a_row_mul, a_row_add, a_stride, K, norm_ptr, eps, w_ptr, bias_ptr,
                     out_ptr, out_stride, N, NORM: tl.constexpr, BIAS: tl.constexpr, OUT_F32: tl.constexpr,
                     IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CACHE: tl.constexpr):
        """out[r] = rmsnorm?(A[r * a_row_mul + a_row_add]) @ W^T (+ bias), rounded to the dtype
        (``OUT_F32``: then widened, for logits): w [N, K], out rows ``out_stride`` apart."""
        dtype = w_ptr.dtype.element_ty
        m_tiles = tl.cdiv(n_rows, BM)
        for tile in range(pid, m_tiles * tl.cdiv(N, BN), nprog):
            rows = (tile % m_tiles) * BM + tl.arange(0, BM)
            cols = (tile // m_tiles) * BN + tl.arange(0, BN)
            row_ok = rows < n_rows
            col_ok = cols < N
            acc, _ = linear_tile(a_ptr, rows * a_row_mul + a_row_add, row_ok, a_stride, K, w_ptr, cols, col_ok,
                                 w_ptr, cols, col_ok, K, norm_ptr, eps, NORM=NORM, DUAL=False, IEEE=IEEE, BM=BM,
                                 BK=BK, CACHE=CACHE)
            if BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            y = acc.to(dtype)
            if OUT_F32:
                y = y.to(tl.float32)
            tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])

    # ------------------------------------------------------------------ persistent launches

    @triton.jit
    def grid_barrier(bar_ptr, target):
        """Every program of a persistent launch waits here until ``target`` arrivals (the
        programs x the barriers passed so far; the counter is zeroed before the launch). The
        launch must have no more programs than can be resident at once (one per SM)."""
        tl.debug_barrier()  # this program's stores are ordered before its arrival
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        while tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu") < target:
            pass
        tl.debug_barrier()

    # ------------------------------------------------------------------ counter-based sampling

    @triton.jit
    def mix32(x):
        """lowbias32 on uint32 (engines/models/sampling.py ``_mix32``)."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        x = x ^ (x >> 16)
        return x

    @triton.jit
    def counter_prefix(seed_lo, seed_hi, counter, DOMAIN: tl.constexpr):
        """``hash_keys(seed_lo, seed_hi, DOMAIN, counter, ...)`` up to its last key (int rows in,
        uint32 out; each key's low 32 bits, as ``hash_keys`` masks them): a row's columns share it."""
        h = mix32(seed_lo.to(tl.uint32) + 0x9E3779B9)
        h = mix32(h ^ mix32(seed_hi.to(tl.uint32) + 0x3C6EF372))
        h = mix32(h ^ mix32(tl.full([], DOMAIN, tl.uint32) + 0xDAA66D2B))
        h = mix32(h ^ mix32(counter.to(tl.uint32) + 0x78DDE6E4))
        return h

    @triton.jit
    def keyed_gumbel(prefix, ids):
        """Gumbel noise [SM, VP] of token ``ids`` [VP] given each row's ``counter_prefix`` [SM]: the
        fifth key, then ``uniform_from_bits`` ((bits >> 8) + 0.5) / 2^24 (exact in fp32 as in fp64
        then rounded) and -log(-log(u))."""
        bits = mix32(prefix[:, None] ^ mix32(ids.to(tl.uint32) + 0x1715609D)[None, :])
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        return -tl.log(-tl.log(u))

    @triton.jit
    def order_key(x):
        """fp32 -> uint32 whose unsigned order is the float order (-inf lowest)."""
        u = x.to(tl.uint32, bitcast=True)
        return tl.where((u >> 31) == 1, ~u, u | 0x80000000)

    @triton.jit
    def largest_key_where(key, weight, target):
        """Per row, the largest uint32 t with sum(weight[key > t]) >= target (bit by bit from the
        top: the rows' [SM] thresholds of keys [SM, VP]). No sort: a bitonic sort is ~66 stages of
        2048-wide swaps, and Triton's interpreter runs its xor-reduction element by element."""
        t = tl.zeros([key.shape[0]], tl.uint32)
        for bit in range(0, 32):
            cand = t | (tl.full([], 1, tl.uint32) << (31 - bit))
            mass = tl.sum(tl.where(key > cand[:, None], weight, 0.0), axis=1)
            t = tl.where(mass >= target, cand, t)
        return t

    @triton.jit
    def sample_rows_tile(logits, ids, V, greedy, temperature, top_k, top_p, prefix, mode):
        """``sample_rows`` for a tile of rows: logits [SM, VP] fp32 (columns >= V are padding), the
        rows' settings [SM]. ``mode`` (a run-time value, so one compiled kernel serves every batch)
        0: argmax (every row greedy); 1: top-k, temperature, Gumbel-max; 2: and top-p. Ties: the
        first index, as torch.argmax. Thresholds by value, not by a sort: top-k keeps x >= the k-th
        largest (ties included, as ``keep_top_k``); top-p drops a token when the mass of the tokens
        above it is >= p, so tokens tied with the last one kept are all kept (torch keeps whichever
        its sort put first)."""
        x = tl.where(ids[None, :] < V, logits, float("-inf"))
        code = tl.argmax(x, axis=1, tie_break_left=True)
        if mode != 0:
            k = tl.where(top_k > 0, top_k, V)
            k = tl.minimum(tl.maximum(k, 1), V).to(tl.float32)
            key = order_key(x)
            # the largest t with >= k keys above it is the k-th largest key minus one (counts exact in fp32)
            kth = largest_key_where(key, tl.full(x.shape, 1.0, tl.float32), k) + 1
            x = tl.where(key < kth[:, None], float("-inf"), x)
            x = x / tl.maximum(temperature, 1e-5)[:, None]
            if mode == 2:
                e = tl.exp(x - tl.max(x, axis=1)[:, None])
                probs = e / tl.sum(e, axis=1)[:, None]
                key = order_key(x)
                cut = largest_key_where(key, probs, top_p)  # tokens with mass >= p above them: key <= cut
                x = tl.where((key <= cut[:, None]) & (top_p < 1.0)[:, None], float("-inf"), x)
            sampled = tl.argmax(x + keyed_gumbel(prefix, ids), axis=1, tie_break_left=True)
            code = tl.where(greedy, code, sampled)
        return code


__all__ = ["GPU_TILES", "INTERPRETER_TILES", "TileConfig", "interpreting", "kernels_run_on", "pow2", "stack_as_views",
           "tiles_for"]
