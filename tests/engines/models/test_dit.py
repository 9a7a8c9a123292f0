"""Condition encoder, duration model, flow DiT and the utterance planner (tiny preset).

Tolerances: 1e-5 where the same fp32 math runs on differently padded/batched shapes
(only the summation order differs); 1e-4 for the RoPE shift test, where angles of
positions ~100 lose a few fp32 bits.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.config import get_preset
from engines.models.condition import ConditionEncoder
from engines.models.dit import FlowDiT, TimestepEmbedder
from engines.models.duration import DurationModel
from engines.models.init import init_module_
from engines.models.layers import Attention
from engines.models.sampling import keyed_normal
from engines.models.text import ByteTokenizer
from engines.pipelines.dit.planner import UtterancePlanner, chunk_layout, frames_total

CFG = get_preset("tiny")
D, C, H = CFG.dit.latent_dim, CFG.dit.cond_dim, CFG.dit.hidden_size
TOL = 1e-5


def normal(seed: int, *shape: int) -> torch.Tensor:
    rows = math.prod(shape[:-1])
    return keyed_normal(seed, 1000, torch.arange(rows), shape[-1]).reshape(shape)


@pytest.fixture(scope="module")
def dit() -> FlowDiT:
    return init_module_(FlowDiT(CFG.dit), 3).eval()


@pytest.fixture(scope="module")
def encoder() -> ConditionEncoder:
    return init_module_(ConditionEncoder(CFG.text), 1).eval()


@pytest.fixture(scope="module")
def duration() -> DurationModel:
    return init_module_(DurationModel(CFG.duration, CFG.text), 2).eval()


def dit_inputs(T: int, Tc: int, L: int, seed: int, t: float = 0.7, start: int = 20):
    return dict(x=normal(seed, 1, T, D), positions=torch.arange(start - Tc, start - Tc + T)[None],
                context_mask=(torch.arange(T) < Tc)[None], frame_mask=torch.ones(1, T, dtype=torch.bool),
                t=torch.tensor([t]), enc=normal(seed + 1, 1, L, C), enc_mask=torch.ones(1, L, dtype=torch.bool))


def batch_padded(rows: list[dict]) -> dict:
    """Pad and stack single-row DiT inputs (frames and text) the way the scheduler does."""
    T = max(r["x"].shape[1] for r in rows)
    L = max(r["enc"].shape[1] for r in rows)
    out = dict(x=torch.zeros(len(rows), T, D), positions=torch.zeros(len(rows), T, dtype=torch.long),
               context_mask=torch.zeros(len(rows), T, dtype=torch.bool),
               frame_mask=torch.zeros(len(rows), T, dtype=torch.bool),
               t=torch.cat([r["t"] for r in rows]), enc=torch.zeros(len(rows), L, C),
               enc_mask=torch.zeros(len(rows), L, dtype=torch.bool))
    for i, r in enumerate(rows):
        t, l = r["x"].shape[1], r["enc"].shape[1]
        for name in ("x", "positions", "context_mask", "frame_mask"):
            out[name][i, :t] = r[name][0]
        out["enc"][i, :l] = r["enc"][0]
        out["enc_mask"][i, :l] = True
    return out


# --------------------------------------------------------------------------- attention


def test_attention_matches_naive_softmax():
    attn = init_module_(Attention(H, 4, kv_dim=C), 5)
    x, mem = normal(1, 2, 6, H), normal(2, 2, 9, C)
    mask = torch.arange(9)[None, :] < torch.tensor([9, 4])[:, None]  # [B, S]
    got = attn(x, mask[:, None, None, :], memory=mem)
    # Naive: per batch row, per head, softmax over the real keys only.
    q = attn.q_proj(x).view(2, 6, 4, H // 4)
    k = attn.k_proj(mem).view(2, 9, 4, H // 4)
    v = attn.v_proj(mem).view(2, 9, 4, H // 4)
    out = torch.zeros(2, 6, 4, H // 4)
    for b in range(2):
        n = int(mask[b].sum())
        for h in range(4):
            scores = q[b, :, h] @ k[b, :n, h].T / math.sqrt(H // 4)
            out[b, :, h] = torch.softmax(scores, dim=-1) @ v[b, :n, h]
    torch.testing.assert_close(got, attn.o_proj(out.flatten(2)), rtol=0, atol=TOL)


# --------------------------------------------------------------------------- DiT


@torch.no_grad()
def test_dit_rows_are_independent_of_padding_and_batch(dit):
    a, b = dit_inputs(T=7, Tc=3, L=5, seed=10), dit_inputs(T=16, Tc=0, L=11, seed=20, t=0.2)
    alone = dit(**a)
    batched = dit(**batch_padded([a, b]))
    assert alone.shape == (1, 7, D)
    torch.testing.assert_close(batched[0, :7], alone[0], rtol=0, atol=TOL)
    torch.testing.assert_close(batched[1], dit(**b)[0], rtol=0, atol=TOL)


@torch.no_grad()
def test_dit_output_depends_on_every_condition(dit):
    base = dit_inputs(T=8, Tc=2, L=6, seed=30)
    v = dit(**base)
    assert v.std() > 0.1 and torch.isfinite(v).all()
    variants = {
        "x": dict(x=normal(99, 1, 8, D)),
        "t": dict(t=torch.tensor([0.3])),
        "text": dict(enc=normal(98, 1, 6, C)),
        "context flag": dict(context_mask=torch.zeros(1, 8, dtype=torch.bool)),
        "frame order": dict(positions=base["positions"].flip(-1)),
    }
    for name, change in variants.items():
        other = dit(**{**base, **change})
        assert (other - v).abs().max() > 1e-3, f"output does not depend on {name}"


@torch.no_grad()
def test_dit_rope_is_relative_in_global_frame_index(dit):
    base = dit_inputs(T=8, Tc=2, L=6, seed=40, start=10)
    shifted = {**base, "positions": base["positions"] + 100}
    torch.testing.assert_close(dit(**shifted), dit(**base), rtol=0, atol=1e-4)


@torch.no_grad()
def test_timestep_embedding_stays_fp32_in_a_bf16_model():
    emb = init_module_(TimestepEmbedder(H), 6)
    t = torch.tensor([1.0, 0.999])
    want = emb(t, torch.float32)
    emb_bf16 = emb.to(torch.bfloat16)
    got = emb_bf16(t, torch.float32)
    # bf16 features could not tell 1000 from 999 (spacing 4 there); fp32 features do.
    assert (got[0] - got[1]).abs().max() > 1e-3
    # Only the bf16-rounded weights differ from the fp32 module.
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)


# --------------------------------------------------------------------------- encoder


@torch.no_grad()
def test_condition_encoder_padding_voice_and_null(encoder):
    tok = ByteTokenizer()
    ids_a, ids_b = tok.encode("Hi."), tok.encode("A longer line of text.")
    L = len(ids_b)
    batch = torch.full((2, L), tok.pad_id)
    batch[0, : len(ids_a)] = torch.tensor(ids_a)
    batch[1] = torch.tensor(ids_b)
    mask = batch != tok.pad_id
    voice = torch.tensor([0, 1])
    out = encoder(batch, voice, mask)
    assert out.shape == (2, L, CFG.text.hidden_size)
    alone = encoder(torch.tensor([ids_a]), torch.tensor([0]), torch.ones(1, len(ids_a), dtype=torch.bool))
    torch.testing.assert_close(out[0, : len(ids_a)], alone[0], rtol=0, atol=TOL)
    other_voice = encoder(torch.tensor([ids_a]), torch.tensor([3]), torch.ones(1, len(ids_a), dtype=torch.bool))
    assert (other_voice - alone).abs().max() > 1e-3
    null = encoder.null_states(L, 2)
    assert null.shape == (2, L, CFG.text.hidden_size) and null.stride(1) == 0  # a view, no copy
    torch.testing.assert_close(null[1, -1], encoder.null_embedding.weight[0], rtol=0, atol=0)
    with pytest.raises(ValueError):
        encoder.null_states(0)


# --------------------------------------------------------------------------- duration


@torch.no_grad()
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_duration_model_gives_plausible_lengths(encoder, seed):
    dur = init_module_(DurationModel(CFG.duration, CFG.text), seed)
    tok = ByteTokenizer()
    for text in ["Hello there, how are you today?", "The quick brown fox jumps over the lazy dog again and again."]:
        ids = torch.tensor([tok.encode(text)])
        enc = encoder(ids, torch.tensor([0]), torch.ones_like(ids, dtype=torch.bool))
        durations = dur(enc, ids < 256)
        assert (durations[0, 1:-1] > 0).all() and durations[0, 0] == 0 and durations[0, -1] == 0
        prior = CFG.duration.base_frames_per_token * len(text.encode())
        for speed in (0.5, 1.0, 2.0):
            (frames,) = dur.frame_counts(durations, speed)
            assert 0.5 * prior / speed <= frames <= 1.6 * prior / speed, (text, speed, frames, prior)


def test_frame_counts_round_and_clamp(duration):
    d = torch.tensor([[1.2, 1.2, 1.2, 0.0], [100.0, 100.0, 100.0, 100.0], [0.5, 0.0, 0.0, 0.0]])
    assert duration.frame_counts(d, 0.5) == [7, CFG.duration.max_frames_per_clause, CFG.duration.min_frames]
    with pytest.raises(ValueError, match="speed"):
        duration.frame_counts(d, 0.0)


# --------------------------------------------------------------------------- planner


@given(frames=st.integers(1, 200), first=st.integers(1, 10), chunk=st.integers(1, 30), start=st.integers(0, 500))
@settings(max_examples=200, deadline=None)
def test_chunk_layout_covers_frames(frames, first, chunk, start):
    min_chunk = min(first, chunk)
    layout = chunk_layout(start, frames, first, chunk, min_chunk=min_chunk)
    assert layout[0][0] == start and sum(n for _, n in layout) == frames
    for (s0, n0), (s1, _) in zip(layout, layout[1:]):
        assert s1 == s0 + n0  # contiguous
    assert layout[0][1] <= max(first, min(frames, first + min_chunk))
    if len(layout) > 1:
        assert all(n >= min_chunk for _, n in layout[1:])
        assert all(n < chunk + min_chunk for _, n in layout[1:])


def test_planner_global_frames_and_small_first_chunk(encoder, duration):
    planner = UtterancePlanner(ByteTokenizer(), encoder, duration, CFG, "cpu")
    text = "Hello there. " + "This sentence is long, it has clauses; many of them, really. " * 6 + "Bye."
    plans = planner.plan(text, voice_index=2, speed=1.0)
    assert len(plans) >= 3
    assert plans[0].chunks[0] == (0, CFG.stream.first_chunk_frames)
    cursor = 0
    for p in plans:
        assert p.frame_start == cursor and p.chunks[0][0] == cursor
        assert sum(n for _, n in p.chunks) == p.frames_total
        for (s0, n0), (s1, _) in zip(p.chunks, p.chunks[1:]):
            assert s1 == s0 + n0
        cursor += p.frames_total
        assert len(p.token_ids) - 2 <= CFG.text.max_clause_tokens
        assert p.enc.shape == (len(p.token_ids), CFG.text.hidden_size) == p.enc_null.shape
        assert list(p.token_ids) == ByteTokenizer().encode(p.text)
    assert frames_total(plans) == cursor
    # Batched admission encoding equals encoding the clause alone.
    last = plans[-1]
    with torch.no_grad():
        ids = torch.tensor([last.token_ids])
        alone = encoder(ids, torch.tensor([2]), torch.ones_like(ids, dtype=torch.bool))[0]
    torch.testing.assert_close(last.enc, alone, rtol=0, atol=TOL)


def test_planner_speed_scales_frames(encoder, duration):
    planner = UtterancePlanner(ByteTokenizer(), encoder, duration, CFG, "cpu")
    slow = frames_total(planner.plan("A sentence of moderate length for timing.", 0, 1.0))
    fast = frames_total(planner.plan("A sentence of moderate length for timing.", 0, 2.0))
    assert abs(fast - slow / 2) <= 1


def test_planner_rejects_bad_input(encoder, duration):
    planner = UtterancePlanner(ByteTokenizer(), encoder, duration, CFG, "cpu")
    with pytest.raises(ValueError, match="text"):
        planner.plan("   ", 0, 1.0)
    with pytest.raises(ValueError, match="voice"):
        planner.plan("Hi.", CFG.text.num_voices, 1.0)
    with pytest.raises(ValueError, match="speed"):
        planner.plan("Hi.", 0, float("nan"))


def test_planner_respects_a_small_clause_budget(encoder, duration):
    cfg = dataclasses.replace(CFG, text=dataclasses.replace(CFG.text, max_clause_tokens=20))
    planner = UtterancePlanner(ByteTokenizer(), encoder, duration, cfg, "cpu")
    text = "Grüße aus Köln, sagte sie; und dann: tschüss, bis morgen früh."
    plans = planner.plan(text, 0, 1.0)
    assert all(len(p.text.encode()) <= 20 for p in plans)
    assert "".join(p.text for p in plans).replace(" ", "") == text.replace(" ", "")


def test_dit_exports_with_dynamic_shapes(dit):
    """No Python control flow on tensor values: torch.export traces it for any batch,
    frame and text length (the ONNX / TensorRT path relies on this)."""
    from torch.export import Dim, export

    R, T, L = Dim("R", min=1, max=256), Dim("T", min=2, max=512), Dim("L", min=2, max=512)
    frames, text = {0: R, 1: T}, {0: R, 1: L}
    # Example batch of 2 rows (sizes 0/1 would be specialised), checked on 3 other rows.
    a = batch_padded([dit_inputs(T=10, Tc=3, L=7, seed=50), dit_inputs(T=8, Tc=0, L=5, seed=53)])
    b = batch_padded([dit_inputs(T=6, Tc=2, L=9, seed=51, t=0.4), dit_inputs(T=17, Tc=0, L=4, seed=52),
                      dit_inputs(T=3, Tc=1, L=2, seed=54, t=0.9)])
    names = ["x", "positions", "context_mask", "frame_mask", "t", "enc", "enc_mask"]
    shapes = {"x": frames, "positions": frames, "context_mask": frames, "frame_mask": frames, "t": {0: R},
              "enc": text, "enc_mask": text}
    program = export(dit, (), {k: a[k] for k in names}, dynamic_shapes=shapes)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(**b), dit(**b), rtol=0, atol=TOL)
