"""TensorRT backend: its own logic, with a small fake standing in ONLY for the TensorRT
engine/context objects (the fake runs the torch module on the bound host addresses).

What is real here: TrtRunner (profile read from the engine, per-shape buffer cache
with drain-before-evict, event ordering), TrtDiT/TrtDecoder, the scheduler's fused /
two-pass decision from the engine's ceiling, host stream ops. What needs real TensorRT
(a CUDA GPU + tensorrt + polygraphy) is at the bottom and skipped, with its reason in
the run summary (pytest -rs), when absent.

Tolerance 1e-4 (fp32; the fake computes with the same torch modules, so differences are
only batch-shape summation order, ~1e-6).
"""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch
from engine_helpers import run_chunks  # tests/ is on sys.path

from engines.config import get_preset
from engines.export import (
    AxisRange,
    ShapeOutsideProfile,
    apply_backend,
    fit_stream_to_profile,
)
from engines.export.base import ArtifactMismatch
from engines.export.manifest import GraphSpec, TensorSpec
from engines.export.onnx_export import DecoderStepGraph, default_profiles
from engines.export.parity import example_dit_batch
from engines.export.tensorrt_backend import (
    HostStreams,
    TrtDecoder,
    TrtDiT,
    TrtRunner,
)
from engines.models.sampling import keyed_normal
from engines.pipelines.dit.denoiser import ChunkJob, Denoiser
from engines.pipelines.dit.weights import build_models

TOL = 1e-4


def host_view(ptr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over host memory at ``ptr`` (the fake runtime below hands out raw addresses)."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(raw, dtype=dtype, count=n).view(shape)


# --------------------------------------------------------------------------- the fake


class FakeTrtEngine:
    """Stands in for tensorrt.ICudaEngine and, via create_execution_context, its
    IExecutionContext: the calls TrtRunner makes, executed with ``fn`` (a torch callable
    taking the inputs in spec order, returning the outputs) on host memory. Every call
    is appended to ``log``."""

    def __init__(self, spec: GraphSpec, fn, profile: dict[str, AxisRange], log: list):
        self.spec, self.fn, self.log = spec, fn, log
        self.names = [t.name for t in (*spec.inputs, *spec.outputs)]
        sizes = {w: {a: getattr(r, w) for a, r in profile.items()} for w in ("min", "opt", "max")}
        self.shapes = {t.name: [t.concrete(sizes[w]) for w in ("min", "opt", "max")] for t in spec.inputs}

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_tensor_profile_shape(self, name: str, profile_index: int):
        assert profile_index == 0
        return self.shapes[name]

    def create_execution_context(self):
        return FakeContext(self)


class FakeContext:
    def __init__(self, engine: FakeTrtEngine):
        self.e, self.shapes, self.addresses = engine, {}, {}

    def set_input_shape(self, name, shape) -> bool:
        self.e.log.append(("set_input_shape", name, tuple(shape)))
        lo, _, hi = self.e.shapes[name]
        if not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def _inputs(self, read):
        return [read(t) for t in self.e.spec.inputs]

    def get_tensor_shape(self, name):
        zeros = self._inputs(lambda t: torch.zeros(self.shapes[t.name], dtype=t.torch_dtype()))
        outs = self.e.fn(*zeros)
        return tuple(outs[[t.name for t in self.e.spec.outputs].index(name)].shape)

    def set_tensor_address(self, name, ptr) -> bool:
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream_handle) -> bool:
        self.e.log.append(("execute_async_v3", stream_handle))
        inputs = self._inputs(lambda t: host_view(self.addresses[t.name], self.shapes[t.name], t.torch_dtype()).clone())
        with torch.no_grad():
            outs = self.e.fn(*inputs)
        for t, o in zip(self.e.spec.outputs, outs):
            host_view(self.addresses[t.name], tuple(o.shape), t.torch_dtype()).copy_(o)
        return True


class SpyStreams(HostStreams):
    """Host stream ops that append every call to the shared log."""

    def __init__(self, log: list):
        self.log = log

    def new_stream(self):
        return "runner"

    def current(self):
        return "caller"

    def record(self, stream):
        self.log.append(("record", stream))
        return f"event@{stream}"

    def wait(self, stream, event) -> None:
        self.log.append(("wait", stream, event))

    def handle(self, stream) -> int:
        return 7 if stream == "runner" else 0

    def synchronize(self, stream) -> None:
        self.log.append(("synchronize", stream))


