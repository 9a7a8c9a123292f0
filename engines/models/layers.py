"""Transformer pieces shared by every model in streamvox (parameter names match Qwen3's).

The one definition of each: RMSNorm, RoPE (1-D and Qwen3's M-RoPE), the attention core
(SDPA with grouped-query heads) and the attention module around it, the SwiGLU MLP and
the Qwen3 pre-norm decoder layer. Model files build on these and keep only what is
theirs (caches, masks, layer scales). This module imports no other model module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------- norm / MLP


class RMSNorm(nn.Module):
    """x / rms(x) * weight: normalised in fp32, cast back to x's dtype, then scaled (the
    official Qwen3 order of ops; bf16 squares lose too much). ``affine=False``: no weight."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 input: no casts at all (each is a dispatched op; a decode step runs ~400 norms)
        wide = x.dtype == torch.float32
        xf = x if wide else x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if not wide:
            y = y.to(x.dtype)
        return self.weight * y if self.weight is not None else y


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: the Qwen3 MLP (``gate_proj/up_proj/down_proj``)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fused at load (``fuse``): one GEMM for gate and up, up to ``fused_rows`` rows
        if self.gate_up is not None and x.numel() <= self.fused_rows * x.shape[-1]:
            gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    gate_up: torch.Tensor | None = None
    fused_rows: float = float("inf")  # more rows: the separate GEMMs (``choose_fused_rows``)

    @torch.no_grad()
    def fuse(self) -> None:
        """One [gate; up] weight matrix; the two parameters become views of it (no extra memory,
        state_dict unchanged). Call after the module is on its device and dtype."""
        if self.gate_up is not None or not all(isinstance(p, nn.Linear) for p in (self.gate_proj, self.up_proj)):
            return  # fused already, or quantized (engines/models/quantize.py)
        fused = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        n = self.gate_proj.out_features
        self.gate_proj.weight.data, self.up_proj.weight.data = fused[:n], fused[n:]
        self.gate_up = fused


# --------------------------------------------------------------------------- rope


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Default (unscaled) RoPE inverse frequencies [hd/2], computed like transformers does.
    ``device``: where the power is taken (CPU and CUDA may differ in the last ulp)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [..., S] (int) -> cos, sin [..., S, hd] in fp32 math, cast to ``dtype``."""
    freqs = positions.float()[..., None] * inv_freq.float()  # [..., S, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., S, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, section: tuple[int, ...], interleaved: bool,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3 M-RoPE: positions [3, B, S] (temporal, height, width) -> cos, sin [B, S, hd]
    (official order of ops: 1-D tables per axis, then the sections picked from each)."""
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)  # [3, B, S, hd]
    n = len(section)

    def pick(t: torch.Tensor) -> torch.Tensor:
        if interleaved:  # pair j takes section (j mod n) for j < n * section[j mod n]
            half = t[..., : t.shape[-1] // 2]
            out = half[0].clone()
            for i, width in enumerate(section[1:], 1):
                out[..., i:width * n:n] = half[i, ..., i:width * n:n]
            return torch.cat((out, out), dim=-1)
        chunks = t.split(list(section) * 2, dim=-1)
        return torch.cat([c[i % n] for i, c in enumerate(chunks)], dim=-1)

    return pick(cos), pick(sin)


def fp32_rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, hd] in fp32 for int positions [B, T] (any values, e.g. global frame
    ids): the condition encoder and the DiT rotate in fp32 whatever their dtype (see
    ``apply_rope``); frequencies computed on the positions' device."""
    return rope_cos_sin(rope_inv_freq(head_dim, theta, positions.device), positions, torch.float32)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, hd]; cos/sin [B, S, hd], or [B, 1, S, hd] from :func:`prepare_rope`. The
    rotation runs in the promoted dtype of x and cos/sin and the result has x's dtype: tables
    in x's dtype give the official Qwen3 math, fp32 tables (the DiT's) rotate bf16 activations
    in fp32."""
    if cos.dim() == 4:  # prepared: rotate_half(x) * sin == roll(x, hd/2) * sin_signed, bit for bit
        out = x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
    else:
        out = x * cos[:, None] + rotate_half(x) * sin[:, None]
    return out if out.dtype == x.dtype else out.to(x.dtype)


def prepare_rope(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, S, hd] -> [B, 1, S, hd] with sin's first half negated, which
    :func:`apply_rope` applies with one roll instead of rotate_half's chunk/neg/cat (fewer
    ops per layer; (-a) * b == a * (-b) exactly, so the result is the same). Prepare once per
    forward, every layer reuses it."""
    h = sin.shape[-1] // 2
    return cos[:, None], torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)[:, None]


# --------------------------------------------------------------------------- attention


