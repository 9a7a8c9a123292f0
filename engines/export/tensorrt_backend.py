"""TensorRT backend: engines from ``streamvox build-engines`` run on their own CUDA stream.

Layering, so that the only code no machine here can run is the call into TensorRT:

* :class:`TrtRunner` - one engine: reads the optimization profile from the engine (the
  batch ceiling the scheduler uses), caches input/output buffers per input-shape key
  (LRU; the runner's stream is drained before an entry is freed, since an execute still
  in flight may use it), and orders its stream against the caller's with CUDA events:
  caller --event--> runner stream: copy inputs, execute --event--> caller. No host
  synchronize in steady state. It talks to TensorRT only through the engine object
  (``num_io_tensors, get_tensor_name, get_tensor_profile_shape,
  create_execution_context``) and its context (``set_input_shape, get_tensor_shape,
  set_tensor_address, execute_async_v3``); tests stand a fake in for exactly those.
* :class:`CudaStreams` / :class:`HostStreams` - the stream/event operations (torch.cuda,
  or no-ops for host memory where execution is synchronous).
* :class:`TrtDiT` / :class:`TrtDecoder` - the seam (base.DiTRunner / DecoderRunner).

Output buffers are reused per shape: a DiT output is valid until the next DiT call of
the same shape. The tick loop copies the first output out before the second pass of
two-pass CFG (stream.py) and uses a fused output before the next tick's call, which
the caller->runner event orders after every read already queued. Decoder outputs are
state that outlives the call, so TrtDecoder clones them.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.export.base import (
    ArtifactMismatch,
    AxisRange,
    BackendUnavailable,
    DecoderRunner,
    DiTRunner,
    ShapeOutsideProfile,
)
from engines.export.manifest import GraphSpec, Manifest
from engines.models.configs import CodecDecoderConfig, DiTConfig

log = logging.getLogger("streamvox.tensorrt")


def require_tensorrt(what: str = "--backend tensorrt"):
    """The tensorrt module, or BackendUnavailable saying what is missing."""
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable(
            f"{what} needs NVIDIA TensorRT (>= 10) and a CUDA GPU, and TensorRT is not installed: "
            f"pip install 'streamvox[tensorrt]' in the CUDA image, or use --backend torch / onnxruntime") from exc
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"{what} needs a CUDA device; torch sees none")
    return tensorrt


def require_polygraphy():
    trt = require_tensorrt("streamvox build-engines")
    try:
        import polygraphy  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable("streamvox build-engines needs polygraphy: pip install 'streamvox[tensorrt]'") from exc
    return trt


# --------------------------------------------------------------------------- streams


class CudaStreams:
    """Stream/event operations on one CUDA device (torch.cuda)."""

    def __init__(self, device: torch.device):
        self.device = device

    def new_stream(self):
        return torch.cuda.Stream(device=self.device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        stream.wait_event(event)  # device-side wait, the host does not block

    def handle(self, stream) -> int:
        return stream.cuda_stream

    def use(self, stream):
        return torch.cuda.stream(stream)

    def synchronize(self, stream) -> None:
        stream.synchronize()


class HostStreams:
    """The same operations for host memory, where every execute completes before it returns."""

    def new_stream(self):
        return "host"

    def current(self):
        return "host"

    def record(self, stream):
        return None

    def wait(self, stream, event) -> None:
        pass

    def handle(self, stream) -> int:
        return 0

    def use(self, stream):
        return contextlib.nullcontext()

    def synchronize(self, stream) -> None:
        pass


# --------------------------------------------------------------------------- one engine


def profile_from_engine(engine, spec: GraphSpec, profile_index: int = 0) -> dict[str, AxisRange]:
    """Per named axis, the range every input that has it accepts (read from the engine)."""
    lo: dict[str, list[int]] = {}
    for t in spec.inputs:
        mins, opts, maxs = (tuple(s) for s in engine.get_tensor_profile_shape(t.name, profile_index))
        for i, axis in enumerate(t.shape):
            if isinstance(axis, str):
                r = lo.setdefault(axis, [1, 1, 1 << 30])
                r[0], r[1], r[2] = max(r[0], mins[i]), max(r[1], opts[i]), min(r[2], maxs[i])
    return {a: AxisRange(mn, min(max(op, mn), mx), mx) for a, (mn, op, mx) in lo.items()}


@dataclass
class _Buffers:
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


class TrtRunner:
    """Executes one engine; see the module docstring for the ordering rules."""

    def __init__(self, engine, spec: GraphSpec, device: torch.device, streams=None, cache_size: int = 8,
                 keepalive=None):
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.engine, self.spec, self.device = engine, spec, torch.device(device)
        self._keepalive = keepalive  # the trt.Runtime must outlive its engine
        self.streams = streams or (CudaStreams(self.device) if self.device.type == "cuda" else HostStreams())
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        want = {t.name for t in (*spec.inputs, *spec.outputs)}
        if names != want:
            raise ArtifactMismatch(f"{spec.engine or spec.onnx}: engine tensors {sorted(names)} differ from the "
                                   f"manifest's {sorted(want)}; rebuild the engines from this export")
        self.profile = profile_from_engine(engine, spec)
        self.context = engine.create_execution_context()
        self.stream = self.streams.new_stream()
        self.cache_size = cache_size
        self._buffers: OrderedDict[tuple, _Buffers] = OrderedDict()
        self._context_key: tuple | None = None  # input shapes currently set on the context
        self.evictions: list[tuple] = []  # keys evicted, oldest first (observable for tests/metrics)

    def _check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        sizes: dict[str, int] = {}
        for t in self.spec.inputs:
            shape = shapes[t.name]
            if len(shape) != len(t.shape) or any(isinstance(a, int) and a != n for a, n in zip(t.shape, shape)):
                raise ValueError(f"{self.spec.onnx}: input {t.name} must be {list(t.shape)}, got {list(shape)}")
            for a, n in zip(t.shape, shape):
                if isinstance(a, str):
                    if sizes.setdefault(a, n) != n:
                        raise ValueError(f"{self.spec.onnx}: axis {a} is {sizes[a]} and {n} in the same call")
        for a, n in sizes.items():
            r = self.profile[a]
            if not r.contains(n):
                raise ShapeOutsideProfile(f"{self.spec.engine or self.spec.onnx}: {a} = {n} is outside the engine's "
                                          f"optimization profile [{r.min}, {r.max}]; rebuild with a wider profile")

    def _set_shapes(self, key: tuple) -> None:
        if self._context_key == key:
            return
        for t, shape in zip(self.spec.inputs, key):
            if not self.context.set_input_shape(t.name, shape):
                raise ShapeOutsideProfile(f"TensorRT rejected shape {shape} for input {t.name}")
        self._context_key = key

    def _buffers_for(self, key: tuple) -> _Buffers:
        hit = self._buffers.get(key)
        if hit is not None:
            self._buffers.move_to_end(key)
            return hit
        if len(self._buffers) >= self.cache_size:
            # An execute queued on our stream may still read/write the oldest buffers:
            # drain the stream before letting the allocator reuse their memory.
            self.streams.synchronize(self.stream)
            old, _ = self._buffers.popitem(last=False)
            self.evictions.append(old)
        self._set_shapes(key)
        inputs = {t.name: torch.empty(shape, dtype=t.torch_dtype(), device=self.device)
                  for t, shape in zip(self.spec.inputs, key)}
        outputs = {t.name: torch.empty(tuple(self.context.get_tensor_shape(t.name)), dtype=t.torch_dtype(),
                                       device=self.device) for t in self.spec.outputs}
        bufs = _Buffers(inputs, outputs)
        self._buffers[key] = bufs
        return bufs

    def run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Outputs (in manifest order) for ``feeds``; they are the cached buffers of this
        input shape, valid until the next call with the same shapes."""
        shapes = {t.name: tuple(feeds[t.name].shape) for t in self.spec.inputs}
        self._check(shapes)
        key = tuple(shapes[t.name] for t in self.spec.inputs)
        bufs = self._buffers_for(key)
        self._set_shapes(key)
        caller = self.streams.current()
        self.streams.wait(self.stream, self.streams.record(caller))  # inputs ready, earlier reads of outputs done
        with self.streams.use(self.stream):
            for name, buf in bufs.inputs.items():
                buf.copy_(feeds[name], non_blocking=True)  # casts to the engine dtype too
            for name, buf in (*bufs.inputs.items(), *bufs.outputs.items()):
                self.context.set_tensor_address(name, buf.data_ptr())
            if not self.context.execute_async_v3(self.streams.handle(self.stream)):
                raise RuntimeError(f"TensorRT execute failed for {self.spec.engine or self.spec.onnx} at {key}")
        self.streams.wait(caller, self.streams.record(self.stream))  # caller reads outputs after the execute
        return [bufs.outputs[t.name] for t in self.spec.outputs]