def dit_spec(model, profile) -> GraphSpec:
    cfg = model.dit.cfg
    return GraphSpec("dit", "dit.onnx", (
        TensorSpec("x", "float32", ("batch", "frames", cfg.latent_dim)),
        TensorSpec("positions", "int64", ("batch", "frames")),
        TensorSpec("context_mask", "bool", ("batch", "frames")),
        TensorSpec("frame_mask", "bool", ("batch", "frames")),
        TensorSpec("t", "float32", ("batch",)),
        TensorSpec("enc", "float32", ("batch", "enc_len", cfg.cond_dim)),
        TensorSpec("enc_mask", "bool", ("batch", "enc_len"))),
        (TensorSpec("v", "float32", ("batch", "frames", cfg.latent_dim)),), profile, engine="dit.plan")


def decoder_step_spec(model, profile) -> tuple[GraphSpec, DecoderStepGraph]:
    """The decoder_step spec as export writes it, and the torch graph module it exports."""
    from engines.export.base import flatten_state, state_names

    dec = model.decoder
    graph = DecoderStepGraph(dec).eval()
    flat = flatten_state(dec.init_state(1))
    names = state_names(graph.num_conv, graph.num_layers)
    inputs = [TensorSpec("codes", "int64", ("batch", dec.cfg.num_quantizers, "frames"))]
    outputs = [TensorSpec("wav", "float32", ("batch", "frames_out"))]
    for i in graph.live:
        dtype = str(flat[i].dtype).replace("torch.", "")
        inputs.append(TensorSpec(names[i], dtype, ("batch", *flat[i].shape[1:])))
        outputs.append(TensorSpec("next_" + names[i], dtype, ("batch", *flat[i].shape[1:])))
    spec = GraphSpec("decoder", "decoder_step.onnx", tuple(inputs), tuple(outputs), profile, engine="decoder_step.plan")
    return spec, graph


def fake_dit(model, log, max_batch=8, streams=None, cache_size=8):
    manifest_profile = default_profiles(model.config)["dit"]  # says batch <= 32
    engine_profile = {**manifest_profile, "batch": AxisRange(1, 4, max_batch)}  # the engine was built for fewer
    spec = dit_spec(model, manifest_profile)
    engine = FakeTrtEngine(spec, lambda *a: (model.dit(*a),), engine_profile, log)
    runner = TrtRunner(engine, spec, torch.device("cpu"), streams or SpyStreams(log), cache_size=cache_size)
    return TrtDiT(runner, model.dit.cfg)


# --------------------------------------------------------------------------- profile -> fused / two-pass


def _job(i, cfg, steps=3) -> ChunkJob:
    D, C = cfg.dit.latent_dim, cfg.dit.cond_dim
    L = 4 + 2 * i
    return ChunkJob(key=(f"r{i}", 0), enc=keyed_normal(100 + i, 1000, torch.arange(L), C),
                    enc_null=keyed_normal(7, 1000, torch.arange(1), C)[0].expand(L, C),
                    context=keyed_normal(200 + i, 1000, torch.arange(2), D), frame_start=10 * i,
                    num_frames=6, seed=i, steps=steps, guidance_scale=2.5)


@pytest.mark.parametrize("slots,forwards_per_tick", [(4, 1), (5, 2)])
def test_engine_profile_ceiling_decides_fused_or_two_pass(tiny_dit_models, slots, forwards_per_tick):
    """Engine max batch 8 (manifest: 32): 4 guided slots = 8 rows fuse; 5 need two passes.
    Two passes of 5 rows share one cached output buffer, so this also checks that the
    first pass's output is copied out before the second execute."""
    log: list = []
    trt_dit = fake_dit(tiny_dit_models, log, max_batch=8)
    assert trt_dit.max_batch == 8  # read from the engine, not the manifest
    config = fit_stream_to_profile(tiny_dit_models.config, trt_dit.max_batch)
    assert config.stream.batch_ceiling == 8 and config.stream.max_slots == 8
    jobs = [_job(i, tiny_dit_models.config) for i in range(slots)]
    sched = Denoiser(trt_dit, config.stream, "cpu")
    got = run_chunks(sched, jobs)
    assert sched.forward_count == 3 * forwards_per_tick
    executes = [e for e in log if e[0] == "execute_async_v3"]
    assert len(executes) == 3 * forwards_per_tick
    if forwards_per_tick == 2:  # both passes ran on the same output buffer
        assert len(trt_dit.runner._buffers) == 1
    ref = run_chunks(Denoiser(tiny_dit_models.dit, config.stream, "cpu"), jobs)
    for k in ref:
        assert (got[k] - ref[k]).abs().max().item() < TOL, k


