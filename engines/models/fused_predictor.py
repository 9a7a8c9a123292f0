"""The code predictor's whole frame (15 codebook passes) as fused Triton kernels.

    fused = FusedCodePredictor(predictor, mode="persistent")    # or "phased"
    codes = fused.predict(h, code0_emb, sampling)                # as CodePredictor.predict

A frame is a chain of dependent steps: per pass, per layer, (1) RMSNorm + QKV + q/k norm + RoPE +
K/V write, (2) attention, (3) o_proj + residual, (4) RMSNorm + gate/up + SiLU, (5) down + residual;
then the final norm + this pass's head, the sampling and the next pass's embedding (+ the input
projection where the talker is wider). Each step needs every column of the one before for every
row, so every SM must finish it before any starts the next. Two ways run that chain, with the
same phase functions (engines/models/triton_blocks.py):

* ``persistent``: ONE launch per frame, one program per SM, a grid-wide barrier between steps
  (~27 per pass): no launch gaps, weights streamed once per pass for all rows.
* ``phased``: one launch per step (~400 per frame, replayed inside the talker step's CUDA graph);
  no inter-program synchronisation, so it does not depend on every program being resident.

Pass 0 carries two positions per row (the talker hidden and code 0's embedding), passes 1.. one;
every token row's K/V lives in a static cache [rows * GP, KVH, hd] (GP = G rounded up to a power
of two: a row's block) and attention reads it as paged attention reads the talker's pool
(engines/models/paged_attention.py). Sampling is ``sample_rows``'s, in the kernel: top-k,
temperature, top-p, Gumbel-max over the counter-based noise keyed by (seed, DOMAIN_CODES,
frame * G + code index, token id), greedy rows by argmax; the sampled code selects the next
pass's embedding row on the device. Nothing is read back to the host.

The reference is ``CodePredictor.predict`` (the generic loop): the kernels are held to it under
Triton's interpreter on the CPU (tests/engines/models/test_fused_predictor.py) and on a GPU by
``scripts/gpu-verify.sh fused``. On the engine it replaces the graphed loop inside the talker
step when switched on (``STREAMVOX_FUSED_PREDICTOR``; off by default until measured on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engines.models.code_predictor import CodePredictor
from engines.models.layers import prepare_rope, rope_cos_sin
from engines.models.sampling import DOMAIN_CODES, FrameSampling
from engines.models.triton_blocks import (
    TileConfig,
    counter_prefix,
    frame_attention_phase,
    gate_up_phase,
    grid_barrier,
    interpreting,
    kernels_run_on,
    linear_phase,
    pow2,
    qkv_rope_phase,
    residual_linear_phase,
    sample_rows_tile,
    stack_as_views,
    tiles_for,
    triton,
)

if triton is not None:
    import triton.language as tl

    _DOMAIN = tl.constexpr(DOMAIN_CODES)  # the code predictor's noise domain

MODES = ("phased", "persistent")


def sampling_kind(sampling: FrameSampling) -> int:
    """The kernel's sampling variant from the batch's host flags: 0 greedy, 1 sampled, 2 with top-p."""
    return 0 if sampling.all_greedy else 2 if sampling.any_top_p else 1


# --------------------------------------------------------------------------- weights


@dataclass
class PredictorWeights:
    """The predictor's parameters as stacked tensors (layers, heads, tables), views of the modules'."""

    qkv: torch.Tensor  # [L, (H + 2 KVH) * hd, D]: q rows, k rows, v rows
    qk_norm: torch.Tensor  # [L, 2 hd]: q's, k's
    o: torch.Tensor  # [L, D, H * hd]
    gate_up: torch.Tensor  # [L, 2 I, D]: gate rows, up rows
    down: torch.Tensor  # [L, D, I]
    norms: torch.Tensor  # [L, 2 D]: input, post-attention
    final_norm: torch.Tensor  # [D]
    heads: torch.Tensor  # [G - 1, V, D]
    tables: torch.Tensor  # [G - 1, V, D_talker]
    proj_w: torch.Tensor | None  # [D, D_talker] (small_to_mtp_projection) or None (identity)
    proj_b: torch.Tensor | None

    @staticmethod
    @torch.no_grad()
    def stack(predictor: CodePredictor) -> "PredictorWeights":
        layers = list(predictor.model.layers)
        if predictor.fused_layers is not None or not layers:
            raise ValueError("the fused kernels need the plain predictor layers (not quantized)")
        attn, mlp = [l.self_attn for l in layers], [l.mlp for l in layers]
        qkv = stack_as_views([[a.q_proj.weight, a.k_proj.weight, a.v_proj.weight] for a in attn])
        gate_up = stack_as_views([[m.gate_proj.weight, m.up_proj.weight] for m in mlp])
        for a, m, fused_qkv, fused_gu in zip(attn, mlp, qkv, gate_up):  # fused at load: the same matrices
            a.qkv_weight = fused_qkv if a.qkv_weight is not None else None
            m.gate_up = fused_gu if m.gate_up is not None else None
        proj = predictor.small_to_mtp_projection
        linear = isinstance(proj, nn.Linear)
        return PredictorWeights(
            qkv=qkv, qk_norm=stack_as_views([[a.q_norm.weight, a.k_norm.weight] for a in attn]),
            o=stack_as_views([[a.o_proj.weight] for a in attn]), gate_up=gate_up,
            down=stack_as_views([[m.down_proj.weight] for m in mlp]),
            norms=stack_as_views([[l.input_layernorm.weight, l.post_attention_layernorm.weight] for l in layers]),
            final_norm=predictor.model.norm.weight.detach(),
            heads=stack_as_views([[h.weight] for h in predictor.lm_head]),
            tables=stack_as_views([[e.weight] for e in predictor.model.codec_embedding]),
            proj_w=proj.weight.detach() if linear else None, proj_b=proj.bias.detach() if linear else None)


# --------------------------------------------------------------------------- scratch


@dataclass
class Scratch:
    """Device buffers of one frame for up to ``rows`` rows; addresses fixed (CUDA graphs read them)."""

    rows: int
    xin: torch.Tensor  # [2 rows, D_talker]: a pass's inputs before the projection
    x: torch.Tensor  # [2 rows, D] residual stream
    q: torch.Tensor  # [2 rows, H * hd]
    attn: torch.Tensor  # [2 rows, H * hd]
    act: torch.Tensor  # [2 rows, I]
    k: torch.Tensor  # [L, rows * GP, KVH, hd]
    v: torch.Tensor
    logits: torch.Tensor  # [rows, V] fp32, this pass's
    record: torch.Tensor  # [rows, G - 1, V] fp32: every pass's logits (return_logits)
    codes: torch.Tensor  # [rows, G - 1] int64
    tokens: torch.Tensor  # [4, G - 1, 2 rows] int64: per pass and token, its KV slot, position, block, length
    barrier: torch.Tensor  # [1] int32

    @staticmethod
    def allocate(rows: int, cfg, gp: int, device, dtype) -> "Scratch":
        def z(*shape, dt=dtype):
            return torch.zeros(shape, dtype=dt, device=device)

        g1, t = cfg.num_code_groups - 1, 2 * rows
        hq = cfg.num_attention_heads * cfg.head_dim
        tok = torch.arange(t)
        # pass 0: token 2r + j is row r at position j; pass p >= 1: token r is row r at position p + 1
        blk = torch.stack([tok // 2] + [tok] * (g1 - 1))
        pos = torch.stack([tok % 2] + [torch.full_like(tok, p + 1) for p in range(1, g1)])
        tokens = torch.stack([blk * gp + pos, pos, blk, pos + 1]).to(device)
        kv = (cfg.num_hidden_layers, rows * gp, cfg.num_key_value_heads, cfg.head_dim)
        return Scratch(rows, z(t, cfg.talker_hidden_size), z(t, cfg.hidden_size), z(t, hq), z(t, hq),
                       z(t, cfg.intermediate_size), z(*kv), z(*kv), z(rows, cfg.vocab_size, dt=torch.float32),
                       z(rows, g1, cfg.vocab_size, dt=torch.float32), z(rows, g1, dt=torch.int64), tokens,
                       z(1, dt=torch.int32))


# --------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _input_phase(pid, nprog, n_rows, h_ptr, c0_ptr, dst_ptr, DT, DTP: tl.constexpr):
        """Pass 0's inputs: token 2r is h[r], token 2r + 1 code 0's embedding of row r."""
        d = tl.arange(0, DTP)
        ok = d < DT
        for t in range(pid, 2 * n_rows, nprog):
            r = t // 2
            odd = (d * 0 + t) % 2 == 1  # as a tensor: the interpreter cannot AND a scalar into a mask
            h = tl.load(h_ptr + r * DT + d, mask=ok & ~odd, other=0.0)
            c = tl.load(c0_ptr + r * DT + d, mask=ok & odd, other=0.0)
            tl.store(dst_ptr + t * DT + d, h + c, mask=ok)  # one of the two is zero: exact

    @triton.jit
    def _sample_phase(pid, nprog, n_rows, p, logits_ptr, record_ptr, V, seed_lo_ptr, seed_hi_ptr, frame_ptr,
                      greedy_ptr, temp_ptr, top_k_ptr, top_p_ptr, codes_ptr, tables_ptr, dst_ptr, DT,
                      mode, record, G: tl.constexpr, VP: tl.constexpr, DTP: tl.constexpr, SM: tl.constexpr):
        """Pass p's code (p + 1) of every row from its logits, SM rows per tile; then the next
        pass's input, that code's row of embedding table p, into ``dst`` (the projection's input,
        or the stream)."""
        ids = tl.arange(0, VP)
        d = tl.arange(0, DTP)
        for tile in range(pid, tl.cdiv(n_rows, SM), nprog):
            rows = tile * SM + tl.arange(0, SM)
            ok = rows < n_rows
            at = ok[:, None] & (ids < V)[None, :]
            logits = tl.load(logits_ptr + rows[:, None] * V + ids[None, :], mask=at, other=0.0, cache_modifier=".cg")
            if record != 0:
                tl.store(record_ptr + (rows[:, None] * (G - 1) + p) * V + ids[None, :], logits, mask=at)
            prefix = counter_prefix(tl.load(seed_lo_ptr + rows, mask=ok, other=0),
                                    tl.load(seed_hi_ptr + rows, mask=ok, other=0),
                                    tl.load(frame_ptr + rows, mask=ok, other=0) * G + p + 1, DOMAIN=_DOMAIN)
            code = sample_rows_tile(logits, ids, V, tl.load(greedy_ptr + rows, mask=ok, other=1) != 0,
                                    tl.load(temp_ptr + rows, mask=ok, other=1.0), tl.load(top_k_ptr + rows, mask=ok, other=0),
                                    tl.load(top_p_ptr + rows, mask=ok, other=1.0), prefix, mode).to(tl.int64)
            tl.store(codes_ptr + rows * (G - 1) + p, code, mask=ok)
            if p < G - 2:
                e_ok = ok[:, None] & (d < DT)[None, :]
                e = tl.load(tables_ptr + (p * V + code[:, None]) * DT + d[None, :], mask=e_ok, other=0.0)
                tl.store(dst_ptr + rows[:, None] * DT + d[None, :], e, mask=e_ok)

    @triton.jit
    def _step(k, pid, nprog, n_rows, h_ptr, c0_ptr, w_qkv, w_qk_norm, w_o, w_gate_up, w_down, w_norms, w_final,
              w_heads, w_tables, w_proj, b_proj, cos_ptr, sin_ptr, s_xin, s_x, s_q, s_attn, s_act, s_k, s_v,
              s_logits, s_record, s_codes, s_tokens, seed_lo, seed_hi, frame, greedy, temp, top_k, top_p,
              eps, scale, D, DT, I, V, L, R2, KVL, mode, record,
              H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, HDP: tl.constexpr,
              G: tl.constexpr, GP: tl.constexpr, PROJ: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, VP: tl.constexpr,
              DTP: tl.constexpr, TM: tl.constexpr, SM: tl.constexpr):
        """Step ``k`` of a frame (``step_count``): the prologue (pass 0's inputs, their projection),
        then per pass 5 steps per layer, the head, the sampling, the next input's projection."""
        PRO: tl.constexpr = 2 if PROJ else 1
        PER_PASS = 5 * L + 2 + PRO - 1
        if k == 0:
            _input_phase(pid, nprog, n_rows, h_ptr, c0_ptr, s_xin if PROJ else s_x, DT, DTP=DTP)
        elif k < PRO:  # pass 0's two positions through the projection
            linear_phase(pid, nprog, 2 * n_rows, s_xin, 1, 0, DT, DT, w_proj, eps, w_proj, b_proj, s_x, D, D,
                         NORM=False, BIAS=True, OUT_F32=False, IEEE=IEEE, BM=BM, BN=BN, BK=BK, CACHE=".cg")
        else:
            p = (k - PRO) // PER_PASS
            sub = (k - PRO) % PER_PASS
            tpr = tl.where(p == 0, 2, 1)  # tokens per row
            n_tok = n_rows * tpr
            if sub < 5 * L:
                layer = sub // 5
                phase = sub % 5
                kv = layer * KVL
                if phase == 0:
                    qkv_rope_phase(pid, nprog, n_tok, s_x, D, D, w_norms + layer * 2 * D, eps,
                                   w_qkv + layer * (H + 2 * KVH) * HD * D, w_qk_norm + layer * 2 * HD, cos_ptr,
                                   sin_ptr, s_tokens + (G - 1 + p) * R2, s_tokens + p * R2, s_q, s_k + kv, s_v + kv,
                                   H=H, KVH=KVH, HD=HD, HALF=HALF, IEEE=IEEE, BM=BM, BK=BK, CACHE=".cg")
                elif phase == 1:
                    frame_attention_phase(pid, nprog, n_tok, s_q, s_k + kv, s_v + kv,
                                          s_tokens + (2 * (G - 1) + p) * R2, s_tokens + (3 * (G - 1) + p) * R2,
                                          s_attn, scale, KVH=KVH, GROUP=H // KVH, HD=HD, HDP=HDP, BLOCK=GP, TM=TM,
                                          CACHE=".cg")
                elif phase == 2:
                    residual_linear_phase(pid, nprog, n_tok, s_attn, H * HD, w_o + layer * D * H * HD, s_x, s_x, D,
                                          IEEE=IEEE, BM=BM, BN=BN, BK=BK, CACHE=".cg")
                elif phase == 3:
                    gu = w_gate_up + layer * 2 * I * D
                    gate_up_phase(pid, nprog, n_tok, s_x, D, w_norms + layer * 2 * D + D, eps, gu, gu + I * D, s_act,
                                  I, IEEE=IEEE, BM=BM, BN=BN, BK=BK, CACHE=".cg")
                else:
                    residual_linear_phase(pid, nprog, n_tok, s_act, I, w_down + layer * D * I, s_x, s_x, D, IEEE=IEEE,
                                          BM=BM, BN=BN, BK=BK, CACHE=".cg")
            elif sub == 5 * L:  # the final norm and head p over each row's last token
                linear_phase(pid, nprog, n_rows, s_x, tpr, tpr - 1, D, D, w_final, eps, w_heads + p * V * D, w_heads,
                             s_logits, V, V, NORM=True, BIAS=False, OUT_F32=True, IEEE=IEEE, BM=BM, BN=BN, BK=BK,
                             CACHE=".cg")
            elif sub == 5 * L + 1:
                _sample_phase(pid, nprog, n_rows, p, s_logits, s_record, V, seed_lo, seed_hi, frame, greedy, temp,
                              top_k, top_p, s_codes, w_tables, s_xin if PROJ else s_x, DT, mode, record, G=G,
                              VP=VP, DTP=DTP, SM=SM)
            elif p < G - 2:  # the next pass's input through the projection
                linear_phase(pid, nprog, n_rows, s_xin, 1, 0, DT, DT, w_proj, eps, w_proj, b_proj, s_x, D, D,
                             NORM=False, BIAS=True, OUT_F32=False, IEEE=IEEE, BM=BM, BN=BN, BK=BK, CACHE=".cg")

    @triton.jit
    def _frame_kernel(first, last, bar, n_rows, h_ptr, c0_ptr, w_qkv, w_qk_norm, w_o, w_gate_up, w_down, w_norms,
                      w_final, w_heads, w_tables, w_proj, b_proj, cos_ptr, sin_ptr, s_xin, s_x, s_q, s_attn, s_act,
                      s_k, s_v, s_logits, s_record, s_codes, s_tokens, seed_lo, seed_hi, frame, greedy, temp, top_k,
                      top_p, eps, scale, D, DT, I, V, L, R2, KVL, mode, record,
                      H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                      HDP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, PROJ: tl.constexpr,
                      IEEE: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, VP: tl.constexpr, DTP: tl.constexpr,
                      TM: tl.constexpr, SM: tl.constexpr, PERSISTENT: tl.constexpr):
        """Steps first..last-1 of a frame. PERSISTENT: all of them in this launch, every program
        waiting for all the others between steps (one program per SM); else one step per launch."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        for k in range(first, last):
            _step(k, pid, nprog, n_rows, h_ptr, c0_ptr, w_qkv, w_qk_norm, w_o, w_gate_up, w_down, w_norms, w_final,
                  w_heads, w_tables, w_proj, b_proj, cos_ptr, sin_ptr, s_xin, s_x, s_q, s_attn, s_act, s_k, s_v,
                  s_logits, s_record, s_codes, s_tokens, seed_lo, seed_hi, frame, greedy, temp, top_k, top_p,
                  eps, scale, D, DT, I, V, L, R2, KVL, mode, record, H=H, KVH=KVH, HD=HD, HALF=HALF, HDP=HDP,
                  G=G, GP=GP, PROJ=PROJ, IEEE=IEEE, BM=BM, BN=BN, BK=BK, VP=VP, DTP=DTP, TM=TM, SM=SM)
            if PERSISTENT:
                grid_barrier(bar, (k - first + 1) * nprog)


def step_count(layers: int, groups: int, projection: bool) -> int:
    """Dependent steps in one frame: the prologue (1, or 2 with the projection), then per pass
    5 per layer + head + sampling (+ the next input's projection)."""
    pro = 2 if projection else 1
    return pro + (groups - 1) * (5 * layers + 2 + pro - 1)


# --------------------------------------------------------------------------- the module


class FusedCodePredictor:
    """``CodePredictor.predict`` as the fused kernels (``mode`` "persistent": one launch per frame;
    "phased": one launch per dependent step). Attributes it does not define are the wrapped
    predictor's, so it drops in where the talker step calls its predictor; its weights become
    views of stacked tensors (same values; the reference path keeps working)."""

    def __init__(self, predictor: CodePredictor, mode: str = "persistent", tiles: TileConfig | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        param = next(predictor.parameters())
        if not kernels_run_on(param.device):
            raise RuntimeError("the fused code predictor runs on CUDA with Triton (or under TRITON_INTERPRET=1)")
        self.predictor = predictor
        self.mode = mode
        self.device, self.dtype = param.device, param.dtype
        self.tiles = tiles or tiles_for(self.device)
        self.weights = PredictorWeights.stack(predictor)
        cfg = predictor.cfg
        self.gp = pow2(cfg.num_code_groups, 2)
        with torch.no_grad():
            cos, sin = prepare_rope(*rope_cos_sin(predictor.inv_freq, torch.arange(self.gp, device=self.device)[None],
                                                  self.dtype))
        self.cos, self.sin = cos.reshape(self.gp, -1).contiguous(), sin.reshape(self.gp, -1).contiguous()
        # no wider than the narrowest GEMM needs (a masked tile costs the interpreter its full size);
        # a function of the model, never of the batch
        self.block_n = min(self.tiles.block_n, pow2(min(cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)))
        self.block_k = min(self.tiles.block_k, pow2(min(cfg.hidden_size, cfg.talker_hidden_size)))
        self.steps = step_count(cfg.num_hidden_layers, cfg.num_code_groups, self.weights.proj_w is not None)
        self.scratch: Scratch | None = None
        self.layer_step = None  # no layers of its own to compile (GraphedTalkerStep asks)

    def __getattr__(self, name):  # only for names not found on the wrapper
        if name == "predictor":
            raise AttributeError(name)
        return getattr(self.predictor, name)

    def compile_layers(self, backend: str = "inductor") -> None:
        """Nothing to compile: the kernels are the layers (the talker step calls this on its predictor)."""

    def ensure_cache(self, rows: int, device=None, dtype=None) -> Scratch:
        """The frame's buffers for ``rows`` rows, (re)allocated only when too small: a CUDA
        graph keeps the addresses it was captured with (the talker step sizes them first)."""
        if self.scratch is None or self.scratch.rows < rows:
            self.scratch = Scratch.allocate(rows, self.predictor.cfg, self.gp, self.device, self.dtype)
        return self.scratch

    def programs(self) -> int:
        """Programs per launch: one per SM on CUDA (a persistent launch must be resident at once);
        under the interpreter one for the persistent kernel (its programs run one after another,
        so a barrier could never be met) and three for phased launches (the tiles split as on a GPU)."""
        if self.device.type == "cuda" and not interpreting():
            return torch.cuda.get_device_properties(self.device).multi_processor_count
        return 1 if self.mode == "persistent" else 3

    @torch.no_grad()
    def predict(self, h: torch.Tensor, code0_emb: torch.Tensor, sampling: FrameSampling,
                return_logits: bool = False):
        """h, code0_emb [B, D_talker] -> codes [B, G-1] (and every pass's logits [B, G-1, V] fp32
        when ``return_logits``), as ``CodePredictor.predict``."""
        cfg = self.predictor.cfg
        if h.shape != code0_emb.shape or h.dim() != 2 or h.shape[1] != cfg.talker_hidden_size:
            raise ValueError(f"expected h and code0_emb [B, {cfg.talker_hidden_size}], "
                             f"got {tuple(h.shape)} and {tuple(code0_emb.shape)}")
        b = h.shape[0]
        if len(sampling) != b:
            raise ValueError(f"sampling has {len(sampling)} rows for a batch of {b}")
        g1 = cfg.num_code_groups - 1
        if b == 0:
            codes = torch.empty(0, g1, dtype=torch.int64, device=self.device)
            return (codes, torch.empty(0, g1, cfg.vocab_size, device=self.device)) if return_logits else codes
        s = self.ensure_cache(b)
        w = self.weights
        proj_w = w.proj_w if w.proj_w is not None else w.final_norm  # a placeholder pointer when unused
        proj_b = w.proj_b if w.proj_b is not None else w.final_norm
        t = self.tiles
        heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        args = (b, h.contiguous(), code0_emb.contiguous(), w.qkv, w.qk_norm, w.o, w.gate_up, w.down, w.norms,
                w.final_norm, w.heads, w.tables, proj_w, proj_b, self.cos, self.sin, s.xin, s.x, s.q, s.attn, s.act,
                s.k, s.v, s.logits, s.record, s.codes, s.tokens, sampling.seed_lo.contiguous(),
                sampling.seed_hi.contiguous(), sampling.frame.contiguous(), sampling.greedy.contiguous(),
                sampling.temperature.contiguous(), sampling.top_k.contiguous(), sampling.top_p.contiguous(),
                cfg.rms_norm_eps, hd ** -0.5, cfg.hidden_size, cfg.talker_hidden_size, cfg.intermediate_size,
                cfg.vocab_size, cfg.num_hidden_layers, 2 * s.rows, s.rows * self.gp * kv_heads * hd,
                sampling_kind(sampling), int(return_logits))
        meta = dict(H=heads, KVH=kv_heads, HD=hd, HALF=pow2(hd // 2), HDP=pow2(hd, 1),
                    G=cfg.num_code_groups, GP=self.gp, PROJ=w.proj_w is not None, IEEE=self.dtype == torch.float32, BM=t.block_m, BN=self.block_n,
                    BK=self.block_k, VP=pow2(cfg.vocab_size), DTP=pow2(cfg.talker_hidden_size), TM=t.att_m, SM=t.sample_m,
                    num_warps=t.num_warps)
        grid = (self.programs(),)
        if self.mode == "persistent":
            s.barrier.zero_()
            _frame_kernel[grid](0, self.steps, s.barrier, *args, PERSISTENT=True, **meta)
        else:
            for k in range(self.steps):
                _frame_kernel[grid](k, k + 1, s.barrier, *args, PERSISTENT=False, **meta)
        codes = s.codes[:b].clone()
        return (codes, s.record[:b].clone()) if return_logits else codes


__all__ = ["FusedCodePredictor", "MODES", "PredictorWeights", "sampling_kind", "step_count"]