# --------------------------------------------------------------------------- the seam


def load_engine(directory: Path, spec: GraphSpec, manifest: Manifest, device: torch.device,
                cache_size: int = 8) -> TrtRunner:
    """A TrtRunner for the engine of ``spec`` (deserialized on ``device``)."""
    trt = require_tensorrt()
    if spec.engine is None:
        raise ArtifactMismatch(f"{directory}: no TensorRT engine for {spec.onnx}; run streamvox build-engines")
    built = manifest.tensorrt.get("version")
    if built and built != trt.__version__:
        raise ArtifactMismatch(f"{directory}: engines were built with TensorRT {built}, this is {trt.__version__}; "
                               f"rebuild them (streamvox build-engines)")
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine((directory / spec.engine).read_bytes())
    if engine is None:
        raise ArtifactMismatch(f"{directory / spec.engine}: TensorRT could not load it (other GPU or TensorRT "
                               f"version?); rebuild with streamvox build-engines on this machine")
    return TrtRunner(engine, spec, device, cache_size=cache_size, keepalive=runtime)


class TrtDiT(DiTRunner):
    profile_source = "engine's optimization profile"

    def __init__(self, runner: TrtRunner, cfg: DiTConfig):
        super().__init__(cfg, runner.profile)  # the ceiling comes from the engine, not the manifest
        self.runner = runner

    @staticmethod
    def from_artifacts(directory: Path, manifest: Manifest, cfg: DiTConfig, device: torch.device) -> "TrtDiT":
        spec = manifest.graphs["dit"]
        return TrtDiT(load_engine(directory, spec, manifest, device), cfg)

    def _run(self, x, positions, context_mask, frame_mask, t, enc, enc_mask):
        (v,) = self.runner.run({"x": x, "positions": positions, "context_mask": context_mask,
                                "frame_mask": frame_mask, "t": t, "enc": enc, "enc_mask": enc_mask})
        return v if v.dtype == x.dtype else v.to(x.dtype)