def test_output_buffer_is_reused_per_shape(tiny_dit_models):
    """The hazard the two-pass copy guards against is real: same shape, same buffer."""
    trt_dit = fake_dit(tiny_dit_models, [])
    make = lambda seed: example_dit_batch(tiny_dit_models.dit.cfg, positive_rows=2, frames=5, enc_len=3,  # noqa: E731
                                          generator=torch.Generator().manual_seed(seed))
    a, b = make(0), make(1)
    va = trt_dit(*a)
    va_copy = va.clone()
    vb = trt_dit(*b)
    assert va.data_ptr() == vb.data_ptr() and not torch.equal(va, va_copy)
    with torch.no_grad():
        assert (va_copy - tiny_dit_models.dit(*a))[a[3]].abs().max().item() < TOL
        assert (vb - tiny_dit_models.dit(*b))[b[3]].abs().max().item() < TOL


class FakeTensorRT:
    """Stands in for the ``tensorrt`` module's runtime: ``Runtime(Logger(...))
    .deserialize_cuda_engine(plan bytes)`` returns the fake engine registered for them."""

    __version__ = "10.9.0"

    class Logger:
        WARNING = 2

        def __init__(self, level):
            self.level = level

    def __init__(self, plans: dict[bytes, object]):
        plans_ = plans

        class Runtime:
            def __init__(self, logger):
                self.logger = logger

            def deserialize_cuda_engine(self, data: bytes):
                return plans_.get(bytes(data))  # None: what TensorRT returns for a bad plan

        self.Runtime = Runtime


def write_trt_artifacts(tiny, directory, version="10.9.0", dit_plan=b"dit-plan"):
    """manifest.json + plan files as build-engines writes them; returns {plan bytes: fake engine}."""
    from engines.export.manifest import Manifest, jsonable, weights_hash

    dit = dit_spec(tiny, default_profiles(tiny.config)["dit"])
    step, graph = decoder_step_spec(tiny, {"batch": AxisRange(1, 1, 4), "frames": AxisRange(1, 4, 8)})
    (directory / "dit.plan").write_bytes(dit_plan)
    (directory / "decoder_step.plan").write_bytes(b"step-plan")
    Manifest(preset="tiny", dtype="float32",
             config=jsonable({"dit": tiny.config.dit.to_dict(), "decoder": tiny.config.decoder.to_dict()}),
             weights={"dit": weights_hash(tiny.dit), "decoder": weights_hash(tiny.decoder)},
             graphs={"dit": dit, "decoder_step": step}, tensorrt={"version": version}).save(directory)
    engine_profile = {**dit.profile, "batch": AxisRange(1, 4, 6)}  # engine built for fewer rows than exported
    return {b"dit-plan": FakeTrtEngine(dit, lambda *a: (tiny.dit(*a),), engine_profile, []),
            b"step-plan": FakeTrtEngine(step, lambda *a: graph(*a), step.profile, [])}


@pytest.fixture
def fake_tensorrt(monkeypatch):
    """Install a fake ``tensorrt`` module (runtime only) and report CUDA as present."""
    import sys

    installed = {}

    def install(plans):
        fake = FakeTensorRT(plans)
        monkeypatch.setitem(sys.modules, "tensorrt", fake)
        installed["module"] = fake
        return fake

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return install


