"""4- and 8-bit weights for the talker and its code predictor on ONNX Runtime, CPU
(``--quantize int4``, and ``int8`` where onnxruntime is installed).

    n = convert_layer(layer, bits=4)    # engines/models/quantize.py calls it per decoder layer
    head = NBitsLinear(linear, bits=4)  # any other linear layer

A CPU decode step is weight-bound (batch 1 reads every weight once per row-step), so fewer
bytes per weight is the lever. The multiply is ONNX Runtime's ``MatMulNBits``
(com.microsoft contrib op, MLAS kernels): 4- or 8-bit weights in blocks of ``BLOCK`` input
channels, each block with its own fp32 scale and zero point (asymmetric, the block's
min/max), and ``accuracy_level=4``: each call quantises its input rows to int8 (per block)
and accumulates in int32 with VNNI / AVX2 dot products, so int4 is int4 weights AND dynamic
int8 activations, as torch's int8 kernel (``quantized::linear_dynamic``) is int8 weights and
activations. Why this kernel (docs/QUANTIZATION.md "Choosing the int4 kernel"): at the 0.6B
shapes, batch 1, weights streamed from memory, its int4 is 1.3-1.8x faster than torch's int8
kernel at ``BLOCK`` 128 and its int8 as fast; torch's own int4 kernels
(``_weight_int4pack_mm_for_cpu``, ``_dyn_quant_matmul_4bit``) were 3-100x slower than int8.

A step at these sizes is also dispatch-bound (~75 small torch ops per decoder layer), so a
decoder layer's modules are swapped for three ORT calls (``convert_layer``), and the layer's own
forward runs on them (gpt-fast swaps ``nn.Linear`` for its quantized linear the same way):
* ``NormQKV`` (``Attention.qkv_proj``): input RMSNorm -> one q/k/v matmul -> per-head q/k RMSNorm
  -> RoPE on q and k (the tables ``layers.prepare_rope`` gives: x * cos + roll(x, hd/2) * sin, as
  ``apply_rope`` computes it);
* ``o_proj``: an ``NBitsLinear``;
* ``NormMLP`` (the layer's ``mlp``): post-attention RMSNorm -> one gate/up matmul -> SiLU(gate) * up
  -> down.
Attention between them is the model's: the K/V cache written and read by torch, over torch's SDPA or
``OrtAttention`` (ORT's CPU kernel, ~2x faster on prompts) where quantize_talker swaps it in. Each
call binds the torch inputs and fresh torch outputs by pointer (no copies, ~5 us). (The code
predictor's layers go further, one call per pass: engines/models/quantize_predictor.py, on
``_Graph`` here.) Every session shares one ORT thread pool (``ensure_pool``: half of torch's
intra-op threads unless the caller says), with no spinning workers (they would take torch's cores
between calls).
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch import nn

BLOCK = 128  # input channels per scale / zero point (docs/QUANTIZATION.md: speed and fidelity)
OPSET = 17

_pool_lock = threading.Lock()
_pool_threads: int | None = None  # the shared ORT pool's size once made; 0: per-session pools
_session_threads = 1  # each session's own pool then


BITS = (4, 8)


def available() -> bool:
    """Whether onnxruntime (and onnx, which builds the graphs) can be imported."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def default_threads() -> int:
    """The ORT pool's size when the caller names none: half of torch's intra-op threads. On a small
    machine the codec decoder, the event loop and the OS need the rest: measured on the project's
    2 shared cores, a served-like int4 step took 109-113 ms with 1 ORT thread and 155-320 ms with 2
    (each of the ~320 calls per frame waits for both threads; one preempted thread stalls it)."""
    return max(1, torch.get_num_threads() // 2)


def ensure_pool(threads: int | None = None) -> int:
    """Make the process-wide ORT thread pool every layer's session shares (``threads``, else
    :func:`default_threads`) unless one exists; -> its size (0: ORT was started elsewhere in this
    process first, and each session gets its own pool of ``threads``)."""
    from onnxruntime.capi import _pybind_state as C

    global _pool_threads, _session_threads
    with _pool_lock:
        if _pool_threads is None:
            threads = threads or default_threads()
            _session_threads = threads
            try:
                C.set_global_thread_pool_sizes(threads, 1)  # refused once ORT's environment exists
                _pool_threads = threads
            except Exception:  # ORT already started in this process (another backend): own pools
                _pool_threads = 0
        return _pool_threads


def _session_options():
    import onnxruntime as ort

    ensure_pool()
    so = ort.SessionOptions()
    if _pool_threads:
        so.use_per_session_threads = False
    else:
        so.intra_op_num_threads, so.inter_op_num_threads = _session_threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


MIN_BLOCK = 16  # MatMulNBits' smallest block
FP32_REASON = f"not a multiple of {MIN_BLOCK}, MatMulNBits' smallest block"


def block_for(k: int, block: int = BLOCK) -> int | None:
    """The block size used for ``k`` input channels: ``block``, halved until it divides ``k``
    (small test models); None when not even MatMulNBits' smallest block (16) divides ``k``: that
    layer stays fp32 (``_Graph.nbits_matmul``)."""
    while block > MIN_BLOCK and k % block:
        block //= 2
    return None if k % block else block


def pack_nbits(w: torch.Tensor, bits: int, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor]:
    """w [N, K] (K a multiple of ``block``) -> MatMulNBits' B [N, K/block, block * bits/8] uint8 (4 bits:
    two codes a byte, low nibble first), scales [N * K/block] fp32, zero points (4 bits: packed alike,
    [N * ceil(K/block / 2)]; 8 bits: [N * K/block]) uint8, and the weight the codes stand for
    (dequantised, [N, K] fp32)."""
    if bits not in BITS:
        raise ValueError(f"MatMulNBits layers take {BITS} bits, not {bits}")
    w = w.detach().to("cpu", torch.float32)
    n, k = w.shape
    if k % block:
        raise ValueError(f"{k} input channels are not a multiple of the block {block}")
    top = (1 << bits) - 1
    blocks = w.reshape(n, k // block, block)
    lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)  # 0 stays exact
    scale = ((hi - lo) / top).clamp_min(1e-12)
    zero = torch.round(-lo / scale).clamp(0, top)
    q = torch.round(blocks / scale[..., None] + zero[..., None]).clamp(0, top).to(torch.uint8)
    dequant = ((q.float() - zero[..., None]) * scale[..., None]).reshape(n, k)
    z = zero.to(torch.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
        if z.shape[1] % 2:
            z = torch.cat([z, torch.zeros(n, 1, dtype=torch.uint8)], dim=1)
        z = z[:, 0::2] | (z[:, 1::2] << 4)
    return (q.contiguous().numpy(), scale.reshape(-1).numpy().astype(np.float32),
            z.reshape(-1).contiguous().numpy(), dequant)


class _Graph:
    """A small ORT graph with one input X [rows, width_in] and one output Y [rows, width_out],
    called on torch tensors by pointer. Builds its nodes with ``op``/``nbits_matmul``/``rms_norm``."""

    def __init__(self, name: str, width_in: int):
        from onnx import helper

        self.helper = helper
        self.name, self.width_in = name, width_in
        self.nodes, self.inits, self.weight_bytes, self.weight_elems = [], [], 0, 0
        self.kept_fp32: list[tuple[int, int]] = []  # [N, K] of the matrices left in fp32 (block_for: None)
        self._n = 0

    def fresh(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    def const(self, stem: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.fresh(stem)
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        outs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(self.helper.make_node(op_type, inputs, outs, domain=domain, **attrs))
        return outs

    def nbits_matmul(self, x: str, w: torch.Tensor, bits: int, block: int = BLOCK) -> str:
        """x @ w.T with w [N, K] in ``bits``-bit blocks; a plain fp32 MatMul where no block divides
        K (a checkpoint with odd widths degrades per matrix instead of refusing to load)."""
        n, k = w.shape
        block = block_for(k, block)
        if block is None:
            wt = w.detach().to("cpu", torch.float32).T.contiguous().numpy()
            self.kept_fp32.append((n, k))
            self.weight_bytes += wt.nbytes
            self.weight_elems += n * k
            return self.op("MatMul", [x, self.const("w", wt)])[0]
        packed, scales, zeros, _ = pack_nbits(w, bits, block)
        self.weight_bytes += packed.nbytes + scales.nbytes + zeros.nbytes
        self.weight_elems += n * k
        return self.op("MatMulNBits", [x, self.const("w", packed), self.const("scales", scales),
                                       self.const("zeros", zeros)], domain="com.microsoft", K=k, N=n, bits=bits,
                       block_size=block, accuracy_level=4)[0]

    def rms_norm(self, x: str, norm: nn.Module, heads: int | None = None, lead: int = 1) -> str:
        """RMSNorm over the last axis (per head of ``heads`` when given: [rows, heads * hd], or
        [B, S, heads * hd] with ``lead`` 2)."""
        weight = self.const("norm", norm.weight.detach().to("cpu", torch.float32).numpy())
        if heads is None:
            return self.op("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=float(norm.eps))[0]
        hd = norm.weight.numel()
        keep = [-1] if lead == 1 else [0] * lead  # 0: the input's own size
        split = self.op("Reshape", [x, self.const("shape", np.array([*keep, heads, hd], np.int64))])[0]
        normed = self.op("SimplifiedLayerNormalization", [split, weight], axis=-1, epsilon=float(norm.eps))[0]
        return self.op("Reshape", [normed, self.const("shape", np.array([*keep, heads * hd], np.int64))])[0]

    def norm_qkv(self, x: str, norm: nn.Module, attn: nn.Module, bits: int, block: int = BLOCK,
                 lead: int = 1) -> list[str]:
        """RMSNorm(x) -> one q/k/v matmul -> q and k RMSNormed per head: -> q, k, v [rows, heads * hd]
        (x [rows, D]; or [B, S, heads * hd] from x [B, S, D] with ``lead`` 2)."""
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        if any(p.bias is not None for p in projs):
            raise ValueError("biased q/k/v projections are not supported")
        sizes = [p.out_features for p in projs]
        qkv = self.nbits_matmul(self.rms_norm(x, norm), torch.cat([p.weight for p in projs]), bits, block)
        q, k, v = self.op("Split", [qkv, self.const("sizes", np.array(sizes, np.int64))], n_out=3, axis=-1)
        if attn.q_norm is not None:
            q, k = self.rms_norm(q, attn.q_norm, attn.n_heads, lead), self.rms_norm(k, attn.k_norm, attn.n_kv, lead)
        return [q, k, v]

    def rope(self, x: str, heads: int, head_dim: int, cos: str, sin: str) -> str:
        """x [B, S, heads * hd] rotated by prepared tables ``cos`` / ``sin`` [B or 1, S, 1, hd] (sin's
        first half negated): x * cos + roll(x, hd/2) * sin per head, as ``layers.apply_rope``."""
        i64 = lambda *v: self.const("i", np.array(v, np.int64))  # noqa: E731
        half = head_dim // 2
        x = self.op("Reshape", [x, i64(0, 0, heads, head_dim)])[0]
        lo, hi = self.op("Split", [x, i64(half, half)], n_out=2, axis=-1)
        rolled = self.op("Concat", [hi, lo], axis=-1)[0]
        y = self.op("Add", [self.op("Mul", [x, cos])[0], self.op("Mul", [rolled, sin])[0]])[0]
        return self.op("Reshape", [y, i64(0, 0, heads * head_dim)])[0]

    def norm_mlp(self, x: str, norm: nn.Module, mlp: nn.Module, bits: int, block: int = BLOCK) -> str:
        """RMSNorm(x) -> down(SiLU(gate) * up), gate and up one matmul."""
        hidden = mlp.gate_proj.out_features
        gate_up = self.nbits_matmul(self.rms_norm(x, norm), torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                                    bits, block)
        gate, up = self.op("Split", [gate_up, self.const("sizes", np.array([hidden, hidden], np.int64))], n_out=2,
                           axis=-1)
        act = self.op("Mul", [self.op("Mul", [gate, self.op("Sigmoid", [gate])[0]])[0], up])[0]
        return self.nbits_matmul(act, mlp.down_proj.weight, bits, block)

    def finish(self, y: str, width_out: int) -> "_Graph":
        self.width_out = width_out
        return self.build({"X": ["rows", self.width_in]}, {"Y": (y, ["rows", width_out])})

    def build(self, inputs: dict[str, list], outputs: dict[str, tuple[str, list]], opset: int = OPSET) -> "_Graph":
        """The session: ``inputs`` {name: dims}, fp32, or {name: (onnx element type, dims)}, and fp32
        ``outputs`` {name: (the node output it is, dims)}; dims are ints or symbolic names. An output
        that is an input too (a buffer updated in place) gets no copy."""
        import onnxruntime as ort
        from onnx import TensorProto

        h = self.helper
        for name, (y, _) in outputs.items():
            if y != name:
                self.nodes.append(h.make_node("Identity", [y], [name]))

        def typed(dims):
            return dims if isinstance(dims, tuple) else (TensorProto.FLOAT, dims)

        graph = h.make_graph(self.nodes, self.name,
                             [h.make_tensor_value_info(n, *typed(dims)) for n, dims in inputs.items()],
                             [h.make_tensor_value_info(n, TensorProto.FLOAT, dims) for n, (_, dims) in outputs.items()],
                             initializer=self.inits)
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset), h.make_opsetid("com.microsoft", 1)])
        self.session = ort.InferenceSession(model.SerializeToString(), _session_options(),
                                            providers=["CPUExecutionProvider"])
        self.binding = self.session.io_binding()
        self.nodes = self.inits = None  # the session holds the weights now
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., width_in] fp32 -> [..., width_out]."""
        a = x.reshape(-1, self.width_in)
        if a.dtype != torch.float32 or not a.is_contiguous():
            a = a.float().contiguous()
        y = torch.empty(a.shape[0], self.width_out)
        b = self.binding
        b.bind_input("X", "cpu", 0, np.float32, list(a.shape), a.data_ptr())
        b.bind_output("Y", "cpu", 0, np.float32, list(y.shape), y.data_ptr())
        self.session.run_with_iobinding(b)
        return y.view(*x.shape[:-1], self.width_out)


class NBitsLinear(nn.Module):
    """A frozen ``nn.Linear`` with blockwise 4- or 8-bit weights (bias added in torch)."""

    def __init__(self, linear: nn.Linear, bits: int, block: int = BLOCK):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        g = _Graph(f"int{bits}_linear", self.in_features)
        self._graph = g.finish(g.nbits_matmul("X", linear.weight, bits, block), self.out_features)
        self.weight_bytes, self.weight_elems, self.kept_fp32 = g.weight_bytes, g.weight_elems, g.kept_fp32
        self.register_buffer("bias_", None if linear.bias is None else
                             linear.bias.detach().to("cpu", torch.float32).clone())

    @property
    def bias(self):  # read by the fusing code: a quantized layer is never fused
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._graph(x)
        return y if self.bias_ is None else y + self.bias_


def _bind(binding, name: str, t: torch.Tensor, output: bool = False) -> None:
    """A contiguous fp32 (or bool) CPU tensor bound to a session's input or output by pointer."""
    dtype = np.bool_ if t.dtype == torch.bool else np.float32
    (binding.bind_output if output else binding.bind_input)(name, "cpu", 0, dtype, list(t.shape), t.data_ptr())


class NormQKV(nn.Module):
    """The attention's input side in one call (``Attention.qkv_proj``): RMSNorm(x) -> [q; k; v] (one
    matmul) -> q and k RMSNormed per head -> q and k rotated; -> q, k, v [B, S, H * hd] / [B, S, KVH * hd]."""

    def __init__(self, norm: nn.Module, attn: nn.Module, bits: int, block: int = BLOCK):
        super().__init__()
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.sizes = [p.out_features for p in projs]
        self.heads, self.n_kv, hd = attn.n_heads, attn.n_kv, attn.head_dim
        self.in_features, self.out_features = projs[0].in_features, sum(self.sizes)
        g = _Graph(f"int{bits}_norm_qkv", self.in_features)
        q, k, v = g.norm_qkv("X", norm, attn, bits, block, lead=2)
        cos, sin = (g.op("Unsqueeze", [t, g.const("i", np.array([2], np.int64))])[0] for t in ("cos", "sin"))
        q, k = g.rope(q, self.heads, hd, cos, sin), g.rope(k, self.n_kv, hd, cos, sin)
        self.dims = {"q": self.heads * hd, "k": self.n_kv * hd, "v": self.n_kv * hd}
        g.build({"X": ["b", "s", self.in_features], "cos": ["r", "s", hd], "sin": ["r", "s", hd]},
                {name: (t, ["b", "s", self.dims[name]]) for name, t in zip("qkv", (q, k, v))})
        self._graph = g
        self.weight_bytes, self.weight_elems, self.kept_fp32 = g.weight_bytes, g.weight_elems, g.kept_fp32

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, S, D]; cos/sin [B or 1, 1, S, hd] prepared (``prepare_rope``), or [B, S, hd] plain."""
        from engines.models.layers import prepare_rope

        b, s, _ = x.shape
        if cos.dim() == 3:
            cos, sin = prepare_rope(cos, sin)
        inputs = {"X": x, "cos": cos.reshape(cos.shape[0], s, -1), "sin": sin.reshape(sin.shape[0], s, -1)}
        inputs = {name: t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()
                  for name, t in inputs.items()}  # alive until the run (bound by pointer)
        outputs = {name: torch.empty(b, s, width) for name, width in self.dims.items()}
        binding = self._graph.binding
        for name, t in inputs.items():
            _bind(binding, name, t)
        for name, t in outputs.items():
            _bind(binding, name, t, output=True)
        self._graph.session.run_with_iobinding(binding)
        return outputs["q"], outputs["k"], outputs["v"]


ATTENTION_OPSET = 23  # the ONNX Attention operator with kv_num_heads


class OrtAttention(nn.Module):
    """The attention core on ONNX Runtime's ``Attention`` operator (grouped-query heads), in place of
    ``layers.ScaledDotProduct`` (torch's SDPA) where quantize_talker swaps it in: ORT's CPU kernel
    attends a prompt in about half the time (one core, 0.6B sizes: a 512-position chunk 13 vs 24 ms a
    layer, 65 positions 0.27 vs 0.57 ms; one decode position about the same). The same sums in
    another order: rounding-level differences from SDPA."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        from onnx import TensorProto

        self.scale = scale
        g = _Graph("attention", heads * head_dim)
        a = g.op("Attention", ["q", "keys", "values", "mask"], q_num_heads=heads, kv_num_heads=kv_heads,
                 scale=float(scale))[0]
        g.build({"q": ["b", "s", heads * head_dim], "keys": ["b", "l", kv_heads * head_dim],
                 "values": ["b", "l", kv_heads * head_dim], "mask": (TensorProto.BOOL, ["b", 1, "s", "l"])},
                {"Y": (a, ["b", "s", heads * head_dim])}, opset=ATTENTION_OPSET)
        self._graph = g

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, S, hd], k/v [B, KVH, L, hd], mask [B, 1, S, L] bool (True = attend) -> [B, S, H * hd]."""
        b, h, s, hd = q.shape
        length = k.shape[2]
        # heads back to the last axis: views of what NormQKV and the paged gather hand over (no copy)
        inputs = {"q": q.transpose(1, 2).reshape(b, s, h * hd), "keys": k.transpose(1, 2).reshape(b, length, -1),
                  "values": v.transpose(1, 2).reshape(b, length, -1), "mask": mask}
        inputs = {name: t.contiguous() for name, t in inputs.items()}  # alive until the run (bound by pointer)
        y = torch.empty(b, s, h * hd)
        binding = self._graph.binding
        for name, t in inputs.items():
            _bind(binding, name, t)
        _bind(binding, "Y", y, output=True)
        self._graph.session.run_with_iobinding(binding)
        return y


class NormMLP(nn.Module):
    """The MLP branch in one call: RMSNorm(x) -> down(SiLU(gate) * up), gate and up one matmul."""

    gate_up = None  # never fused by SwiGLU.fuse (engines/models/layers.py): nothing to fuse

    def __init__(self, norm: nn.Module, mlp: nn.Module, bits: int, block: int = BLOCK):
        super().__init__()
        self.in_features, self.out_features = mlp.gate_proj.in_features, mlp.down_proj.out_features
        g = _Graph(f"int{bits}_norm_mlp", self.in_features)
        self._graph = g.finish(g.norm_mlp("X", norm, mlp, bits, block), self.out_features)
        self.weight_bytes, self.weight_elems, self.kept_fp32 = g.weight_bytes, g.weight_elems, g.kept_fp32

    def fuse(self) -> None:  # called by Talker.fuse_projections on every layer's MLP
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._graph(x)


def convert_layer(layer: nn.Module, bits: int, block: int = BLOCK) -> int:
    """A Qwen3 ``DecoderLayer`` (engines/models/layers.py) in place: its norms, projections and
    RoPE swapped for the three calls of the module docstring (its forward unchanged). -> linear
    layers replaced (7)."""
    attn = layer.self_attn
    attn.qkv_proj = NormQKV(layer.input_layernorm, attn, bits, block)
    attn.q_proj = attn.k_proj = attn.v_proj = None
    attn.q_norm = attn.k_norm = None  # inside qkv_proj, as RoPE is
    attn.o_proj = NBitsLinear(attn.o_proj, bits, block)
    layer.mlp = NormMLP(layer.post_attention_layernorm, layer.mlp, bits, block)
    layer.input_layernorm = layer.post_attention_layernorm = nn.Identity()  # inside the calls
    return 7


__all__ = ["BITS", "BLOCK", "FP32_REASON", "MIN_BLOCK", "NBitsLinear", "NormMLP", "NormQKV", "OrtAttention", "available",
           "block_for", "convert_layer", "default_threads", "ensure_pool", "pack_nbits"]
