"""ONNX export + ONNX Runtime backend: the exported graphs compute what torch computes.

Tolerance 1e-4 (fp32): ORT and torch run the same math with different kernels and
summation orders; observed differences are ~2e-6. Graphs are exported once per module
with the default (torchscript) exporter; one test covers the dynamo exporter (DiT).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install 'streamvox[onnx]')")
onnx = pytest.importorskip("onnx", reason="onnx not installed (pip install 'streamvox[onnx]')")

from engine_helpers import run_chunks  # noqa: E402  (tests/ is on sys.path)

from engines.build import resolve_config  # noqa: E402
from engines.config import EngineConfig, get_preset  # noqa: E402
from engines.contract import SynthesisRequest  # noqa: E402
from engines.core.engine import Engine  # noqa: E402
from engines.export import (  # noqa: E402
    ArtifactMismatch,
    AxisRange,
    BackendUnavailable,
    ShapeOutsideProfile,
    apply_backend,
    make_decoder_runner,
    make_dit_runner,
)
from engines.export.manifest import Manifest, weights_hash  # noqa: E402
from engines.export.onnx_export import default_profiles, export_models  # noqa: E402
from engines.export.parity import example_dit_batch  # noqa: E402
from engines.models.sampling import keyed_normal  # noqa: E402
from engines.pipelines.dit.denoiser import ChunkJob, Denoiser  # noqa: E402
from engines.pipelines.dit.weights import build_models  # noqa: E402
from engines.pipelines.profile import Loaded  # noqa: E402

TOL = 1e-4



@pytest.fixture(scope="module")
def artifacts(tiny_dit_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx_tiny")
    export_models(tiny_dit_models, out)
    return out


@pytest.fixture(scope="module")
def ort_dit(tiny_dit_models, artifacts):
    return make_dit_runner(tiny_dit_models.dit, "onnxruntime", artifacts, "cpu", threads=1)


@pytest.fixture(scope="module")
def ort_decoder(tiny_dit_models, artifacts):
    return make_decoder_runner(tiny_dit_models.decoder, "onnxruntime", artifacts, "cpu", threads=1)


# --------------------------------------------------------------------------- export


def test_manifest_records_shapes_dtypes_profiles_and_hash(tiny_dit_models, artifacts):
    raw = json.loads((artifacts / "manifest.json").read_text())
    assert raw["preset"] == "tiny" and raw["dtype"] == "float32"
    m = Manifest.load(artifacts)
    assert set(m.graphs) == {"dit", "decoder_step", "decoder_full"}
    assert m.weights == {"dit": weights_hash(tiny_dit_models.dit), "decoder": weights_hash(tiny_dit_models.decoder)}
    profiles = default_profiles(tiny_dit_models.config)
    for name, g in m.graphs.items():
        assert (artifacts / g.onnx).is_file() and g.exporter == "torchscript"
        assert g.profile == profiles[name]
        model = onnx.load(str(artifacts / g.onnx))
        onnx.checker.check_model(model)
        # Fixed names, dynamic axes by name, dtypes as in the manifest.
        assert [i.name for i in model.graph.input] == [t.name for t in g.inputs]
        assert [o.name for o in model.graph.output] == [t.name for t in g.outputs]
        for vi, spec in zip(model.graph.input, g.inputs):
            dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
            assert dims == list(spec.shape), (name, vi.name)
            assert onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type) == \
                np.dtype(str(spec.torch_dtype()).replace("torch.", "").replace("bool", "bool_"))
    dit = m.graphs["dit"]
    assert dit.profile["batch"].max == tiny_dit_models.config.stream.batch_ceiling
    assert [t.name for t in dit.inputs] == ["x", "positions", "context_mask", "frame_mask", "t", "enc", "enc_mask"]


def test_small_preset_exports_and_matches(tmp_path):
    small = build_models(get_preset("small"), seed=0)
    export_models(small, tmp_path, graphs=("dit", "decoder_step"))
    dit = make_dit_runner(small.dit, "onnxruntime", tmp_path, "cpu", threads=1)
    batch = example_dit_batch(small.dit.cfg, positive_rows=2, frames=10, enc_len=6)
    with torch.no_grad():
        ref = small.dit(*batch)
    assert (dit(*batch) - ref)[batch[3]].abs().max().item() < TOL
    dec = make_decoder_runner(small.decoder, "onnxruntime", tmp_path, "cpu", threads=1)
    codes = torch.randint(0, small.decoder.cfg.codebook_size, (1, small.decoder.cfg.num_quantizers, 3))
    wav, _ = dec.decode_step(codes, dec.init_state(1))
    ref_wav, _ = small.decoder.decode_step(codes, small.decoder.init_state(1))
    assert wav.shape == ref_wav.shape and (wav - ref_wav).abs().max().item() < TOL


def test_dynamo_exporter_dit_matches(tiny_dit_models, tmp_path):
    export_models(tiny_dit_models, tmp_path, graphs=("dit",), exporter="dynamo")
    dit = make_dit_runner(tiny_dit_models.dit, "onnxruntime", tmp_path, "cpu", threads=1)
    batch = example_dit_batch(tiny_dit_models.dit.cfg, positive_rows=3, frames=9, enc_len=7)
    with torch.no_grad():
        ref = tiny_dit_models.dit(*batch)
    assert (dit(*batch) - ref)[batch[3]].abs().max().item() < TOL


def test_half_precision_export_keeps_fp32_islands(tiny_dit_models, tmp_path):
    """A float16 graph computes norms, RoPE angles and the timestep embedding in fp32 (the
    torch code's casts are in the graph), the matmuls in fp16: what a strongly typed
    TensorRT build then obeys."""
    export_models(tiny_dit_models, tmp_path, dtype=torch.float16, graphs=("dit",))
    model = onnx.shape_inference.infer_shapes(onnx.load(str(tmp_path / "dit.onnx")))
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in (*model.graph.value_info, *model.graph.input, *model.graph.output)}
    init = {t.name: t.data_type for t in model.graph.initializer}
    F32, F16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    elem = lambda name: types.get(name, init.get(name))  # noqa: E731
    by_op: dict[str, list] = {}
    for n in model.graph.node:
        by_op.setdefault(n.op_type, []).append(n)
    assert by_op["ReduceMean"] and all(elem(n.input[0]) == F32 for n in by_op["ReduceMean"])  # RMSNorm
    assert all(elem(n.input[0]) == F32 for n in by_op["Sin"] + by_op["Cos"])  # RoPE, timestep features
    mm = by_op.get("MatMul", []) + by_op.get("Gemm", [])
    half = [n for n in mm if elem(n.input[0]) == F16]
    full = [n for n in mm if elem(n.input[0]) == F32]
    assert len(half) > len(full) >= 2  # bulk in fp16; the timestep MLP (2 linears) in fp32
    assert types["v"] == F16 and types["t"] == F32


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("rows,frames,enc_len", [(1, 1, 1), (3, 12, 9), (16, 20, 40)])
def test_dit_fused_cfg_batch_matches_torch(tiny_dit_models, ort_dit, rows, frames, enc_len):
    batch = example_dit_batch(tiny_dit_models.dit.cfg, positive_rows=rows, frames=frames, enc_len=enc_len,
                              context=min(2, frames - 1), generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        ref = tiny_dit_models.dit(*batch)
    out = ort_dit(*batch)
    assert out.shape == ref.shape == (2 * rows, frames, tiny_dit_models.dit.cfg.latent_dim)
    assert out.dtype == torch.float32
    real = batch[3]  # padded frames carry no meaning (masked out of every attention)
    assert (out - ref)[real].abs().max().item() < TOL


def test_decoder_full_and_streaming_match_torch(tiny_dit_models, ort_decoder):
    dec = tiny_dit_models.decoder
    codes = torch.randint(0, dec.cfg.codebook_size, (2, dec.cfg.num_quantizers, 40),
                          generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = dec(codes)
    assert (ort_decoder(codes) - full).abs().max().item() < TOL
    # Chunks of 4, 13 (inside the profile) and 23 (over its 16 frames: split by the runner).
    state, pieces = ort_decoder.init_state(2), []
    for a, b in ((0, 4), (4, 17), (17, 40)):
        wav, new = ort_decoder.decode_step(codes[..., a:b], state)
        assert new is not state and state.position.tolist() == [a, a]  # input state untouched
        state = new
        pieces.append(wav)
    streamed = torch.cat(pieces, dim=1)
    assert streamed.shape == full.shape
    assert (streamed - full).abs().max().item() < TOL
    assert full.abs().max().item() > 1e-2  # not trivially zero audio


def test_decoder_batch_over_profile_is_split(tiny_dit_models, artifacts):
    """A profile with max batch 2 still decodes 5 streams (rows split), identically."""
    m = Manifest.load(artifacts)
    g = m.graphs["decoder_step"]
    m.graphs["decoder_step"] = dataclasses.replace(g, profile={**g.profile, "batch": AxisRange(1, 1, 2)})
    dec = make_decoder_runner(tiny_dit_models.decoder, "onnxruntime", artifacts, "cpu", threads=1, manifest=m)
    cfg = tiny_dit_models.decoder.cfg
    codes = torch.randint(0, cfg.codebook_size, (5, cfg.num_quantizers, 6))
    wav, state = dec.decode_step(codes, dec.init_state(5))
    ref, ref_state = tiny_dit_models.decoder.decode_step(codes, tiny_dit_models.decoder.init_state(5))
    assert (wav - ref).abs().max().item() < TOL
    pairs = zip(state.keys + state.conv, ref_state.keys + ref_state.conv)
    assert all((a - b).abs().max().item() < TOL for a, b in pairs if a.numel())


def _job(i: int, cfg, guided=True, frames=12, context=4, steps=3) -> ChunkJob:
    D, C = cfg.dit.latent_dim, cfg.dit.cond_dim
    L = 5 + 3 * i
    enc = keyed_normal(100 + i, 1000, torch.arange(L), C)
    null = keyed_normal(7, 1000, torch.arange(1), C)[0].expand(L, C)
    ctx = keyed_normal(200 + i, 1000, torch.arange(context), D)
    return ChunkJob(key=(f"r{i}", 0), enc=enc, enc_null=null if guided else None, context=ctx,
                    frame_start=16 + 7 * i, num_frames=frames - i, seed=1234 + i, steps=steps, guidance_scale=2.0)


@pytest.mark.parametrize("ceiling", [32, 4])  # 32: fused CFG (6 rows); 4: two passes per tick
def test_stream_scheduler_through_ort_matches_torch(tiny_dit_models, ort_dit, ceiling):
    config = tiny_dit_models.config
    stream = dataclasses.replace(config.stream, batch_ceiling=ceiling, max_slots=min(16, ceiling))
    jobs = [_job(0, config), _job(1, config), _job(2, config, guided=False, context=0)]
    ref_sched = Denoiser(tiny_dit_models.dit, stream, "cpu")
    ort_sched = Denoiser(ort_dit, stream, "cpu")
    ref, got = run_chunks(ref_sched, jobs), run_chunks(ort_sched, jobs)
    assert ort_sched.forward_count == ref_sched.forward_count == (3 if ceiling == 32 else 6)
    assert set(got) == set(ref) == {j.key for j in jobs}
    for k in ref:
        assert (got[k] - ref[k]).abs().max().item() < TOL, k


def test_engine_pipeline_through_ort_matches_torch(tiny_dit_models, artifacts):
    """The whole engine (planner, tick loop, vocalizer, worker) with apply_backend's models."""
    from engine_helpers import run_requests

    config = tiny_dit_models.config
    request = lambda: SynthesisRequest(id="ort-1", text="Hello there. Two clauses.", seed=3, steps=3)  # noqa: E731
    pcm = {}
    for backend in ("torch", "onnxruntime"):
        models = apply_backend(build_models(config, seed=0), backend, artifacts, "cpu", threads=1)
        if backend == "onnxruntime":
            assert type(models.dit).__name__ == "OrtDiT" and type(models.decoder).__name__ == "OrtDecoder"
        engine = Engine(Loaded(models), resolve_config(EngineConfig.for_tests(warmup=False)))
        engine.start()
        try:
            (col,) = run_requests(engine, [request()])
        finally:
            engine.stop()
        assert col.error is None
        pcm[backend] = col.pcm
    assert pcm["onnxruntime"].shape == pcm["torch"].shape and pcm["torch"].size > 0
    # Latents agree to ~1e-6, so greedy codes agree and the audio matches to decoder precision.
    assert np.abs(pcm["onnxruntime"] - pcm["torch"]).max() < TOL


# --------------------------------------------------------------------------- errors


def test_other_weights_are_refused(artifacts):
    other = build_models(get_preset("tiny"), seed=1)
    with pytest.raises(ArtifactMismatch, match="other dit weights"):
        make_dit_runner(other.dit, "onnxruntime", artifacts, "cpu")
    with pytest.raises(ArtifactMismatch, match="other decoder weights"):
        make_decoder_runner(other.decoder, "onnxruntime", artifacts, "cpu")
    small = build_models(get_preset("small"), seed=0)
    with pytest.raises(ArtifactMismatch, match="config differs"):
        apply_backend(small, "onnxruntime", artifacts, "cpu")


def test_missing_manifest_and_unknown_backend(tiny_dit_models, tmp_path):
    with pytest.raises(ArtifactMismatch, match="manifest.json not found"):
        apply_backend(tiny_dit_models, "onnxruntime", tmp_path, "cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        apply_backend(tiny_dit_models, "openvino", tmp_path, "cpu")
    with pytest.raises(ValueError, match="needs the artifacts directory written by streamvox export"):
        apply_backend(tiny_dit_models, "onnxruntime", None, "cpu")
    assert apply_backend(tiny_dit_models, "torch", None, "cpu") is tiny_dit_models


def test_shapes_outside_profile_are_refused(tiny_dit_models, ort_dit):
    cfg = tiny_dit_models.dit.cfg
    prof = ort_dit.profile
    with pytest.raises(ShapeOutsideProfile, match=r"batch = 34 .* \[1, 32\]"):  # 17 slots under fused CFG
        ort_dit(*example_dit_batch(cfg, positive_rows=17, frames=4, enc_len=3))
    with pytest.raises(ShapeOutsideProfile, match="frames"):
        ort_dit(*example_dit_batch(cfg, positive_rows=1, frames=prof["frames"].max + 1, enc_len=3))
    with pytest.raises(ShapeOutsideProfile, match="enc_len"):
        ort_dit(*example_dit_batch(cfg, positive_rows=1, frames=4, enc_len=prof["enc_len"].max + 1))


def test_apply_backend_fits_batch_ceiling_to_profile(tiny_dit_models, tmp_path):
    prof = default_profiles(tiny_dit_models.config)
    prof["dit"]["batch"] = AxisRange(1, 4, 8)
    export_models(tiny_dit_models, tmp_path, graphs=("dit", "decoder_step"), profiles=prof)
    models = apply_backend(tiny_dit_models, "onnxruntime", tmp_path, "cpu")
    assert models.dit.max_batch == 8
    assert models.config.stream.batch_ceiling == 8 and models.config.stream.max_slots == 8
    # the input untouched
    assert tiny_dit_models.config.stream.batch_ceiling == 32 and tiny_dit_models.dit is not models.dit


def test_tensorrt_backend_without_tensorrt_says_so(tiny_dit_models, artifacts):
    try:
        import tensorrt  # noqa: F401
        if torch.cuda.is_available():
            pytest.skip("TensorRT and CUDA are present: the missing-runtime error cannot happen here")
    except ImportError:
        pass
    with pytest.raises(BackendUnavailable, match="--backend tensorrt needs"):
        apply_backend(tiny_dit_models, "tensorrt", artifacts, "cpu")


def test_cli_export_and_build_engines(tmp_path, capsys):
    from clients.cli import main

    assert main(["export", "--preset", "tiny", "--out", str(tmp_path / "onnx"), "--graphs", "dit",
                 "--verify"]) == 0
    out = capsys.readouterr().out
    assert "dit.onnx" in out and "batch 1..32" in out
    err = float(out.split("dit (fused CFG batch)")[1].split("max |diff|")[1].split()[0])
    assert err < TOL
    m = Manifest.load(tmp_path / "onnx")
    assert set(m.graphs) == {"dit"} and m.exporter == "torchscript"
    try:
        import polygraphy  # noqa: F401
        import tensorrt  # noqa: F401
        has_trt = torch.cuda.is_available()
    except ImportError:
        has_trt = False
    if not has_trt:
        assert main(["build-engines", "--onnx", str(tmp_path / "onnx"), "--out", str(tmp_path / "trt")]) == 2
        assert "needs NVIDIA TensorRT" in capsys.readouterr().err


# --------------------------------------------------------------------------- served


async def test_real_server_streams_same_audio_with_onnxruntime_backend(tiny_dit_models, artifacts, tmp_path):
    """POST /v1/audio/speech (chunked pcm) on a real 127.0.0.1 server whose engine runs the
    DiT and decoder in ONNX Runtime: the same int16 samples as the torch engine's (+-1 LSB)."""
    import aiohttp
    from conftest import start_server

    got = {}
    for backend in ("torch", "onnxruntime"):
        models = apply_backend(build_models(tiny_dit_models.config, seed=0), backend, artifacts, "cpu", threads=1)
        engine = Engine(Loaded(models), resolve_config(EngineConfig.for_tests(warmup=False)))
        engine.start()
        live = await start_server(engine, tmp_path / backend)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(live.url + "/v1/audio/speech",
                                     json={"input": "Hello there. How are you today?", "response_format": "pcm"}) as r:
                    assert r.status == 200, await r.text()
                    pieces = [chunk async for chunk in r.content.iter_any()]
        finally:
            await live.stop()
            engine.stop()
        got[backend] = np.frombuffer(b"".join(pieces), dtype="<i2").astype(np.int32)
    assert got["torch"].size > 24000 // 2 and got["onnxruntime"].shape == got["torch"].shape
    assert np.abs(got["onnxruntime"] - got["torch"]).max() <= 1
    assert np.abs(got["torch"]).max() > 100  # audible, not silence


def test_cli_export_from_checkpoint_records_its_hash(tiny_dit_models, tmp_path):
    from clients.cli import main
    from engines.export.manifest import file_hash
    from engines.pipelines.dit.weights import save_weights

    other = build_models(get_preset("tiny"), seed=4)  # not the default seed's weights
    save_weights(other, tmp_path / "w.safetensors")
    assert main(["export", "--preset", "tiny", "--checkpoint", str(tmp_path / "w.safetensors"),
                 "--out", str(tmp_path / "onnx"), "--graphs", "dit"]) == 0
    m = Manifest.load(tmp_path / "onnx")
    assert m.checkpoint == {"path": str(tmp_path / "w.safetensors"), "sha256": file_hash(tmp_path / "w.safetensors")}
    assert m.weights["dit"] == weights_hash(other.dit) != weights_hash(tiny_dit_models.dit)
    make_dit_runner(other.dit, "onnxruntime", tmp_path / "onnx", "cpu")  # accepted
    with pytest.raises(ArtifactMismatch):
        make_dit_runner(tiny_dit_models.dit, "onnxruntime", tmp_path / "onnx", "cpu")
