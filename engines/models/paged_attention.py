"""Decode attention read from the paged KV pool in place: one query position per row.

    out = paged_decode_attention(q, pool_k, pool_v, table, lengths, scale)
    # q [B, H, hd]; pool_k / pool_v [slots, KVH, hd] (engines/models/paged_kv.py, slot = block * bs + offset);
    # table [B, max_blocks] the rows' block tables; lengths [B] positions each row attends (its own included)
    # -> [B, H * hd]

The gather path (``gather_pool`` + SDPA) copies every row's K/V into a contiguous view per layer
(on an H200 at 64 streams that copy was the largest kernel, ~10 % of the step) and needs the
number of blocks to read on the host, so a CUDA graph per KV-block bucket. The Triton kernel
here walks each row's block table up to the row's own length, read from the device: no copy,
and one graph serves every length. Off CUDA, or without Triton, :func:`reference_decode_attention`
computes the same thing with a gather (also the oracle the tests hold the kernel to).
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installed torch
    triton = None


def kernel_available(device: torch.device) -> bool:
    """Whether :func:`paged_decode_attention` runs the Triton kernel for tensors on ``device``:
    on CUDA with Triton installed, or anywhere under Triton's interpreter (the CPU tests). Whether
    the engine uses it is the caller's switch (``RuntimeSwitches.paged_attention``)."""
    return triton is not None and (device.type == "cuda" or triton_interprets())


def triton_interprets() -> bool:
    """Whether Triton runs kernels in its CPU interpreter: asked of Triton (the kind of kernel it
    built when this module was imported, which TRITON_INTERPRET=1 decides), so nothing here reads
    the environment (service/settings.py is the one reader)."""
    return _INTERPRETED


def reference_decode_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, table: torch.Tensor,
                               lengths: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """The naive computation: gather every row's blocks, mask past its length, softmax in fp32."""
    b, h, hd = q.shape
    rep = h // pool_k.shape[1]  # query head i reads kv head i // rep
    slots = (table[:, :, None] * block_size + torch.arange(block_size, device=q.device)).reshape(b, -1)  # [B, L]
    k = pool_k[slots].float().repeat_interleave(rep, dim=2)  # [B, L, H, hd]
    v = pool_v[slots].float().repeat_interleave(rep, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.float(), k) * scale
    valid = torch.arange(slots.shape[1], device=q.device)[None, :] < lengths[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("bhl,blhd->bhd", scores.softmax(-1), v)
    return out.to(q.dtype).reshape(b, h * hd)


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, out_ptr, table_stride, scale,
                             KVH: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                             HD: tl.constexpr, BLOCK: tl.constexpr):
        # one program per (row, kv head): its GROUP query heads over the row's blocks, online softmax
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        length = tl.load(len_ptr + row)
        d = tl.arange(0, HD)
        g = tl.arange(0, GROUP_PAD)
        t = tl.arange(0, BLOCK)
        g_ok = g < GROUP
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + (row * KVH * GROUP + heads[:, None]) * HD + d[None, :], mask=g_ok[:, None],
                    other=0.0).to(tl.float32)
        # scaled once, and cast back: under torch.compile a Python float arrives as fp64, which
        # would turn the running max below into fp64 (Triton rejects a loop variable changing type)
        q = (q * scale).to(tl.float32)  # [G, HD]
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HD], tl.float32)
        n_blocks = tl.cdiv(length, BLOCK)
        for j in range(0, n_blocks):
            block = tl.load(table_ptr + row * table_stride + j)
            slot = block * BLOCK + t  # [BLOCK]
            valid = j * BLOCK + t < length
            k = tl.load(k_ptr + (slot[:, None] * KVH + kvh) * HD + d[None, :], mask=valid[:, None],
                        other=0.0).to(tl.float32)  # [BLOCK, HD]
            v = tl.load(v_ptr + (slot[:, None] * KVH + kvh) * HD + d[None, :], mask=valid[:, None],
                        other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, BLOCK]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / denom[:, None]
        tl.store(out_ptr + (row * KVH * GROUP + heads[:, None]) * HD + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])

# Whether Triton built the kernel for its CPU interpreter (``triton_interprets``)
_INTERPRETED = triton is not None and type(_paged_decode_kernel).__name__ == "InterpretedFunction"


def paged_decode_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """q [B, H, hd], pools [slots, KVH, hd], table [B, max_blocks], lengths [B] (>= 1) -> [B, H * hd].
    The Triton kernel where :func:`kernel_available`, else the reference."""
    b, h, hd = q.shape
    kvh = pool_k.shape[1]
    if not kernel_available(q.device):
        return reference_decode_attention(q, pool_k, pool_v, table, lengths, scale, block_size)
    group = h // kvh
    q = q.contiguous()
    table = table.contiguous()
    out = torch.empty_like(q)
    _paged_decode_kernel[(b, kvh)](q, pool_k, pool_v, table, lengths, out, table.stride(0), scale,
                                   KVH=kvh, GROUP=group, GROUP_PAD=max(2, triton.next_power_of_2(group)),
                                   HD=hd, BLOCK=block_size, num_warps=4)
    return out.reshape(b, h * hd)


__all__ = ["kernel_available", "paged_decode_attention", "reference_decode_attention", "triton_interprets"]