def test_apply_backend_tensorrt_loads_engines_and_uses_their_ceiling(tiny_dit_models, tmp_path, fake_tensorrt):
    fake_tensorrt(write_trt_artifacts(tiny_dit_models, tmp_path))
    models = apply_backend(tiny_dit_models, "tensorrt", tmp_path, "cpu")
    assert isinstance(models.dit, TrtDiT) and isinstance(models.decoder, TrtDecoder)
    assert models.config.stream.batch_ceiling == 6 and models.config.stream.max_slots == 6
    jobs = [_job(i, tiny_dit_models.config) for i in range(3)]  # 6 rows: fused
    sched = Denoiser(models.dit, models.config.stream, "cpu")
    got = run_chunks(sched, jobs)
    assert sched.forward_count == 3
    ref = run_chunks(Denoiser(tiny_dit_models.dit, models.config.stream, "cpu"), jobs)
    assert all((got[k] - ref[k]).abs().max().item() < TOL for k in ref)
    cfg = tiny_dit_models.decoder.cfg
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, 5))
    wav, _ = models.decoder.decode_step(codes, models.decoder.init_state(1))
    with torch.no_grad():
        assert (wav - tiny_dit_models.decoder(codes)).abs().max().item() < TOL
    other = build_models(get_preset("tiny"), seed=5)
    with pytest.raises(ArtifactMismatch, match="other dit weights"):
        apply_backend(other, "tensorrt", tmp_path, "cpu")


def test_tensorrt_artifact_errors(tiny_dit_models, tmp_path, fake_tensorrt):
    plans = write_trt_artifacts(tiny_dit_models, tmp_path, version="10.0.1")
    fake_tensorrt(plans)
    with pytest.raises(ArtifactMismatch, match="built with TensorRT 10.0.1, this is 10.9.0"):
        apply_backend(tiny_dit_models, "tensorrt", tmp_path, "cpu")
    write_trt_artifacts(tiny_dit_models, tmp_path, dit_plan=b"corrupt")
    with pytest.raises(ArtifactMismatch, match="TensorRT could not load it"):
        apply_backend(tiny_dit_models, "tensorrt", tmp_path, "cpu")
    from engines.export.manifest import Manifest

    m = Manifest.load(tmp_path)
    m.graphs["dit"] = dataclasses.replace(m.graphs["dit"], engine=None)  # exported, never built
    m.save(tmp_path)
    with pytest.raises(ArtifactMismatch, match="run streamvox build-engines"):
        apply_backend(tiny_dit_models, "tensorrt", tmp_path, "cpu")


# --------------------------------------------------------------------------- buffers and events


def _batch(cfg, rows, frames):
    return example_dit_batch(cfg, positive_rows=rows, frames=frames, enc_len=3)


def test_buffer_cache_evicts_least_recently_used_after_draining(tiny_dit_models):
    log: list = []
    trt_dit = fake_dit(tiny_dit_models, log, cache_size=2)
    runner, cfg = trt_dit.runner, tiny_dit_models.dit.cfg
    A, B, C, D = (1, 4), (1, 5), (2, 4), (2, 6)  # (positive rows, frames) -> distinct input shapes
    key = lambda rf: tuple(tuple(x.shape) for x in _batch(cfg, *rf))  # noqa: E731
    for rf in (A, B, A, A):  # steady state: hits only, no drain
        trt_dit(*_batch(cfg, *rf))
    assert runner.evictions == [] and not [e for e in log if e[0] == "synchronize"]
    trt_dit(*_batch(cfg, *C))  # full: B is the least recently used
    assert runner.evictions == [key(B)]
    trt_dit(*_batch(cfg, *D))  # then A
    assert runner.evictions == [key(B), key(A)]
    assert list(runner._buffers) == [key(C), key(D)]
    # Each eviction drained the runner's stream first, and only then allocated/executed.
    syncs = [i for i, e in enumerate(log) if e[0] == "synchronize"]
    assert len(syncs) == 2 and all(log[i] == ("synchronize", "runner") for i in syncs)
    for i in syncs:
        assert [e[0] for e in log[i + 1:i + 3]] == ["set_input_shape"] * 2


def test_execute_is_ordered_with_events_and_no_host_sync(tiny_dit_models):
    log: list = []
    trt_dit = fake_dit(tiny_dit_models, log)
    batch = _batch(tiny_dit_models.dit.cfg, 2, 5)
    trt_dit(*batch)  # first call: allocation, shapes set
    log.clear()
    trt_dit(*batch)  # steady state
    ops = [e for e in log if e[0] != "set_input_shape"]
    assert ops == [("record", "caller"), ("wait", "runner", "event@caller"),
                   ("execute_async_v3", 7),  # on the runner's own stream handle
                   ("record", "runner"), ("wait", "caller", "event@runner")]
    assert not [e for e in log if e[0] == "set_input_shape"]  # shapes unchanged: not set again


