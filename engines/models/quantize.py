"""Int8 or int4 weights for the talker and its code predictor (``--quantize``), CPU.

    quantize_talker(talker, predictor, "int8")   # in place, before TalkerSource is built
    quantize_talker(talker, predictor, "int4")
    quantize_talker(talker, predictor, "int8-int4p")   # talker int8, code predictor int4

What a decode step reads is weights (fp32: 6.6 GB per frame at the released 0.6B sizes, 15
code predictor passes included), so fewer bytes per weight is the lever on CPU. Every linear
layer of the talker's and the predictor's decoder layers, the predictor's 15 heads and its
input projection get quantized weights; embeddings, the talker's codec head (compact rows)
and everything outside the decoder stay fp32.

* With onnxruntime installed (a dependency of the package), every mode runs on ONNX Runtime's
  ``MatMulNBits`` (engines/models/quantize_nbits.py): weights in blocks of 128 input channels
  with a scale and zero point each, int8 activations. A CPU step is dispatch-bound as well as
  weight-bound, so the small ops go inside the ORT graphs too. Each talker layer's modules are
  swapped for three calls (quantize_nbits.convert_layer: norms, q/k/v and RoPE; o_proj; the MLP)
  and its one forward runs on them, the K/V cache written and read by torch between them, and
  the talker's attention core is ORT's (``OrtAttention``, faster on prompts than torch's SDPA).
  The code predictor's layers run as ONE call per pass (engines/models/quantize_predictor.py:
  norms, RoPE, attention over its own K/V cache). ``fused=False`` keeps torch's attention in the
  talker and the predictor's layers as three calls each, as predictors whose head size ORT's
  attention refuses do.
* Where the native extension was built (engines/native/, engines/models/quantize_native.py), the
  decode step runs as ONE native call a frame on the same packed weights (``talker.native_frame``,
  ``native=``); prefill and top-p rows stay on the ORT graphs above.
* Without onnxruntime, int8 falls back to one ``Int8Linear`` per layer: PyTorch's x86 int8 kernel
  (``quantized::linear_dynamic``, FBGEMM / oneDNN with VNNI where the CPU has it), weights
  symmetric per output channel (scale = max |w| / 127 of each row), each call quantising its
  input rows to 8 bits (per tensor) and accumulating in int32. The weight-only kernel
  (``aten::_weight_int8pack_mm``, fp32 activations) measured 3-4x SLOWER than fp32 on this
  project's CPU; the dynamic one 3.7-4.3x faster at batch 1 and 7-10x at batch 8.

Greedy codes are no longer the official ones: docs/QUANTIZATION.md reports, per mode, code-0
agreement with fp32, its KL divergence and the waveform SNR, and the rule that picks
``CPU_DEFAULT``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engines.hardware.cpu_features import has_vnni

log = logging.getLogger("streamvox.quantize")

# mode -> (bits of the talker's decoder layers, bits of the code predictor's layers, heads and input
# projection). ``int8-int4p``: the talker (which picks code 0) in int8, the predictor (15 passes a
# frame, ~3/4 of the weights read) in int4 (docs/QUANTIZATION.md, "The mixed mode").
MODE_BITS = {"int8": (8, 8), "int4": (4, 4), "int8-int4p": (8, 4)}
QUANTIZE_MODES = tuple(MODE_BITS)
# The CPU default (``--quantize auto``): the fastest mode that passes the fidelity rule of
# docs/QUANTIZATION.md ("Choosing the CPU default"), measured by benchmarks/quantize_fidelity.py.
CPU_DEFAULT = "int8"


def resolve_quantize(requested: str | None, device: torch.device, dtype: torch.dtype, talker: bool) -> str | None:
    """The mode a built engine runs: ``None``/``"none"`` -> fp32 (None); ``"auto"`` -> ``CPU_DEFAULT`` for
    a talker on a CPU in float32 (int8 where int4's onnxruntime is missing), else None; a named mode
    as asked (``quantize_talker`` refuses what cannot run it)."""
    if requested in (None, "none"):
        return None
    if requested != "auto":
        return requested
    if not talker or device.type != "cpu" or dtype != torch.float32:
        return None
    if 4 in MODE_BITS[CPU_DEFAULT]:
        from engines.models import quantize_nbits

        if not quantize_nbits.available():
            return "int8"
    return CPU_DEFAULT


# 8-bit activations where the kernel cannot saturate (agreement with fp32 measured higher:
# docs/QUANTIZATION.md), 7-bit elsewhere.
REDUCE_RANGE = not has_vnni()


class Int8Linear(nn.Module):
    """A frozen ``nn.Linear`` with per-output-channel int8 weights (see the module docstring)."""

    def __init__(self, linear: nn.Linear, reduce_range: bool = REDUCE_RANGE):
        super().__init__()
        w = linear.weight.detach().to("cpu", torch.float32)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scales = (w.abs().amax(dim=1).clamp_min(1e-12) / 127.0).double()
        q = torch.quantize_per_channel(w, scales, torch.zeros(w.shape[0], dtype=torch.int64), 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().to("cpu", torch.float32)
        self._packed = torch.ops.quantized.linear_prepack(q, bias)
        self.reduce_range = reduce_range  # 7-bit activations (see REDUCE_RANGE)
        self.weight_bytes = w.numel() + scales.numel() * 4

    @property
    def bias(self):  # read by the fusing code: a quantized layer is never fused
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]), self._packed, self.reduce_range)
        return y.reshape(*shape[:-1], self.out_features)


def _swap_linears(module: nn.Module, make) -> int:
    """Every nn.Linear under ``module`` -> ``make(linear)``, in place; -> how many."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
            n += 1
        else:
            n += _swap_linears(child, make)
    return n


def _ort_bits(mode: str) -> tuple[int, int] | None:
    """ONNX Runtime's (talker, predictor) bits for ``mode`` (engines/models/quantize_nbits.py), or
    None: int4 always runs there (an error without onnxruntime), int8 where onnxruntime is installed
    (else torch's int8 kernel, one ``Int8Linear`` per layer)."""
    from engines.models import quantize_nbits

    if quantize_nbits.available():
        return MODE_BITS[mode]
    if 4 in MODE_BITS[mode]:
        raise ValueError(f"--quantize {mode} needs onnxruntime and onnx (pip install onnxruntime onnx)")
    return None


def quantize_talker(talker: nn.Module, predictor: nn.Module, mode: str, threads: int | None = None,
                    fused: bool = True, native: bool | None = None) -> int:
    """In place: the decoder layers' linear layers of both models (and the predictor's heads
    and input projection) -> int8 or int4 weights (``MODE_BITS``: the talker's and the predictor's
    bits). -> the number of layers converted.
    ``threads``: ONNX Runtime's pool (None: half of torch's threads, quantize_nbits.default_threads;
    the pool is made once per process). ``fused`` (on ONNX Runtime): the predictor's layers as one
    call per pass (engines/models/quantize_predictor.py) instead of three calls per layer
    (quantize_nbits.convert_layer, as the talker's layers always are), and the talker's attention
    on ORT's kernel (quantize_nbits.OrtAttention) instead of torch's. ``native`` (None: where it can run): also the
    native frame (engines/models/quantize_native.py, ``talker.native_frame``), which runs each
    decode step in one call; prefill and the code predictor's own ``predict`` stay on ONNX Runtime."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZE_MODES)}")
    for model in (talker, predictor):
        p = next(model.parameters())
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise ValueError(f"--quantize {mode} runs on CPU in float32 (got {p.device.type}, {p.dtype}); "
                             f"on CUDA use --dtype bfloat16")
        for layer in model.model.layers:
            if getattr(layer.self_attn, "qkv_weight", None) is not None or getattr(layer.mlp, "gate_up", None) is not None:
                raise ValueError("quantize before the projections are fused (before TalkerSource is built)")
    talker_layers, predictor_layers = list(talker.model.layers), list(predictor.model.layers)
    bits = _ort_bits(mode)
    if bits:
        from engines.models.quantize_nbits import NBitsLinear, OrtAttention, convert_layer, ensure_pool
        from engines.models.quantize_predictor import NBitsPredictorLayers

        talker_bits, predictor_bits = bits
        ensure_pool(threads)
        if fused and native is not False:
            _attach_native(talker, predictor, talker_bits, predictor_bits, required=bool(native))
        n = 0
        if fused and NBitsPredictorLayers.supports(predictor.cfg):
            predictor.fused_layers = NBitsPredictorLayers(predictor, predictor_bits)
            n += 7 * len(predictor_layers)
            predictor.model.layers = nn.ModuleList()  # inside fused_layers now
            predictor_layers = []
        if fused:  # the talker's attention over its K/V on ORT's kernel (one session serves every layer)
            attn = talker_layers[0].self_attn
            talker.attention_core = OrtAttention(attn.n_heads, attn.n_kv, attn.head_dim, talker.attention_core.scale)
        # each decoder layer as three ORT calls with its norms and RoPE inside (quantize_nbits.py)
        n += sum(convert_layer(layer, talker_bits) for layer in talker_layers)
        n += sum(convert_layer(layer, predictor_bits) for layer in predictor_layers)

        def make(linear):  # the predictor's heads and input projection
            return NBitsLinear(linear, predictor_bits)
    else:
        make = Int8Linear
        n = sum(_swap_linears(layer, make) for layer in talker_layers + predictor_layers)
    n += _swap_linears(predictor.lm_head, make)
    if isinstance(predictor.small_to_mtp_projection, nn.Linear):
        predictor.small_to_mtp_projection = make(predictor.small_to_mtp_projection)
        n += 1
    kept = kept_fp32(talker, predictor)
    if kept:  # degrade per matrix rather than refuse the checkpoint (docs/QUANTIZATION.md, "Odd widths")
        from engines.models.quantize_nbits import FP32_REASON

        widths = ", ".join(map(str, sorted({k for _, k in kept})))
        log.warning("--quantize %s: %d of the talker's and code predictor's weight matrices stay fp32: their input "
                    "widths (%s) are %s", mode, len(kept), widths, FP32_REASON)
    return n


def _attach_native(talker: nn.Module, predictor: nn.Module, talker_bits: int, predictor_bits: int,
                   required: bool) -> None:
    """``talker.native_frame`` from the fp32 layers (before they are converted), where it can run."""
    from engines.models.quantize_native import NativeFrame

    why_not = NativeFrame.supports(talker, predictor)
    if why_not is None:
        talker.native_frame = NativeFrame(talker, predictor, talker_bits, predictor_bits)
        from engines import native

        log.info("talker decode step: one native call a frame (%s kernels)", native.get_isa())
    elif required:
        raise ValueError(f"the native frame cannot run: {why_not}")
    else:
        log.info("talker decode step on ONNX Runtime: %s", why_not)


def kept_fp32(talker: nn.Module, predictor: nn.Module) -> list[tuple[int, int]]:
    """[N, K] of every weight matrix a quantized talker / predictor keeps in fp32 (no block of
    MatMulNBits divides its input width)."""
    return [shape for model in (talker, predictor) for m in model.modules() for shape in getattr(m, "kept_fp32", ())]


__all__ = ["CPU_DEFAULT", "MODE_BITS", "QUANTIZE_MODES", "Int8Linear", "kept_fp32", "quantize_talker", "resolve_quantize"]
