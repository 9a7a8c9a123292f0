"""Int4 weights for the talker and its code predictor (``--quantize int4``), CPU.

    n = convert_layer(layer)            # engines/models/quantize.py calls it per decoder layer
    head = Int4Linear(linear)           # any other linear layer

A CPU decode step is weight-bound (batch 1 reads every weight once per row-step), so half
of int8's bytes is the next lever. The multiply is ONNX Runtime's ``MatMulNBits``
(com.microsoft contrib op, MLAS kernels): 4-bit weights in blocks of ``BLOCK`` input
channels, each block with its own fp32 scale and 4-bit zero point (asymmetric, the block's
min/max), and ``accuracy_level=4``: each call quantises its input rows to int8 (per block)
and accumulates in int32 with VNNI / AVX2 dot products, so it is int4 weights AND dynamic
int8 activations, as the int8 mode (``quantized::linear_dynamic``) is int8 weights and
activations. Why this kernel (docs/QUANTIZATION.md "Choosing the int4 kernel"): at the 0.6B
shapes, batch 1, weights streamed from memory, it is 1.3-1.8x faster than the int8 kernel
at ``BLOCK`` 128; torch's own int4 kernels (``_weight_int4pack_mm_for_cpu``,
``_dyn_quant_matmul_4bit``) were 3-100x slower than int8 on this CPU.

A step at these sizes is also dispatch-bound (~75 small torch ops per decoder layer), so a
decoder layer runs as three ORT calls around torch's attention:
* ``Int4NormQKV``: input RMSNorm -> one q/k/v matmul -> per-head q/k RMSNorm;
* ``o_proj``: an ``Int4Linear``;
* ``Int4NormMLP``: post-attention RMSNorm -> one gate/up matmul -> SiLU(gate) * up -> down.
Each call binds the torch input and a fresh torch output by pointer (no copies, ~5 us).
Every session shares one ORT thread pool sized like torch's intra-op pool when the first is
made, with no spinning workers (they would take torch's cores between calls).
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


def available() -> bool:
    """Whether onnxruntime (and onnx, which builds the graphs) can be imported."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def _session_options():
    import onnxruntime as ort
    from onnxruntime.capi import _pybind_state as C

    global _pool_threads
    with _pool_lock:
        if _pool_threads is None:
            threads = torch.get_num_threads()
            try:
                C.set_global_thread_pool_sizes(threads, 1)  # refused once ORT's environment exists
                _pool_threads = threads
            except Exception:  # ORT already started in this process (another backend): own pools
                _pool_threads = 0
    so = ort.SessionOptions()
    if _pool_threads:
        so.use_per_session_threads = False
    else:
        so.intra_op_num_threads, so.inter_op_num_threads = torch.get_num_threads(), 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


def block_for(k: int, block: int = BLOCK) -> int:
    """The block size used for ``k`` input channels: ``block``, halved until it divides ``k``
    (small test models); at least 16, MatMulNBits' smallest."""
    while block > 16 and k % block:
        block //= 2
    if k % block:
        raise ValueError(f"int4: {k} input channels are not a multiple of 16")
    return block


def pack_int4(w: torch.Tensor, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor]:
    """w [N, K] (K a multiple of ``block``) -> MatMulNBits' B [N, K/block, block/2] uint8 (two 4-bit
    codes a byte, low nibble first), scales [N * K/block] fp32, zero points [N * ceil(K/block / 2)]
    uint8 (packed alike), and the weight the codes stand for (dequantised, [N, K] fp32)."""
    w = w.detach().to("cpu", torch.float32)
    n, k = w.shape
    if k % block:
        raise ValueError(f"int4: {k} input channels are not a multiple of the block {block}")
    blocks = w.reshape(n, k // block, block)
    lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)  # 0 stays exact
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(blocks / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()
    z = zero.to(torch.uint8)
    if z.shape[1] % 2:
        z = torch.cat([z, torch.zeros(n, 1, dtype=torch.uint8)], dim=1)
    zp = (z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1).contiguous()
    dequant = ((q.float() - zero[..., None]) * scale[..., None]).reshape(n, k)
    return packed.numpy(), scale.reshape(-1).numpy().astype(np.float32), zp.numpy(), dequant


class _Graph:
    """A small ORT graph with one input X [rows, width_in] and one output Y [rows, width_out],
    called on torch tensors by pointer. Builds its nodes with ``op``/``int4_matmul``/``rms_norm``."""

    def __init__(self, name: str, width_in: int):
        from onnx import helper

        self.helper = helper
        self.name, self.width_in = name, width_in
        self.nodes, self.inits, self.weight_bytes, self.weight_elems = [], [], 0, 0
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

    def int4_matmul(self, x: str, w: torch.Tensor, block: int = BLOCK) -> str:
        n, k = w.shape
        block = block_for(k, block)
        packed, scales, zeros, _ = pack_int4(w, block)
        self.weight_bytes += packed.nbytes + scales.nbytes + zeros.nbytes
        self.weight_elems += n * k
        return self.op("MatMulNBits", [x, self.const("w", packed), self.const("scales", scales),
                                       self.const("zeros", zeros)], domain="com.microsoft", K=k, N=n, bits=4,
                       block_size=block, accuracy_level=4)[0]

    def rms_norm(self, x: str, norm: nn.Module, heads: int | None = None) -> str:
        """RMSNorm over the last axis (per head of ``heads`` when given: [rows, heads * hd])."""
        weight = self.const("norm", norm.weight.detach().to("cpu", torch.float32).numpy())
        if heads is None:
            return self.op("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=float(norm.eps))[0]
        hd = norm.weight.numel()
        split = self.op("Reshape", [x, self.const("shape", np.array([-1, heads, hd], np.int64))])[0]
        normed = self.op("SimplifiedLayerNormalization", [split, weight], axis=-1, epsilon=float(norm.eps))[0]
        return self.op("Reshape", [normed, self.const("shape", np.array([-1, heads * hd], np.int64))])[0]

    def finish(self, y: str, width_out: int) -> "_Graph":
        import onnxruntime as ort
        from onnx import TensorProto

        h = self.helper
        self.nodes.append(h.make_node("Identity", [y], ["Y"]))
        graph = h.make_graph(self.nodes, self.name, [h.make_tensor_value_info("X", TensorProto.FLOAT, ["rows", self.width_in])],
                             [h.make_tensor_value_info("Y", TensorProto.FLOAT, ["rows", width_out])],
                             initializer=self.inits)
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET), h.make_opsetid("com.microsoft", 1)])
        self.session = ort.InferenceSession(model.SerializeToString(), _session_options(),
                                            providers=["CPUExecutionProvider"])
        self.binding = self.session.io_binding()
        self.width_out = width_out
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


