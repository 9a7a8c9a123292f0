"""ONNX Runtime backend: the exported graphs run by onnxruntime (CPU by default).

Tensors cross as numpy arrays (zero-copy on CPU for contiguous tensors); every run
returns fresh arrays, so no output buffer is reused between the two CFG passes.
On a CUDA device the tensors go through host memory: this backend is meant for CPU
hosts (and as the proof that the graphs compute what torch computes); the GPU path
is TensorRT.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engines.export.base import BackendUnavailable, DecoderRunner, DiTRunner
from engines.export.manifest import GraphSpec, Manifest
from engines.models.configs import CodecDecoderConfig, DiTConfig


def _ort():
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailable("--backend onnxruntime needs onnxruntime, a dependency of streamvox that is "
                                 "missing here: reinstall it (pip install -e .)") from exc
    return onnxruntime


def make_session(path: Path, threads: int | None = None, providers: list[str] | None = None):
    ort = _ort()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Default: as many intra-op threads as torch uses, so the comparison is like for like.
    options.intra_op_num_threads = threads if threads is not None else torch.get_num_threads()
    options.inter_op_num_threads = 1
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run streamvox export first")
    return ort.InferenceSession(str(path), options, providers=providers or ["CPUExecutionProvider"])


class _Graph:
    """One session + its spec: named torch inputs in, named torch outputs out."""

    def __init__(self, directory: Path, spec: GraphSpec, threads: int | None):
        self.spec = spec
        self.session = make_session(directory / spec.onnx, threads)
        self.in_dtypes = {t.name: t.torch_dtype() for t in spec.inputs}
        # Inputs the exporter dropped (unused by the graph) are not fed.
        self.fed = {i.name for i in self.session.get_inputs()}
        self.out_names = [t.name for t in spec.outputs]

    def run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        arrays = {k: np.ascontiguousarray(v.detach().to("cpu", self.in_dtypes[k]).numpy())
                  for k, v in feeds.items() if k in self.fed}
        return [torch.from_numpy(a) for a in self.session.run(self.out_names, arrays)]


class OrtDiT(DiTRunner):
    def __init__(self, directory: Path, manifest: Manifest, cfg: DiTConfig, threads: int | None = None):
        spec = manifest.graphs["dit"]
        super().__init__(cfg, spec.profile)
        self._g = _Graph(directory, spec, threads)

    def _run(self, x, positions, context_mask, frame_mask, t, enc, enc_mask):
        (v,) = self._g.run({"x": x, "positions": positions, "context_mask": context_mask, "frame_mask": frame_mask,
                            "t": t, "enc": enc, "enc_mask": enc_mask})
        return v.to(x.device, x.dtype)


class OrtDecoder(DecoderRunner):
    def __init__(self, directory: Path, manifest: Manifest, cfg: CodecDecoderConfig, samples_per_frame: int,
                 template, threads: int | None = None):
        step, full = manifest.graphs.get("decoder_step"), manifest.graphs.get("decoder_full")
        if step is None:
            raise FileNotFoundError(f"{directory}: manifest has no decoder_step graph (export it)")
        super().__init__(cfg, samples_per_frame, template, full.profile if full else {}, step.profile)
        self._step = _Graph(directory, step, threads)
        self._full = _Graph(directory, full, threads) if full else None
        self._state_names = [t.name for t in step.inputs[1:]]

    def _run_step(self, codes, live):
        outs = self._step.run({"codes": codes, **dict(zip(self._state_names, live))})
        dev, dt = codes.device, live[0].dtype
        return outs[0].to(dev, dt), [o.to(dev, x.dtype) for o, x in zip(outs[1:], live)]

    def _run_full(self, codes):
        if self._full is None:
            raise FileNotFoundError("manifest has no decoder_full graph (export it)")
        (wav,) = self._full.run({"codes": codes})
        return wav.to(codes.device)
