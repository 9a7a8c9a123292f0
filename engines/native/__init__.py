"""The talker's native frame (engines/native/talker_frame.c), loaded with ctypes.

    from engines import native
    if native.available():
        native.set_isa("avx2")              # tests: pin an instruction set (default: the best this CPU has)
        native.lib.sv_frame(model, args)    # one frame; ctypes releases the GIL for the call

The extension is built by the package's install (setup.py, ``optional=True``): without a C compiler
``pip install`` still succeeds, :func:`available` is False and the quantized talker runs on ONNX
Runtime as before (engines/models/quantize.py). Nothing is compiled at run time.
The structs below mirror the C ones field for field; engines/models/quantize_native.py fills them.
"""

from __future__ import annotations

import ctypes
import importlib.util
from ctypes import POINTER, c_float, c_int, c_int32, c_int64, c_size_t, c_uint8, c_uint64, c_void_p
from functools import cache

from engines.hardware.cpu_features import cpu_flags

ISAS = ("scalar", "avx2", "avx512vnni")  # the C enum's order
# the flags each needs (engines/hardware/cpu_features.py reads them): the C side checks the CPU again before use
ISA_FLAGS = {"scalar": set(), "avx2": {"avx2", "fma"},
             "avx512vnni": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "fma"}}
QBLOCK = 128  # input channels per block: the only block size the native kernels take


class QLinear(ctypes.Structure):
    _fields_ = [("w", POINTER(c_uint8)), ("scale", POINTER(c_float)), ("zero", POINTER(c_uint8)),
                ("bias", POINTER(c_float)), ("n", c_int32), ("k", c_int32), ("bits", c_int32), ("pad", c_int32)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", QLinear), ("o", QLinear), ("gate_up", QLinear), ("down", QLinear),
                ("input_norm", POINTER(c_float)), ("post_norm", POINTER(c_float)), ("q_norm", POINTER(c_float)),
                ("k_norm", POINTER(c_float))]


class Decoder(ctypes.Structure):
    _fields_ = [("hidden", c_int32), ("heads", c_int32), ("kv_heads", c_int32), ("head_dim", c_int32),
                ("intermediate", c_int32), ("n_layers", c_int32), ("eps", c_float), ("qk_eps", c_float),
                ("attn_scale", c_float), ("pad", c_float), ("layers", POINTER(Layer)), ("final_norm", POINTER(c_float))]


class Model(ctypes.Structure):
    _fields_ = [("talker", Decoder), ("predictor", Decoder), ("heads", POINTER(QLinear)), ("proj", POINTER(QLinear)),
                ("talker_codec_emb", POINTER(c_float)), ("pred_codec_emb", POINTER(POINTER(c_float))),
                ("pred_cos", POINTER(c_float)), ("pred_sin", POINTER(c_float)), ("groups", c_int32),
                ("vocab", c_int32), ("talker_hidden", c_int32), ("pad", c_int32)]


class FrameArgs(ctypes.Structure):
    _fields_ = [("rows", c_int32), ("run_talker", c_int32), ("block_size", c_int32), ("table_stride", c_int32),
                ("h", c_void_p), ("code0", c_void_p), ("forced", c_void_p), ("greedy", c_void_p),
                ("temperature", c_void_p), ("top_k", c_void_p), ("gumbel", c_void_p), ("text", c_void_p),
                ("cos", c_void_p), ("sin", c_void_p), ("pool_k", c_void_p), ("pool_v", c_void_p),
                ("write_slot", c_void_p), ("table", c_void_p), ("length", c_void_p), ("codes", c_void_p),
                ("h_out", c_void_p), ("logits", c_void_p)]


@cache
def _load():
    spec = importlib.util.find_spec("engines.native._talker_frame")
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.sv_frame.argtypes = [POINTER(Model), POINTER(FrameArgs)]
    lib.sv_frame.restype = c_int
    lib.sv_qlinear_forward.argtypes = [POINTER(QLinear), c_int, c_void_p, c_void_p]
    lib.sv_qlinear_forward.restype = c_int
    lib.sv_exps.argtypes = [c_void_p, c_float, c_void_p, c_int]
    lib.sv_exps.restype = None
    lib.sv_read_bytes.argtypes = [c_void_p, c_size_t]
    lib.sv_read_bytes.restype = c_uint64
    for name in ("sv_set_isa", "sv_isa_supported"):
        getattr(lib, name).argtypes = [c_int]
        getattr(lib, name).restype = c_int
    lib.sv_get_isa.argtypes = []
    lib.sv_get_isa.restype = c_int
    lib.sv_set_isa(ISAS.index(best_isa()))
    return lib


def available() -> bool:
    """Whether the extension was built (and loads on this machine)."""
    try:
        return _load() is not None
    except OSError:
        return False


def __getattr__(name: str):
    if name == "lib":  # native.lib: the loaded library (an error when it was not built)
        lib = _load()
        if lib is None:
            raise ImportError("the native talker frame was not built (pip install needs a C compiler for it)")
        return lib
    raise AttributeError(name)


def supported_isas() -> list[str]:
    """The instruction sets this CPU runs the kernels with, by its flags, slowest first."""
    flags = cpu_flags()
    return [isa for isa in ISAS if ISA_FLAGS[isa] <= flags]


def best_isa() -> str:
    return supported_isas()[-1]


def set_isa(isa: str) -> None:
    """Run the kernels with ``isa`` (one of :data:`ISAS`); ValueError where this CPU lacks it."""
    if isa not in supported_isas() or _load().sv_set_isa(ISAS.index(isa)) != 0:
        raise ValueError(f"this CPU cannot run the {isa} kernels (it has: {', '.join(supported_isas())})")


def get_isa() -> str:
    return ISAS[_load().sv_get_isa()]


__all__ = ["FrameArgs", "ISAS", "Layer", "Model", "QBLOCK", "QLinear", "available", "best_isa", "get_isa", "set_isa",
           "supported_isas"]