class Int4Linear(nn.Module):
    """A frozen ``nn.Linear`` with blockwise int4 weights (bias added in torch)."""

    def __init__(self, linear: nn.Linear, block: int = BLOCK):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        g = _Graph("int4_linear", self.in_features)
        self._graph = g.finish(g.int4_matmul("X", linear.weight, block), self.out_features)
        self.weight_bytes, self.weight_elems = g.weight_bytes, g.weight_elems
        self.register_buffer("bias_", None if linear.bias is None else
                             linear.bias.detach().to("cpu", torch.float32).clone())

    @property
    def bias(self):  # read by the fusing code: a quantized layer is never fused
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._graph(x)
        return y if self.bias_ is None else y + self.bias_


class Int4NormQKV(nn.Module):
    """The attention's input side in one call: RMSNorm(x) -> [q; k; v] (one int4 matmul) -> q and
    k RMSNormed per head; -> q, k, v [..., H * hd] / [..., KVH * hd] (views of one output)."""

    def __init__(self, norm: nn.Module, attn: nn.Module, block: int = BLOCK):
        super().__init__()
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        if any(p.bias is not None for p in projs):
            raise ValueError("int4: biased q/k/v projections are not supported")
        self.sizes = [p.out_features for p in projs]
        self.in_features, self.out_features = projs[0].in_features, sum(self.sizes)
        g = _Graph("int4_norm_qkv", self.in_features)
        qkv = g.int4_matmul(g.rms_norm("X", norm), torch.cat([p.weight for p in projs]), block)
        q, k, v = g.op("Split", [qkv, g.const("sizes", np.array(self.sizes, np.int64))], n_out=3, axis=-1)
        if attn.q_norm is not None:
            q, k = g.rms_norm(q, attn.q_norm, attn.n_heads), g.rms_norm(k, attn.k_norm, attn.n_kv)
        self._graph = g.finish(g.op("Concat", [q, k, v], axis=-1)[0], self.out_features)
        self.weight_bytes, self.weight_elems = g.weight_bytes, g.weight_elems

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._graph(x).split(self.sizes, dim=-1)


class Int4NormMLP(nn.Module):
    """The MLP branch in one call: RMSNorm(x) -> down(SiLU(gate) * up), gate and up one matmul."""

    gate_up = None  # never fused by SwiGLU.fuse (engines/models/layers.py): nothing to fuse

    def __init__(self, norm: nn.Module, mlp: nn.Module, block: int = BLOCK):
        super().__init__()
        self.in_features, hidden = mlp.gate_proj.in_features, mlp.gate_proj.out_features
        self.out_features = mlp.down_proj.out_features
        g = _Graph("int4_norm_mlp", self.in_features)
        gate_up = g.int4_matmul(g.rms_norm("X", norm), torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), block)
        gate, up = g.op("Split", [gate_up, g.const("sizes", np.array([hidden, hidden], np.int64))], n_out=2, axis=-1)
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])[0]])[0], up])[0]
        self._graph = g.finish(g.int4_matmul(act, mlp.down_proj.weight, block), self.out_features)
        self.weight_bytes, self.weight_elems = g.weight_bytes, g.weight_elems

    def fuse(self) -> None:  # called by Talker.fuse_projections on every layer's MLP
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._graph(x)


def convert_layer(layer: nn.Module, block: int = BLOCK) -> int:
    """A Qwen3 ``DecoderLayer`` (engines/models/layers.py) in place: its norms and projections
    into the three int4 calls of the module docstring. -> linear layers replaced (7)."""
    attn = layer.self_attn
    attn.qkv_proj = Int4NormQKV(layer.input_layernorm, attn, block)
    attn.q_proj = attn.k_proj = attn.v_proj = None
    attn.q_norm = attn.k_norm = None  # inside qkv_proj
    attn.o_proj = Int4Linear(attn.o_proj, block)
    layer.mlp = Int4NormMLP(layer.post_attention_layernorm, layer.mlp, block)
    layer.input_layernorm = layer.post_attention_layernorm = nn.Identity()  # inside the calls
    return 7


__all__ = ["BLOCK", "block_for", "Int4Linear", "Int4NormMLP", "Int4NormQKV", "available", "convert_layer", "pack_int4"]
