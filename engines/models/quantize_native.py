"""The quantized talker and code predictor handed to the native frame (engines/native/), CPU.

    frame = NativeFrame.build(talker, predictor, mode)   # engines/models/quantize.py, when native.available()
    codes, h = frame(h, code0, text, ...)                # engines/pipelines/talker/decode.py: one call a frame

The weights are packed exactly as the ONNX Runtime path packs them (quantize_nbits.pack_nbits:
MatMulNBits' blocks of 128, fp32 scale, u8 zero point), so both paths hold the same codes and
the same int8 activations; what differs is the float rounding of the sums, norms and attention
(docs/QUANTIZATION.md, "The native frame"). The arrays stay referenced here: the C structs hold
their addresses.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from engines import native
from engines.models.quantize_nbits import pack_nbits


def _ptr(array: np.ndarray | torch.Tensor | None, ctype=ctypes.c_float):
    if array is None:
        return None
    address = array.data_ptr() if isinstance(array, torch.Tensor) else array.ctypes.data
    return ctypes.cast(address, ctypes.POINTER(ctype))


class NativeLinear:
    """One weight matrix [N, K] in ``bits``-bit blocks of 128, with its (fp32) bias."""

    @staticmethod
    def supports(k: int) -> bool:
        return k % native.QBLOCK == 0

    def __init__(self, weight: torch.Tensor, bits: int, bias: torch.Tensor | None = None):
        n, k = weight.shape
        if not self.supports(k):
            raise ValueError(f"the native kernels take input widths that are multiples of {native.QBLOCK}, not {k}")
        packed, scales, zeros, _ = pack_nbits(weight, bits, native.QBLOCK)
        self.arrays = [np.ascontiguousarray(packed), np.ascontiguousarray(scales), np.ascontiguousarray(zeros)]
        self.bias = None if bias is None else bias.detach().to("cpu", torch.float32).contiguous()
        self.struct = native.QLinear(_ptr(self.arrays[0], ctypes.c_uint8), _ptr(self.arrays[1]),
                                     _ptr(self.arrays[2], ctypes.c_uint8), _ptr(self.bias), n, k, bits, 0)
        self.weight_bytes = sum(a.nbytes for a in self.arrays)
        self.weight_elems = n * k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] (the kernels alone: tests and benchmarks)."""
        a = x.reshape(-1, self.struct.k).float().contiguous()
        y = torch.empty(a.shape[0], self.struct.n)
        if native.lib.sv_qlinear_forward(ctypes.byref(self.struct), a.shape[0], a.data_ptr(), y.data_ptr()):
            raise MemoryError("the native kernel could not allocate its activation buffers")
        return y.view(*x.shape[:-1], self.struct.n)



def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", torch.float32).contiguous()