def key_padding_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, S] bool (True = real) -> SDPA mask [B, 1, 1, S] (True = may be attended)."""
    return mask[:, None, None, :]


def expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, KVH, S, hd] -> [B, KVH * n_rep, S, hd] (query head h reads kv head h // n_rep)."""
    if n_rep == 1:
        return x
    b, kvh, s, hd = x.shape
    return x[:, :, None].expand(b, kvh, n_rep, s, hd).reshape(b, kvh * n_rep, s, hd)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float | None = None) -> torch.Tensor:
    """The attention core: q [B, H, S, hd], k/v [B, KVH, L, hd] (H a multiple of KVH),
    mask bool broadcastable to [B, H, S, L] (True = attend) -> heads merged [B, S, H * hd].
    ``scale`` None is SDPA's own 1/sqrt(hd), which is not always the same float as the
    ``hd ** -0.5`` the official Qwen3 code passes: each caller keeps its own."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and q.device.type == "cpu" and not torch.onnx.is_in_onnx_export():
        # the kernel maps query heads to K/V heads itself: no copy of K/V per query head (at 64
        # rows over the talker's cache that copy was ~8 % of a step); same bits on CPU (tested)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, expand_kv(k, rep), expand_kv(v, rep), attn_mask=mask, scale=scale)
    b, h, s, hd = out.shape
    return out.transpose(1, 2).reshape(b, s, h * hd)


class ScaledDotProduct(nn.Module):
    """:func:`attend` with its scale, as a module: the attention core a model hands its K/V views
    (engines/models/kv_access.py), which a quantizer may swap (quantize_nbits.OrtAttention)."""

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return attend(q, k, v, mask, self.scale)


class Attention(nn.Module):
    """Projections around :func:`attend` (``q_proj/k_proj/v_proj/o_proj``). Grouped-query
    when ``num_kv_heads`` < ``num_heads``; cross-attention when ``kv_dim`` is set (keys and
    values from a memory of that width); Qwen3's per-head ``q_norm/k_norm`` when
    ``qk_norm_eps`` is set; ``scale`` as in :func:`attend`."""

    def __init__(self, dim: int, num_heads: int, kv_dim: int | None = None, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = False, qk_norm_eps: float | None = None,
                 scale: float | None = None):
        super().__init__()
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"hidden size {dim} is not divisible by {num_heads} heads")
            head_dim = dim // num_heads
        self.n_heads, self.n_kv, self.head_dim = num_heads, num_kv_heads or num_heads, head_dim
        if self.n_heads % self.n_kv:
            raise ValueError(f"num_attention_heads {self.n_heads} not divisible by num_key_value_heads {self.n_kv}")
        self.scale = scale
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(kv_dim or dim, self.n_kv * head_dim, bias=bias)
        self.v_proj = nn.Linear(kv_dim or dim, self.n_kv * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        # (x, cos, sin) -> normed and rotated (q, k, v) [B, S, heads * hd] in one call, set by a
        # quantizer (engines/models/quantize_nbits.py NormQKV): a module swapped in, not a branch per caller
        self.qkv_proj: nn.Module | None = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)  # per head
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
            memory: torch.Tensor | None = None):
        """x [B, S, D] (keys/values from ``memory`` [B, L, kv_dim] if given) -> q [B, H, S, hd],
        k/v [B, KVH, S or L, hd]; q and k normed (qk norm) and rotated (when cos/sin are given)."""
        src = x if memory is None else memory
        # view with the inputs' own sizes (not unflatten): the TorchScript ONNX exporter then
        # keeps the time axis of v (and of the carried K/V windows sliced from it) dynamic.
        (b, s), n = x.shape[:2], src.shape[1]
        if self.qkv_proj is not None and memory is None:  # norms, projections and RoPE in the module's one call
            q, k, v = self.qkv_proj(x, cos, sin)
            return (q.view(b, s, self.n_heads, -1).transpose(1, 2), k.view(b, s, self.n_kv, -1).transpose(1, 2),
                    v.view(b, s, self.n_kv, -1).transpose(1, 2))
        if self.qkv_weight is not None and memory is None and b * s <= self.fused_rows:  # ``fuse_qkv``: one GEMM
            q, k, v = F.linear(x, self.qkv_weight).split(self._qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(src), self.v_proj(src)
        q = q.view(b, s, self.n_heads, self.head_dim)
        k = k.view(b, n, self.n_kv, self.head_dim)
        v = v.view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    qkv_weight: torch.Tensor | None = None
    fused_rows: float = float("inf")  # more rows: the separate GEMMs (``choose_fused_rows``)

    @torch.no_grad()
    def fuse_qkv(self) -> None:
        """One [q; k; v] weight matrix for self-attention without biases; the three parameters
        become views of it (no extra memory, state_dict unchanged). Call after the module is on
        its device and dtype."""
        if self.qkv_weight is not None or not all(isinstance(p, nn.Linear) for p in (
                self.q_proj, self.k_proj, self.v_proj)) or self.q_proj.bias is not None or (
                self.q_proj.in_features != self.k_proj.in_features):
            return  # fused already, quantized, biased, or cross-attention
        projs = (self.q_proj, self.k_proj, self.v_proj)
        fused = torch.cat([p.weight for p in projs])
        self._qkv_sizes = [p.out_features for p in projs]
        for p, w in zip(projs, fused.split(self._qkv_sizes)):
            p.weight.data = w
        self.qkv_weight = fused

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, S, hd], k/v [B, KVH, L, hd], mask broadcastable to [B, H, S, L] -> [B, S, D]."""
        return self.o_proj(attend(q, k, v, mask, self.scale))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, memory: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """No cache: x [B, S, D], memory [B, L, kv_dim] or None (= x), rope (cos, sin) or None."""
        q, k, v = self.qkv(x, *(rope or (None, None)), memory=memory)
        return self.attend(q, k, v, mask)


