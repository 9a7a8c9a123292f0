"""Code predictor + codec head: static-KV loop vs the naive no-cache reference, sampling rules.

Tolerances: the KV loop and the naive loop run the same weights through the same ops in
a different grouping (cached K/V vs recomputed, masked cache slots vs a shorter
sequence), so logits agree to fp32 rounding; 1e-5 absolute on logits of magnitude ~5
leaves ~10x headroom over the observed ~2e-6. Greedy codes must be identical.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engines.config import get_preset
from engines.models.code_predictor import CodePredictor
from engines.models.codec_head import CodecHead
from engines.models.init import init_module_
from engines.models.sampling import FrameSampling
from engines.pipelines.dit.codes import frame_codes

TINY = get_preset("tiny")



def unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def make(predictor_hidden: int | None = None, seed: int = 0):
    cp_cfg = TINY.code_predictor
    if predictor_hidden is not None:
        cp_cfg = dataclasses.replace(cp_cfg, hidden_size=predictor_hidden)
    head = init_module_(CodecHead(TINY.codec_head), seed).eval()
    predictor = init_module_(CodePredictor(cp_cfg), seed + 1).eval()
    return head, predictor


def inputs(head: CodecHead, n: int, seed: int = 0, greedy: bool = True, frame_offset: int = 0, **kw):
    g = torch.Generator().manual_seed(seed)
    u = unit_rms(torch.randn(n, TINY.codec_head.hidden_size, generator=g))
    s = FrameSampling.for_stream(n, seed=seed, frame_offset=frame_offset, device="cpu", greedy=greedy, **kw)
    h = head.hidden(u)
    code0 = head.sample_code0(head.logits_from_hidden(h), s)
    return h, head.embed(code0), s


@pytest.mark.parametrize("predictor_hidden", [None, 64], ids=["projected", "identity"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_kv_loop_matches_naive_reference(predictor_hidden, greedy):
    head, predictor = make(predictor_hidden)
    assert isinstance(predictor.small_to_mtp_projection, torch.nn.Linear) == (predictor_hidden is None)
    h, e, s = inputs(head, 6, seed=3, greedy=greedy, frame_offset=17)
    codes, logits = predictor.predict(h, e, s, return_logits=True)
    ref_codes, ref_logits = predictor.naive_predict(h, e, s, return_logits=True)
    g = TINY.code_predictor.num_code_groups
    assert codes.shape == (6, g - 1) and logits.shape == (6, g - 1, TINY.code_predictor.vocab_size)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert torch.equal(codes, ref_codes)
    assert logits.std() > 0.1  # real logits, not a degenerate constant


def test_forced_codes_feed_each_pass_in_place_of_the_sampled_ones():
    """Teacher forcing (benchmarks/quantize_fidelity.py): fed its own greedy codes it computes what
    it computed; fed others, code 1's logits stay (nothing fed yet) and later ones follow the
    naive reference over the forced prefix."""
    head, predictor = make()
    h, e, s = inputs(head, 3, seed=5)
    codes, logits = predictor.predict(h, e, s, return_logits=True)
    again = predictor.predict(h, e, s, return_logits=True, forced=codes)
    assert torch.equal(again[1], logits)
    other = (codes + 1) % TINY.code_predictor.vocab_size
    forced = predictor.predict(h, e, s, return_logits=True, forced=other)[1]
    assert torch.equal(forced[:, 0], logits[:, 0]) and not torch.allclose(forced[:, 1:], logits[:, 1:])
    for i in range(2, codes.shape[1] + 1):  # code i's logits given the forced codes 1..i-1
        seq = [h, e] + [predictor.model.codec_embedding[j](other[:, j]) for j in range(i - 1)]
        x = predictor.small_to_mtp_projection(torch.stack(seq, dim=1))
        cos, sin = predictor._rope(torch.arange(x.shape[1]), 3, x.dtype)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        with torch.no_grad():
            for layer in predictor.model.layers:
                x = layer(x, cos, sin, mask)
            want = predictor.lm_head[i - 1](predictor.model.norm(x))[:, -1]
        torch.testing.assert_close(forced[:, i - 1], want, rtol=0, atol=1e-5)


def test_decode_steps_have_query_length_one_and_cache_never_moves():
    head, predictor = make()
    h, e, s = inputs(head, 5)
    predictor.predict(h, e, s)  # allocate the cache
    cache = predictor.kv_cache
    ptrs = [t.data_ptr() for t in cache.k + cache.v]
    seen = []  # (query length, cache pointers at that call)

    def record(_module, args):
        seen.append((args[0].shape[1], [t.data_ptr() for t in predictor.kv_cache.k + predictor.kv_cache.v]))

    hook = predictor.model.layers[0].self_attn.q_proj.register_forward_pre_hook(record)
    try:
        predictor.predict(h[:3], e[:3], s.rows(slice(0, 3)))  # smaller batch reuses the same storage
    finally:
        hook.remove()
    g = TINY.code_predictor.num_code_groups
    assert [q for q, _ in seen] == [2] + [1] * (g - 2)
    assert all(p == ptrs for _, p in seen)
    assert predictor.kv_cache is cache


def test_only_last_prefill_position_reaches_lm_head():
    head, predictor = make()
    h, e, s = inputs(head, 4)
    shapes = []
    hook = predictor.lm_head[0].register_forward_pre_hook(lambda _m, a: shapes.append(tuple(a[0].shape)))
    try:
        predictor.predict(h, e, s)
    finally:
        hook.remove()
    assert shapes == [(4, TINY.code_predictor.hidden_size)]  # one row per frame, no sequence dim


def test_state_dict_keys_follow_official_names():
    _, predictor = make()
    keys = set(predictor.state_dict())
    cfg = TINY.code_predictor
    for i in range(cfg.num_hidden_layers):
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                     "input_layernorm.weight", "post_attention_layernorm.weight"):
            assert f"model.layers.{i}.{name}" in keys
    for g in range(cfg.num_code_groups - 1):
        assert f"model.codec_embedding.{g}.weight" in keys and f"lm_head.{g}.weight" in keys
    assert {"model.norm.weight", "small_to_mtp_projection.weight", "small_to_mtp_projection.bias"} <= keys
    assert len(keys) == cfg.num_hidden_layers * 11 + 2 * (cfg.num_code_groups - 1) + 3
    assert predictor.state_dict()["model.codec_embedding.0.weight"].shape == (cfg.vocab_size, cfg.talker_hidden_size)
    head, _ = make()
    assert set(head.state_dict()) == {"model.norm.weight", "codec_head.weight", "model.codec_embedding.weight"}
    _, same_width = make(predictor_hidden=64)
    assert not any(k.startswith("small_to_mtp_projection") for k in same_width.state_dict())


@pytest.mark.parametrize("greedy", [True, False])
def test_code0_is_never_a_special_id(greedy):
    head, _ = make()
    cfg = TINY.codec_head
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, cfg.vocab_size, generator=g)
    logits[:, cfg.codebook_size:] += 100.0  # every special id is far more likely than any code
    s = FrameSampling.for_stream(64, seed=1, frame_offset=0, device="cpu", greedy=greedy, temperature=5.0, top_k=0)
    code0 = head.sample_code0(logits, s)
    assert (code0 < cfg.codebook_size).all() and (code0 >= 0).all()


def test_sampling_is_deterministic_per_seed_and_seeds_differ():
    head, predictor = make()
    g = torch.Generator().manual_seed(0)
    u = unit_rms(torch.randn(16, TINY.codec_head.hidden_size, generator=g))

    def codes(seed, offset=0):
        s = FrameSampling.for_stream(16, seed=seed, frame_offset=offset, device="cpu", greedy=False, temperature=1.5)
        return frame_codes(head, predictor, u, s)

    a, b, c, d = codes(7), codes(7), codes(8), codes(7, offset=100)
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)  # seed and frame counter both change the draw
    greedy = frame_codes(head, predictor, u, FrameSampling.for_stream(16, 7, 0, "cpu", greedy=True))
    assert not torch.equal(a, greedy)
    top1 = frame_codes(head, predictor, u, FrameSampling.for_stream(16, 7, 0, "cpu", greedy=False, top_k=1))
    assert torch.equal(top1, greedy)  # top_k = 1 leaves only the argmax


def test_per_row_sampling_settings_do_not_leak_between_rows():
    head, predictor = make()
    g = torch.Generator().manual_seed(1)
    u = unit_rms(torch.randn(8, TINY.codec_head.hidden_size, generator=g))
    greedy_rows = FrameSampling.for_stream(4, 3, 0, "cpu", greedy=True)
    hot_rows = FrameSampling.for_stream(4, 9, 4, "cpu", greedy=False, temperature=2.0, top_k=5, top_p=0.8)
    mixed = frame_codes(head, predictor, u, FrameSampling.cat([greedy_rows, hot_rows]))
    assert torch.equal(mixed[:4], frame_codes(head, predictor, u[:4], greedy_rows))
    assert torch.equal(mixed[4:], frame_codes(head, predictor, u[4:], hot_rows))


def test_bad_inputs_raise_clear_errors():
    head, predictor = make()
    h, e, s = inputs(head, 2)
    with pytest.raises(ValueError, match="expected h and code0_emb"):
        predictor.predict(h[:, :10], e[:, :10], s)
    with pytest.raises(ValueError, match="expected latents"):
        head.hidden(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="codebook_size"):
        CodecHead(dataclasses.replace(TINY.codec_head, codebook_size=1000))


def test_for_streams_equals_cat_of_for_stream():
    """The vocalizer's one-upload sampling rows equal the per-stream construction, field by field."""
    from engines.models.sampling import FrameSampling

    streams = [(3, 7, 0, True, 0.9, 50, 1.0), (1, 2**40 + 5, 12, False, 0.7, 20, 0.8), (4, 0, 100, False, 1.1, 0, 1.0)]
    from engines.models.sampling import split_seed

    def naive(n, seed, off, g, t, k, p):  # field by field, as the rows are defined
        lo, hi = split_seed(seed)
        full = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
        return FrameSampling(full(lo, torch.int64), full(hi, torch.int64), torch.arange(off, off + n),
                             full(g, torch.bool), full(t, torch.float32), full(k, torch.int64),
                             full(p, torch.float32), all_greedy=g, any_top_p=(not g) and p < 1.0)

    got = FrameSampling.for_streams(streams, "cpu")
    want = FrameSampling.cat([naive(*row) for row in streams])
    one = FrameSampling.for_stream(*streams[1][:3], "cpu", *streams[1][3:])
    assert torch.equal(one.frame, naive(*streams[1]).frame) and torch.equal(one.top_p, naive(*streams[1]).top_p)
    for name in ("seed_lo", "seed_hi", "frame", "greedy", "temperature", "top_k", "top_p"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.all_greedy, got.any_top_p) == (want.all_greedy, want.any_top_p) == (False, True)
    only_greedy = FrameSampling.for_streams(streams[:1], "cpu")
    assert only_greedy.all_greedy and not only_greedy.any_top_p