class NativeFrame:
    """The talker's decoder layers, the code predictor (layers, heads, input projection, embedding
    tables) and their norms, as the native frame reads them (engines/native/talker_frame.c)."""

    @staticmethod
    def supports(talker: torch.nn.Module, predictor: torch.nn.Module) -> str | None:
        """None when the native frame can run these models, else why not (the ONNX Runtime path runs)."""
        if not native.available():
            return "the native extension was not built (no C compiler at install)"
        for name, model in (("talker", talker), ("code predictor", predictor)):
            cfg = model.cfg
            attn = model.model.layers[0].self_attn
            widths = {cfg.hidden_size, cfg.intermediate_size, attn.n_heads * attn.head_dim}
            if any(w % native.QBLOCK for w in widths):
                return f"the {name}'s widths {sorted(widths)} are not all multiples of {native.QBLOCK}"
            if attn.head_dim % 16 or attn.head_dim > 512:
                return f"the {name}'s head size {attn.head_dim} is not a multiple of 16 up to 512"
            if any(getattr(p, "bias", None) is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)):
                return f"the {name}'s attention projections have biases"
        if predictor.cfg.talker_hidden_size % native.QBLOCK:
            return f"the talker width {predictor.cfg.talker_hidden_size} is not a multiple of {native.QBLOCK}"
        return None

    def __init__(self, talker: torch.nn.Module, predictor: torch.nn.Module, talker_bits: int, predictor_bits: int):
        """From the fp32 models (before quantize_talker strips their layers)."""
        self._keep: list = []  # everything the structs point into
        self.linears: list[NativeLinear] = []
        self.groups, self.vocab = predictor.cfg.num_code_groups, predictor.cfg.vocab_size
        self.talker_hidden = talker.cfg.hidden_size
        self.talker_layers = len(talker.model.layers)
        t_dec = self._decoder(talker.model.layers, talker.model.norm, talker_bits)
        p_dec = self._decoder(predictor.model.layers, predictor.model.norm, predictor_bits)
        heads = (native.QLinear * len(predictor.lm_head))(*[self._linear(h.weight, predictor_bits).struct
                                                             for h in predictor.lm_head])
        proj = None
        if isinstance(predictor.small_to_mtp_projection, torch.nn.Linear):
            lin = predictor.small_to_mtp_projection
            proj = ctypes.pointer(self._linear(lin.weight, predictor_bits, lin.bias).struct)
        tables = [self._tensor(e.weight) for e in predictor.model.codec_embedding]
        emb = (ctypes.POINTER(ctypes.c_float) * len(tables))(*[_ptr(t) for t in tables])
        from engines.models.layers import prepare_rope, rope_cos_sin

        g = self.groups
        cos, sin = prepare_rope(*rope_cos_sin(predictor.inv_freq.float().cpu(), torch.arange(g)[None], torch.float32))
        cos, sin = self._tensor(cos.reshape(g, -1)), self._tensor(sin.reshape(g, -1))
        self._keep += [heads, proj, emb]
        self.model = native.Model(t_dec, p_dec, heads, proj, _ptr(self._tensor(talker.model.codec_embedding.weight)),
                                  emb, _ptr(cos), _ptr(sin), g, self.vocab, self.talker_hidden, 0)
        self.weight_bytes = sum(m.weight_bytes for m in self.linears)

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        t = _f32(t)
        self._keep.append(t)
        return t

    def _linear(self, weight: torch.Tensor, bits: int, bias: torch.Tensor | None = None) -> NativeLinear:
        lin = NativeLinear(weight, bits, bias)
        self.linears.append(lin)
        return lin

    def _decoder(self, layers, norm, bits: int) -> native.Decoder:
        structs = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = self._linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), bits)
            o = self._linear(attn.o_proj.weight, bits)
            gate_up = self._linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), bits)
            down = self._linear(mlp.down_proj.weight, bits)
            q_norm = None if attn.q_norm is None else _ptr(self._tensor(attn.q_norm.weight))
            k_norm = None if attn.k_norm is None else _ptr(self._tensor(attn.k_norm.weight))
            structs.append(native.Layer(qkv.struct, o.struct, gate_up.struct, down.struct,
                                        _ptr(self._tensor(layer.input_layernorm.weight)),
                                        _ptr(self._tensor(layer.post_attention_layernorm.weight)), q_norm, k_norm))
        array = (native.Layer * len(structs))(*structs)
        self._keep.append(array)
        attn, first = layers[0].self_attn, layers[0]
        qk_eps = attn.q_norm.eps if attn.q_norm is not None else first.input_layernorm.eps
        scale = attn.scale if attn.scale is not None else attn.head_dim ** -0.5
        return native.Decoder(attn.q_proj.in_features, attn.n_heads, attn.n_kv, attn.head_dim,
                              first.mlp.gate_proj.out_features, len(structs), first.input_layernorm.eps, qk_eps,
                              scale, 0.0, array, _ptr(self._tensor(norm.weight)))

    def __call__(self, h: torch.Tensor, code0: torch.Tensor, sampling=None, gumbel: torch.Tensor | None = None,
                 text: torch.Tensor | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 cache=None, write_slots: torch.Tensor | None = None, table: torch.Tensor | None = None,
                 lengths: torch.Tensor | None = None, forced: torch.Tensor | None = None,
                 return_logits: bool = False):
        """One frame for B rows: h [B, Dt] (the talker's last hidden state), code0 [B] (codec ids) ->
        (codes [B, G], the talker's new hidden state [B, Dt] or None, the predictor's logits
        [B, G - 1, V] or None). With ``text`` (the talker step: text parts [B, Dt], ``rope`` (cos, sin) [B, hd]
        prepared, the paged ``cache`` with each row's ``write_slots`` [B], block ``table`` [B, blocks] and
        ``lengths`` [B]) the talker's step runs too. ``sampling``: the rows'
        FrameSampling (None: greedy); ``gumbel`` [B, G - 1, V]: its noise for codes 1.. (None: every
        row greedy). ``forced`` [B, G - 1]: teacher-forced codes, fed to the later passes and to the talker
        step (the logits are then code i's given them); ``return_logits``: the logits are returned."""
        b, g, v = h.shape[0], self.groups, self.vocab
        keep = []

        def arg(t, dtype):
            if t is None:
                return None
            t = t.to(dtype).contiguous()
            keep.append(t)
            return t.data_ptr()

        codes = torch.empty(b, g, dtype=torch.int64)
        h_out = torch.empty(b, self.talker_hidden) if text is not None else None
        logits = torch.empty(b, g - 1, v) if return_logits else None
        if sampling is None:
            greedy, temperature, top_k = torch.ones(b, dtype=torch.uint8), torch.ones(b), torch.zeros(b, dtype=torch.int64)
        else:
            greedy, temperature, top_k = sampling.greedy, sampling.temperature, sampling.top_k
        args = native.FrameArgs(rows=b, run_talker=int(text is not None), h=arg(h, torch.float32),
                                code0=arg(code0, torch.int64), forced=arg(forced, torch.int64),
                                greedy=arg(greedy, torch.uint8), temperature=arg(temperature, torch.float32),
                                top_k=arg(top_k, torch.int64), gumbel=arg(gumbel, torch.float32),
                                codes=codes.data_ptr(), logits=None if logits is None else logits.data_ptr())
        if text is not None:
            pools = [(ctypes.c_void_p * len(cache.k))(*[t.data_ptr() for t in cache.k]),
                     (ctypes.c_void_p * len(cache.v))(*[t.data_ptr() for t in cache.v])]
            keep.append(pools)
            table = arg(table, torch.int64)
            args.block_size, args.table_stride = cache.block_size, keep[-1].shape[1]
            args.text, args.cos, args.sin = arg(text, torch.float32), arg(rope[0], torch.float32), arg(rope[1], torch.float32)
            args.pool_k, args.pool_v = ctypes.addressof(pools[0]), ctypes.addressof(pools[1])
            args.write_slot, args.table, args.length = arg(write_slots, torch.int64), table, arg(lengths, torch.int64)
            args.h_out = h_out.data_ptr()
        if native.lib.sv_frame(ctypes.byref(self.model), ctypes.byref(args)):
            raise MemoryError("the native frame could not allocate its work buffers")
        return codes, h_out, logits





def predictor_gumbel(sampling, groups: int, vocab: int) -> torch.Tensor:
    """The Gumbel noise of codes 1..G-1 for every row [B, G - 1, V]: for code i, keyed by (seed,
    DOMAIN_CODES, frame * G + i, id), as CodePredictor.predict draws it through sample_rows, so a
    seeded request samples the same codes on both paths."""
    from engines.models.sampling import DOMAIN_CODES, keyed_gumbel

    b, g = len(sampling), groups - 1
    counters = (sampling.frame * groups)[:, None] + torch.arange(1, groups, device=sampling.frame.device)
    noise = keyed_gumbel(sampling.seed_lo.repeat_interleave(g), sampling.seed_hi.repeat_interleave(g), DOMAIN_CODES,
                         counters.reshape(-1), vocab)
    return noise.view(b, g, vocab)


__all__ = ["NativeFrame", "NativeLinear", "predictor_gumbel"]