class TrtDecoder(DecoderRunner):
    profile_source = "engine's optimization profile"

    def __init__(self, step: TrtRunner, full: TrtRunner | None, cfg: CodecDecoderConfig, samples_per_frame: int,
                 template):
        super().__init__(cfg, samples_per_frame, template, full.profile if full else {}, step.profile)
        self.step_runner, self.full_runner = step, full
        self._state_names = [t.name for t in step.spec.inputs[1:]]

    @staticmethod
    def from_artifacts(directory: Path, manifest: Manifest, cfg: CodecDecoderConfig, samples_per_frame: int,
                       template, device: torch.device) -> "TrtDecoder":
        step = manifest.graphs["decoder_step"]
        full = manifest.graphs.get("decoder_full")
        return TrtDecoder(load_engine(directory, step, manifest, device),
                          load_engine(directory, full, manifest, device) if full else None,
                          cfg, samples_per_frame, template)

    def _run_step(self, codes, live):
        outs = self.step_runner.run({"codes": codes, **dict(zip(self._state_names, live))})
        # Carried state outlives this call: copy it out of the reused output buffers.
        return outs[0].clone(), [o.to(x.dtype, copy=True) for o, x in zip(outs[1:], live)]

    def _run_full(self, codes):
        (wav,) = self.full_runner.run({"codes": codes})
        return wav.clone()


# --------------------------------------------------------------------------- building


def build_engines(onnx_dir: str | Path, out_dir: str | Path, graphs: tuple[str, ...] | None = None,
                  workspace_gb: float | None = None) -> Manifest:
    """TensorRT engines (one optimization profile each, from the manifest's ranges) for the
    exported graphs, via polygraphy; writes ``<graph>.plan`` and manifest.json into ``out_dir``.

    The network is built *strongly typed*: every tensor keeps the dtype the ONNX graph gives
    it, so a float16/bfloat16 export runs in half precision with fp32 exactly where the
    torch code casts to fp32 (RMSNorm, RoPE, timestep embedding), and a float32 export
    gives fp32 engines. The DiT profile's max batch is the pipeline's batch ceiling."""
    trt = require_polygraphy()
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineBytesFromNetwork,
        NetworkFromOnnxPath,
        Profile,
    )

    src, out = Path(onnx_dir), Path(out_dir)
    manifest = Manifest.load(src)
    names = tuple(graphs or manifest.graphs)
    missing = [g for g in names if g not in manifest.graphs]
    if missing:
        raise ArtifactMismatch(f"{src}: manifest has no graphs {missing} (has {sorted(manifest.graphs)})")
    if manifest.dtype == "float32":
        log.warning("%s holds float32 graphs: the engines will be fp32; export with --dtype float16 or bfloat16 "
                    "for half precision", src)
    out.mkdir(parents=True, exist_ok=True)
    pools = {trt.MemoryPoolType.WORKSPACE: int(workspace_gb * (1 << 30))} if workspace_gb else None
    for name in names:
        spec = manifest.graphs[name]
        shapes = {w: spec.input_shapes(w) for w in ("min", "opt", "max")}
        profile = Profile()
        for t in spec.inputs:
            profile.add(t.name, min=shapes["min"][t.name], opt=shapes["opt"][t.name], max=shapes["max"][t.name])
        log.info("building %s: profile %s", name, {k: v.to_list() for k, v in spec.profile.items()})
        network = NetworkFromOnnxPath(str(src / spec.onnx), strongly_typed=True)
        plan = EngineBytesFromNetwork(network, CreateConfig(profiles=[profile], memory_pool_limits=pools))()
        (out / f"{name}.plan").write_bytes(bytes(plan))
        manifest.graphs[name] = GraphSpec(spec.component, spec.onnx, spec.inputs, spec.outputs, spec.profile,
                                          engine=f"{name}.plan")
        if src.resolve() != out.resolve():  # keep the graph next to its engine (inspection, rebuilds)
            (out / spec.onnx).write_bytes((src / spec.onnx).read_bytes())
    manifest.graphs = {k: v for k, v in manifest.graphs.items() if k in names}
    manifest.tensorrt = {"version": trt.__version__, "strongly_typed": True,
                         "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    manifest.save(out)
    return manifest
