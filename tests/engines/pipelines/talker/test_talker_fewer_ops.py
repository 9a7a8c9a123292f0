"""Fewer dispatched ops per talker step, the same numbers: the prepared RoPE tables (one roll
instead of rotate_half's chunk/neg/cat, unsqueezed once per forward), the code predictor's
tables computed once, and RMSNorm without fp32->fp32 casts are bit-identical to the plain
path, and the op count per tick went down (torch.profiler)."""

from __future__ import annotations

import dataclasses

import torch

from engines.contract import SynthesisRequest
from engines.models.layers import apply_rope, mrope_cos_sin, prepare_rope, rope_inv_freq
from engines.pipelines.talker.source import TalkerSource
from testsupport.talker import make_bundle, step


def test_prepared_rope_is_bit_identical():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 4, 7, 32, generator=g).to(dtype)
        pos = torch.randint(0, 4000, (3, 1, 7), generator=g).expand(3, 3, 7).permute(1, 0, 2)  # [3 axes, B, S]
        cos, sin = mrope_cos_sin(rope_inv_freq(32, 1e6), pos.contiguous(), (6, 5, 5), True, dtype)
        plain = apply_rope(x, cos, sin)
        fast = apply_rope(x, *prepare_rope(cos, sin))
        assert torch.equal(plain, fast), dtype


def _tick_ops(source: TalkerSource) -> int:
    """ATen ops a tick dispatches from Python (those not nested in another ATen op)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(source)
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))


def test_a_tick_dispatches_fewer_ops_than_the_plain_layers():
    """The same tick with the plain RoPE path forced back (cos/sin unprepared) takes more ops."""
    import engines.models.talker as talker_module

    bundle = make_bundle(seed=0, max_new_tokens=100)
    bundle.generation = dataclasses.replace(bundle.generation, min_new_tokens=10**9)
    source = TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=128)
    source.admit(SynthesisRequest(id="a", text="Hello world.", voice="Ryan", temperature=0))
    for _ in range(3):
        step(source)
    fast = _tick_ops(source)
    original = talker_module.prepare_rope
    talker_module.prepare_rope = lambda cos, sin: (cos, sin)  # the talker's layers on the plain path
    try:
        plain = _tick_ops(source)
    finally:
        talker_module.prepare_rope = original
    layers = bundle.talker.cfg.num_hidden_layers
    assert plain - fast >= 4 * layers, (plain, fast)  # unsqueeze x2 + chunk/neg/cat vs roll, per layer


def test_fused_or_separate_gemms_give_the_same_codes():
    """Whatever ``choose_fused_rows`` measured, the talker's codes are the same bits."""
    bundle = make_bundle(seed=2, max_new_tokens=16)
    got = []
    for rows in (0.0, float("inf")):
        source = TalkerSource.from_bundle(bundle, max_slots=3, max_seq_len=128)
        for layer in bundle.talker.model.layers:
            layer.self_attn.fused_rows = layer.mlp.fused_rows = rows
        for i, text in enumerate(["Hello world.", "the quick brown fox", "你好，世界。"]):
            source.admit(SynthesisRequest(id=f"r{i}", text=text, voice="Vivian", temperature=0))
        codes: dict[str, list] = {}
        while source.active_slots:
            for f in step(source):
                codes.setdefault(f.request_id, []).append(f.codes)
        got.append({k: torch.cat(v) for k, v in codes.items()})
    assert got[0].keys() == got[1].keys() and all(torch.equal(got[0][k], got[1][k]) for k in got[0])


def test_grouped_query_attention_without_the_kv_copy_is_bit_identical():
    """``attend`` on CPU lets SDPA map query heads to K/V heads (enable_gqa) instead of
    expanding K/V: the same bits as the expanded path, decode and prefill shapes."""
    import torch.nn.functional as F

    from engines.models.layers import attend, expand_kv

    g = torch.Generator().manual_seed(0)
    for b, s, length in [(1, 1, 40), (8, 1, 70), (2, 30, 30)]:
        q = torch.randn(b, 16, s, 64, generator=g)
        k, v = torch.randn(b, 8, length, 64, generator=g), torch.randn(b, 8, length, 64, generator=g)
        mask = torch.arange(length)[None, None, None, :] <= (torch.arange(s) + length - s)[None, None, :, None]
        want = F.scaled_dot_product_attention(q, expand_kv(k, 2), expand_kv(v, 2), attn_mask=mask, scale=0.125)
        assert torch.equal(attend(q, k, v, mask, 0.125), want.transpose(1, 2).reshape(b, s, 16 * 64))