# --------------------------------------------------------------------------- decoder layer


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class DecoderLayer(nn.Module):
    """The Qwen3 pre-norm layer: x + attn(norm(x)), then + mlp(norm(x)); each branch
    LayerScaled when ``layer_scale`` is set (the codec decoder's). ``cfg`` carries the
    Qwen3 keys (hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
    head_dim, rms_norm_eps). Models with a KV cache call ``qkv`` then ``finish`` around
    their own cache writes (the talker: ``after_attention`` around a K/V access object,
    engines/models/kv_access.py); ``forward`` is the cache-free layer."""

    def __init__(self, cfg, *, qk_norm: bool = True, bias: bool = False, layer_scale: float | None = None):
        super().__init__()
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                                   head_dim=cfg.head_dim, bias=bias, scale=cfg.head_dim**-0.5,
                                   qk_norm_eps=cfg.rms_norm_eps if qk_norm else None)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer_scale is not None:
            self.self_attn_layer_scale = LayerScale(cfg.hidden_size, layer_scale)
            self.mlp_layer_scale = LayerScale(cfg.hidden_size, layer_scale)
        else:
            self.self_attn_layer_scale = self.mlp_layer_scale = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S, D] -> q [B, H, S, hd], k/v [B, KVH, S, hd] of the normed input (rotated)."""
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """The residual attention (over k/v [B, KVH, L, hd]) and MLP branches -> [B, S, D]."""
        return self.after_attention(x, self.self_attn.attend(q, k, v, mask))

    def after_attention(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """x + the attention branch ``a`` (after o_proj) [B, S, D], then the MLP branch."""
        x = x + (self.self_attn_layer_scale(a) if self.self_attn_layer_scale is not None else a)
        m = self.mlp(self.post_attention_layernorm(x))
        return x + (self.mlp_layer_scale(m) if self.mlp_layer_scale is not None else m)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.finish(x, *self.qkv(x, cos, sin), mask)


def choose_fused_rows(fused: torch.Tensor, sizes: list[int], rows: tuple[int, ...] = (1, 8, 64),
                      reps: int = 9, margin: float = 1.08) -> float:
    """The most rows at which one GEMM over the fused weight (then split) is not slower than
    one GEMM per part, measured here (median thread CPU time over ``reps``; both give the same
    bits on CPU). Above it the separate GEMMs run; inf when fused wins at every size tried
    (e.g. on this project's 2-core CPU, separate ones are ~15 % faster from 8 rows up)."""
    import time

    parts = fused.split(sizes)
    best = 0.0
    for r in rows:
        x = torch.randn(r, fused.shape[1], dtype=fused.dtype, device=fused.device)

        def median(fn) -> float:
            fn()
            samples = []
            for _ in range(reps):
                t0 = time.thread_time()
                fn()
                samples.append(time.thread_time() - t0)
            return sorted(samples)[reps // 2]

        one = median(lambda x=x: F.linear(x, fused).split(sizes, dim=-1))
        several = median(lambda x=x: [F.linear(x, p) for p in parts])
        if one > margin * several:  # clearly slower (equal within noise: fewer ops, keep fused)
            return best if best else 0.0
        best = float(r)
    return float("inf")


def compile_block_call(fn, backend: str):
    """``torch.compile`` for a function that calls one repeated block (a layer as its first
    argument): one compiled graph serves every block, step and batch size (dynamic shapes;
    sizes 0 and 1 are specialised, so a handful of variants), so the recompile limit is
    raised above what those variants can reach. ``fullgraph``: a graph break is an error."""
    import torch._dynamo

    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    return torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)
