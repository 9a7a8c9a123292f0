"""The native frame (engines/native/talker_frame.c via engines/models/quantize_native.py): its int8 /
int4 products against ONNX Runtime's MatMulNBits on the same packed weights, every instruction set
this CPU has computing the same bits, rows independent of their batch, and each decode step of the
served source against the ONNX Runtime path's step from the same state (greedy and seeded)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engines import native
from engines.contract import SynthesisRequest
from engines.models.quantize import quantize_talker
from engines.models.quantize_native import NativeFrame, NativeLinear, predictor_gumbel
from engines.models.quantize_nbits import NBitsLinear, pack_nbits
from engines.models.sampling import FrameSampling, keep_top_k
from engines.pipelines.talker.decode import DecodeStep
from engines.pipelines.talker.source import TalkerSource
from testsupport.talker import make_bundle, step

pytestmark = pytest.mark.skipif(not native.available(), reason="the native extension is not built (no C compiler)")

REPO = Path(__file__).resolve().parents[3]
# widths the native kernels take (multiples of 128), 16 code groups: a frame's 15 predictor passes
SIZES = dict(groups=16, codebook=64, hidden=128, intermediate=256, predictor_hidden=128, predictor_intermediate=256,
             head_dim=32, predictor_head_dim=32, heads=4, kv_heads=2)


@pytest.fixture
def isa():
    """Restores the instruction set a test pins."""
    before = native.get_isa()
    yield native.set_isa
    native.set_isa(before)


@pytest.mark.parametrize("bits", [8, 4])
def test_products_match_matmulnbits_on_the_same_packed_weights(bits):
    """Same codes, same int8 activations (MatMulNBits' accuracy_level 4 rounding), int32 sums: the
    products differ from ONNX Runtime's only by the order of the float sums (~4e-7 of their scale),
    and equal the exact sums of the quantized codes (float64) as closely."""
    g = torch.Generator().manual_seed(bits)
    w, x = torch.randn(384, 512, generator=g) / 20, torch.randn(5, 512, generator=g)
    linear = nn.Linear(512, 384, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    got, ort = NativeLinear(w, bits)(x), NBitsLinear(linear, bits)(x)
    scale = ort.abs().max()
    assert (got - ort).abs().max() / scale < 2e-6
    # the exact result of the integer arithmetic, from the same int8 activations
    dequant = pack_nbits(w, bits, 128)[3].double()
    blocks = x.double().reshape(5, 4, 128)
    amax = blocks.abs().amax(-1, keepdim=True)
    xq = (torch.round(blocks * (127 / amax)) * (amax / 127)).reshape(5, 512)
    exact = xq @ dequant.T
    assert (got.double() - exact).abs().max() / scale < 2e-6
    assert (got - x @ w.T).abs().max() / scale > 1e-4  # really quantized


def test_every_instruction_set_computes_the_same_bits(isa):
    """AVX-512 VNNI, AVX2 and the scalar fallback (those this CPU has) give identical products and
    identical frames (codes, logits, the talker's hidden state, the K/V written)."""
    bundle = make_bundle(seed=3, **SIZES)
    frame = NativeFrame(bundle.talker, bundle.predictor, 8, 8)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 384, generator=g), torch.randn(3, 384, generator=g)
    results = {}
    for name in native.supported_isas():
        isa(name)
        sampling = FrameSampling.for_stream(2, 7, 5, "cpu", greedy=False, temperature=0.9, top_k=20)
        results[name] = (NativeLinear(w, 8)(x), NativeLinear(w, 4)(x),
                         *run_frame(frame, frame_inputs(bundle, rows=2), sampling))
    assert "scalar" in results and len(results) == len(native.supported_isas())
    for name, got in results.items():
        for a, b in zip(got, results["scalar"]):
            assert torch.equal(a, b), name


def test_the_frames_exp_is_within_2_ulp_and_the_same_on_every_instruction_set(isa):
    """The softmax's and the SiLU's e^x (the frame's own, so that every instruction set and libm agree):
    within ~2 ulp of e^x in float64 over [-87, 88], 0 below, +inf above, the same bits on each."""
    import ctypes

    import numpy as np

    x = np.concatenate([np.linspace(-87, 88, 200_003, dtype=np.float32), np.float32([-1e4, -87.5, 88.5, 1e4, 0, -0.0])])
    results = {}
    for name in native.supported_isas():
        isa(name)
        out = np.empty_like(x)
        native.lib.sv_exps(x.ctypes.data, ctypes.c_float(0.0), out.ctypes.data, len(x))
        results[name] = out
    for name, got in results.items():
        assert np.array_equal(got, results["scalar"]), name
    got, want = results["scalar"][:-6], np.exp(x[:-6].astype(np.float64))
    assert (np.abs(got - want) / want).max() < 2.5e-7
    assert list(results["scalar"][-6:]) == [0.0, 0.0, np.inf, np.inf, 1.0, 1.0]


def frame_inputs(bundle, rows: int = 3, seed: int = 0) -> dict:
    """A frame's inputs for ``rows`` rows at positions 3, 5, 4 over a small paged cache of random K/V."""
    from engines.models.layers import prepare_rope

    g = torch.Generator().manual_seed(seed)
    cfg = bundle.talker.cfg
    block, n_blocks = 4, 3
    pools = [torch.randn(1 + rows * n_blocks * block, cfg.num_key_value_heads, cfg.head_dim, generator=g)
             for _ in range(2 * cfg.num_hidden_layers)]
    table = 1 + torch.arange(rows * n_blocks).view(rows, n_blocks)
    pos = torch.tensor([3, 5, 4][:rows])
    cos, sin = (t[pos][:, None] for t in bundle.talker.rope_table(16, torch.float32))
    return dict(pools=pools, block=block, table=table, pos=pos, rope=[t.reshape(rows, -1) for t in prepare_rope(cos, sin)],
                h=torch.randn(rows, cfg.hidden_size, generator=g), text=torch.randn(rows, cfg.hidden_size, generator=g),
                code0=torch.randint(0, 64, (rows,), generator=g))


def run_frame(frame, inputs: dict, sampling=None, rows: slice = slice(None)):
    """One frame of ``inputs``' rows ``rows`` (on a copy of the cache): -> codes, h, logits, the K/V pools."""
    pools = [p.clone() for p in inputs["pools"]]
    half = len(pools) // 2
    cache = SimpleNamespace(k=pools[:half], v=pools[half:], block_size=inputs["block"])
    table, pos = inputs["table"][rows], inputs["pos"][rows]
    slots = table[torch.arange(table.shape[0]), pos // inputs["block"]] * inputs["block"] + pos % inputs["block"]
    gumbel = None if sampling is None else predictor_gumbel(sampling, frame.groups, frame.vocab)
    codes, h, logits = frame(inputs["h"][rows], inputs["code0"][rows], sampling, gumbel, inputs["text"][rows],
                             [t[rows] for t in inputs["rope"]], cache, slots, table, pos + 1, return_logits=True)
    return codes, h, logits, torch.cat([p.flatten() for p in pools])


def test_a_row_computes_the_same_alone_or_in_a_batch():
    """Per-row activation scales, per-row sums: a row's codes, logits, hidden state and K/V writes do not
    depend on which rows share its call (batch invariance, bit for bit)."""
    bundle = make_bundle(seed=4, **SIZES)
    frame = NativeFrame(bundle.talker, bundle.predictor, 8, 4)
    inputs = frame_inputs(bundle)
    sampling = FrameSampling.for_streams([(1, 11, 3, False, 0.9, 50, 1.0), (1, 12, 8, True, 0.9, 50, 1.0),
                                          (1, 13, 0, False, 0.7, 5, 1.0)], "cpu")
    codes, h, logits, _ = run_frame(frame, inputs, sampling)
    for r in range(3):
        one = run_frame(frame, inputs, sampling.rows(slice(r, r + 1)), slice(r, r + 1))
        assert torch.equal(one[0][0], codes[r]) and torch.equal(one[1][0], h[r]) and torch.equal(one[2][0], logits[r])


def served_steps_beside_the_native_frame(monkeypatch, mode: str, temperature: float):
    """The served source on the ONNX Runtime path (3 rows, 12 frames each); at every decode step the
    native frame runs beside it from the same state (the same h, code 0, text part, cache), teacher-
    forced with the codes the step chose. -> per step: (ORT codes, native codes, ORT logits, native
    logits, the perturbed scores ORT chose from, ORT's new h, native's new h)."""
    bundle = make_bundle(seed=6, max_new_tokens=13, eos_gain=0.0, **SIZES)
    quantize_talker(bundle.talker, bundle.predictor, mode, native=True)
    frame, bundle.talker.native_frame = bundle.talker.native_frame, None  # the source steps on ONNX Runtime
    source = TalkerSource.from_bundle(bundle, max_slots=3, max_seq_len=64)
    for i, text in enumerate(["Hello world.", "The quick brown fox jumps over the lazy dog.", "你好，世界。"]):
        source.admit(SynthesisRequest(id=str(i), text=text, voice="Ryan", temperature=temperature, seed=40 + i))
    seen, original = [], DecodeStep.__call__

    def both(self, idx, n_blocks, all_greedy, any_top_p):
        st = self.state
        h, code0, frame_idx = st.h[idx].clone(), self.valid_ids[st.code0[idx]], st.ntok[idx] - 1
        sub = self._sampling(idx, sub=True, frame=frame_idx, all_greedy=all_greedy, any_top_p=any_top_p)
        text, pos = self._text_inputs(idx, frame_idx), st.pos[idx].clone()
        cache = SimpleNamespace(k=[t.clone() for t in self.cache.k], v=[t.clone() for t in self.cache.v],
                                block_size=self.cache.block_size)
        table, slots = self.cache.table[idx].clone(), self.cache.slots(idx, pos[:, None])[:, 0]
        codes, col = original(self, idx, n_blocks, all_greedy, any_top_p)
        forced = codes[:, 1:]
        _, want = self.predictor.predict(h, self.talker.codec_part(code0), sub, return_logits=True, forced=forced)
        from engines.models.layers import prepare_rope

        cos, sin = prepare_rope(self.rope[0][pos][:, None], self.rope[1][pos][:, None])
        gumbel = None if all_greedy else predictor_gumbel(sub, frame.groups, frame.vocab)
        got_codes, got_h, got = frame(h, code0, sub, gumbel, text, (cos.flatten(1), sin.flatten(1)), cache, slots,
                                      table, pos + 1, forced=forced, return_logits=True)
        scores = want if gumbel is None else (keep_top_k(want.flatten(0, 1), sub.top_k.repeat_interleave(15))
                                              .view_as(want) / sub.temperature[:, None, None] + gumbel)
        seen.append((forced, got_codes[:, 1:], want, got, scores, st.h[idx].clone(), got_h))
        return codes, col

    monkeypatch.setattr(DecodeStep, "__call__", both)
    while source.active_slots:
        step(source)
    assert len(seen) >= 12
    return seen


@pytest.mark.parametrize("mode, temperature", [("int8", 0.0), ("int8", 0.9), ("int4", 0.0), ("int8-int4p", 0.9)])
def test_each_served_step_equals_the_onnx_runtime_step(monkeypatch, mode, temperature):
    """From the same state a native step computes what the ONNX Runtime step computes: the same codes
    (greedy, or seeded: the same Gumbel keys, top-k and temperature), the predictor's logits and the
    talker's new hidden state within rounding of the sums, which now and then moves one activation to
    the next int8 level (up to ~2e-3 of the logits' scale; a wrong position, cache slot or key moves them
    by their own scale). A code may differ only where ORT's own choice is a near-tie at that level:
    its top-2 margin under 1e-2 of the logits' scale. (Whole utterances: docs/QUANTIZATION.md.)"""
    differing = 0
    for forced, got_codes, want, got, scores, want_h, got_h in served_steps_beside_the_native_frame(
            monkeypatch, mode, temperature):
        assert ((got - want).norm() / want.norm()) < 1e-2
        assert ((got_h - want_h).norm(dim=-1) / want_h.norm(dim=-1)).max() < 3e-2
        top2 = scores.topk(2, dim=-1).values
        margin = (top2[..., 0] - top2[..., 1]) / want.abs().amax(-1)
        differ = got_codes != forced
        assert torch.all(margin[differ] < 1e-2), (margin[differ], got_codes[differ], forced[differ])
        differing += int(differ.sum())
    assert differing <= 2  # near-ties are rare: the codes are the ORT path's


def test_without_the_extension_the_step_runs_on_onnx_runtime(monkeypatch):
    """What a user without a C compiler at install gets: no native frame, the ONNX Runtime step, the
    same served source; asking for the native frame then is an error that says why."""
    monkeypatch.setattr(native, "available", lambda: False)
    bundle = make_bundle(seed=1, max_new_tokens=4, **SIZES)
    with pytest.raises(ValueError, match="not built"):
        quantize_talker(copy.deepcopy(bundle.talker), copy.deepcopy(bundle.predictor), "int8", native=True)
    quantize_talker(bundle.talker, bundle.predictor, "int8")
    assert getattr(bundle.talker, "native_frame", None) is None
    source = TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=64)
    assert source.decoder.native_frame is None
    source.admit(SynthesisRequest(id="a", text="Hello world.", voice="Ryan", temperature=0))
    frames = []
    while source.active_slots:
        frames += step(source)
    assert sum(f.codes.shape[0] for f in frames) == 3


def test_the_build_is_optional_without_a_compiler(tmp_path):
    """setup.py builds the extension with a compiler, and succeeds without one (the extension then
    absent): `pip install -e .` runs this command."""
    env = dict(os.environ, CC=str(tmp_path / "no-such-compiler"))
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                            "--build-temp", str(tmp_path / "tmp")], cwd=REPO, env=env, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    assert "talker_frame" in build.stderr  # the skipped extension is named in the build log
    assert not list((tmp_path / "lib").rglob("_talker_frame*"))
