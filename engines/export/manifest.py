"""manifest.json: what an artifacts directory (ONNX graphs, TensorRT engines) holds.

Written by ``streamvox export`` and extended by ``streamvox build-engines``; read by
every exported backend before it runs anything, so engines built for other weights
or another model size fail loudly instead of producing noise.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engines.export.base import ArtifactMismatch, AxisRange

MANIFEST = "manifest.json"
FORMAT = "streamvox-backend-artifacts"
VERSION = 1


def weights_hash(module: nn.Module) -> str:
    """sha256 over the module's state dict (sorted keys; names, shapes and fp32 values).

    Values are hashed in fp32 so the hash names the weights, not the serving dtype:
    compute it on the models as loaded (before any bf16/fp16 cast)."""
    h = hashlib.sha256()
    for name, value in sorted(module.state_dict().items()):
        t = value.detach().to("cpu")
        h.update(f"{name}:{tuple(t.shape)}:{'int' if not t.is_floating_point() else 'float'};".encode())
        t = t.to(torch.float32) if t.is_floating_point() else t.to(torch.int64)
        h.update(t.contiguous().numpy().tobytes())
    return "sha256:" + h.hexdigest()


def file_hash(path: str | Path, block: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """As it reads back from JSON (tuples become lists), so configs compare equal."""
    return json.loads(json.dumps(d))


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. float32, int64, bool
    shape: tuple  # ints and axis names ("batch", "frames", "enc_len")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "TensorSpec":
        return TensorSpec(d["name"], d["dtype"], tuple(d["shape"]))

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def concrete(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """The shape with every named axis replaced by its size."""
        return tuple(sizes[a] if isinstance(a, str) else a for a in self.shape)


@dataclass(frozen=True)
class GraphSpec:
    component: str  # "dit" | "decoder": whose weights the graph holds
    onnx: str  # file name inside the artifacts directory
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    profile: dict[str, AxisRange]  # axis name -> min/opt/max (TensorRT optimization profile)
    engine: str | None = None  # TensorRT plan file, set by build-engines
    exporter: str | None = None  # torch.onnx exporter that wrote the graph

    def to_dict(self) -> dict[str, Any]:
        return {"component": self.component, "onnx": self.onnx, "engine": self.engine, "exporter": self.exporter,
                "inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs],
                "profile": {k: v.to_list() for k, v in self.profile.items()}}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "GraphSpec":
        return GraphSpec(component=d["component"], onnx=d["onnx"], engine=d.get("engine"), exporter=d.get("exporter"),
                         inputs=tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
                         outputs=tuple(TensorSpec.from_dict(t) for t in d["outputs"]),
                         profile={k: AxisRange(*v) for k, v in d["profile"].items()})

    def input_shapes(self, which: str) -> dict[str, tuple[int, ...]]:
        """Concrete input shapes at the profile's ``min``, ``opt`` or ``max``."""
        sizes = {k: getattr(r, which) for k, r in self.profile.items()}
        return {t.name: t.concrete(sizes) for t in self.inputs}


@dataclass
class Manifest:
    preset: str
    dtype: str  # dtype of the exported weights/activations (fp32 islands inside, see docs/BACKENDS.md)
    config: dict[str, Any]  # {"dit": DiTConfig dict, "decoder": CodecDecoderConfig dict}
    weights: dict[str, str]  # component -> weights_hash
    graphs: dict[str, GraphSpec]
    torch_version: str = torch.__version__
    opset: int | None = None
    exporter: str | None = None
    checkpoint: dict[str, str] | None = None  # {"path": ..., "sha256": ...} when exported from a file
    tensorrt: dict[str, Any] = field(default_factory=dict)  # build-engines: version, precision, device

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "preset": self.preset, "dtype": self.dtype,
                "config": self.config, "weights": self.weights, "torch_version": self.torch_version,
                "opset": self.opset, "exporter": self.exporter, "checkpoint": self.checkpoint,
                "tensorrt": self.tensorrt,
                "graphs": {k: g.to_dict() for k, g in self.graphs.items()}}

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @staticmethod
    def load(directory: str | Path) -> "Manifest":
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise ArtifactMismatch(f"{path} not found: export the models first (streamvox export --out {directory})")
        d = json.loads(path.read_text())
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise ArtifactMismatch(f"{path}: not a {FORMAT} v{VERSION} manifest "
                                   f"(format={d.get('format')!r}, version={d.get('version')!r})")
        return Manifest(preset=d["preset"], dtype=d["dtype"], config=d["config"], weights=d["weights"],
                        graphs={k: GraphSpec.from_dict(g) for k, g in d["graphs"].items()},
                        torch_version=d.get("torch_version", ""), opset=d.get("opset"), exporter=d.get("exporter"),
                        checkpoint=d.get("checkpoint"), tensorrt=d.get("tensorrt") or {})

    def verify(self, component: str, module: nn.Module, config: dict[str, Any], where: str) -> None:
        """ArtifactMismatch unless ``module`` has the weights and config the graphs were exported from."""
        config = jsonable(config)
        if self.config.get(component) != config:
            diff = sorted(k for k in set(config) | set(self.config.get(component, {}))
                          if config.get(k) != self.config.get(component, {}).get(k))
            raise ArtifactMismatch(f"{where}: {component} config differs from the exported one "
                                   f"(preset {self.preset!r}; fields {diff}); re-export for this model")
        want, got = self.weights.get(component), weights_hash(module)
        if want != got:
            raise ArtifactMismatch(f"{where}: built for other {component} weights (manifest {want}, "
                                   f"loaded {got}); re-run streamvox export (and build-engines) with "
                                   f"the same --preset/--model/seed as the server")