def test_engine_profile_limits_and_name_checks(tiny_dit_models):
    trt_dit = fake_dit(tiny_dit_models, [], max_batch=8)
    with pytest.raises(ShapeOutsideProfile, match=r"batch = 10 is outside the engine's optimization profile \[1, 8\]"):
        trt_dit(*_batch(tiny_dit_models.dit.cfg, 5, 4))
    frames_max = trt_dit.profile["frames"].max
    with pytest.raises(ShapeOutsideProfile, match="frames"):
        trt_dit(*_batch(tiny_dit_models.dit.cfg, 1, frames_max + 1))
    spec = dit_spec(tiny_dit_models, default_profiles(tiny_dit_models.config)["dit"])
    renamed = dataclasses.replace(spec, outputs=(TensorSpec("velocity", "float32", ("batch", "frames", 64)),))
    engine = FakeTrtEngine(spec, lambda *a: (tiny_dit_models.dit(*a),), spec.profile, [])
    with pytest.raises(ArtifactMismatch, match="differ from the manifest"):
        TrtRunner(engine, renamed, torch.device("cpu"), HostStreams())


# --------------------------------------------------------------------------- decoder


def test_decoder_streams_through_fake_engine_and_owns_its_state(tiny_dit_models):
    dec = tiny_dit_models.decoder
    G = dec.cfg.num_quantizers
    spec, graph = decoder_step_spec(tiny_dit_models, {"batch": AxisRange(1, 1, 4), "frames": AxisRange(1, 4, 8)})
    engine = FakeTrtEngine(spec, lambda *a: graph(*a), spec.profile, [])
    trt_dec = TrtDecoder(TrtRunner(engine, spec, torch.device("cpu"), HostStreams()), None, dec.cfg,
                         dec.samples_per_frame, dec.init_state(1))
    codes = torch.randint(0, dec.cfg.codebook_size, (2, G, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = dec(codes)
    s_a, s_b, pieces = trt_dec.init_state(1), trt_dec.init_state(1), []
    for a, b in ((0, 4), (4, 8), (8, 20)):  # 12 frames > profile max 8: split by the runner
        wav_a, s_a = trt_dec.decode_step(codes[:1, :, a:b], s_a)
        keys_a = [k.clone() for k in s_a.keys]
        wav_b, s_b = trt_dec.decode_step(codes[1:, :, a:b], s_b)  # same shapes: same engine buffers
        assert all(torch.equal(k, c) for k, c in zip(s_a.keys, keys_a))  # a's state not overwritten by b's call
        pieces.append(torch.cat([wav_a, wav_b]))
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < TOL


# --------------------------------------------------------------------------- real TensorRT


def _real_tensorrt_or_skip():
    try:
        import polygraphy  # noqa: F401
        import tensorrt  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"real TensorRT engine test: {exc.name} is not installed (needs a CUDA image with "
                    f"streamvox[tensorrt])")
    if not torch.cuda.is_available():
        pytest.skip("real TensorRT engine test: no CUDA device")


def test_real_tensorrt_engines_match_torch(tiny_dit_models, tmp_path):
    """Export -> build-engines -> apply_backend(tensorrt) on a GPU; fp32 engines (TF32 may be
    used by TensorRT), tolerance 5e-3."""
    _real_tensorrt_or_skip()
    from engines.export.onnx_export import export_models
    from engines.export.tensorrt_backend import build_engines

    export_models(tiny_dit_models, tmp_path / "onnx")
    build_engines(tmp_path / "onnx", tmp_path / "trt")
    cuda = torch.device("cuda")
    models = apply_backend(tiny_dit_models, "tensorrt", tmp_path / "trt", cuda)
    ref_dit = tiny_dit_models.dit.to(cuda)
    batch = [x.to(cuda) for x in example_dit_batch(tiny_dit_models.dit.cfg, positive_rows=3, frames=10, enc_len=7)]
    with torch.no_grad():
        ref = ref_dit(*batch)
    assert (models.dit(*batch) - ref)[batch[3]].abs().max().item() < 5e-3
