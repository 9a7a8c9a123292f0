"""Export the DiT and the codec decoder to ONNX (+ manifest.json).

Three graphs, all with fixed input/output names and dynamic axes:

* ``dit.onnx`` - FlowDiT.forward as is (it is traceable: masks come from tensor ops,
  no host reads). Axes: batch rows, frames, enc_len.
* ``decoder_step.onnx`` - CodecDecoder.decode_step with its carried state flattened
  into named tensors: inputs ``codes, conv_i, key_l, value_l, position``, outputs
  ``wav, next_conv_i, next_key_l, next_value_l, next_position``. Axes: batch, frames.
  This (rather than a fixed left-context chunk decode) keeps streaming exact: the
  state is the same state torch carries, so chunked ORT output concatenates to the
  full decode exactly as torch's does, with no recomputed overlap per chunk.
* ``decoder_full.onnx`` - CodecDecoder.forward (stateless, whole utterance).

Precision: the graph dtype is the module dtype at export (``dtype=``). The torch code
casts to fp32 where it must (RMSNorm, RoPE, timestep embedding), and those casts are
in the graph, so a half-precision export built as a *strongly typed* TensorRT network
keeps exactly the torch path's fp32 islands (see build-engines).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from engines.export.base import (
    AxisRange,
    flatten_state,
    live_state_indices,
    state_names,
)
from engines.export.manifest import (
    GraphSpec,
    Manifest,
    TensorSpec,
    file_hash,
    jsonable,
    weights_hash,
)
from engines.models.codec_decoder import CodecDecoder, DecoderState
from engines.models.configs import ModelConfig
from engines.models.dit import FlowDiT

log = logging.getLogger("streamvox.export")

GRAPHS = ("dit", "decoder_step", "decoder_full")
OPSET = 18
# "torchscript" (default): torch.onnx's tracing exporter - exports in about a second, keeps
# module paths in node names (readable TensorRT layer names); deprecated upstream.
# "dynamo": the torch.export-based exporter - the supported path going forward,
# 20-60x slower to export. Both give graphs within 1e-4 of torch (tests).
EXPORTERS = ("torchscript", "dynamo")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_profiles(config: ModelConfig, max_full_frames: int = 1500) -> dict[str, dict[str, AxisRange]]:
    """Profile ranges (min/opt/max per dynamic axis) the pipeline needs for ``config``.

    DiT rows up to the stream batch ceiling; frames up to context + the largest chunk (a
    last chunk shorter than the first chunk joins the one before it); encoder length up
    to max_text_tokens. Decoder steps: up to max_slots streams x the largest chunk
    (bigger calls are split by the runner); full decodes up to ``max_full_frames``."""
    s, d = config.stream, config.dit
    max_chunk = s.chunk_frames + s.first_chunk_frames
    frames = d.context_frames + max_chunk
    return {
        "dit": {"batch": AxisRange(1, max(1, min(s.max_slots, s.batch_ceiling)), s.batch_ceiling),
                "frames": AxisRange(1, min(frames, d.context_frames + s.chunk_frames), frames),
                "enc_len": AxisRange(1, min(64, config.text.max_text_tokens), config.text.max_text_tokens)},
        "decoder_step": {"batch": AxisRange(1, 1, s.max_slots),
                         "frames": AxisRange(1, s.chunk_frames, max_chunk)},
        "decoder_full": {"batch": AxisRange(1, 1, s.max_slots),
                         "frames": AxisRange(1, min(250, max_full_frames), max_full_frames)},
    }


class DecoderStepGraph(nn.Module):
    """decode_step with the state as flat tensors: (codes, *live) -> (wav, *next_live)."""

    def __init__(self, decoder: CodecDecoder):
        super().__init__()
        self.decoder = decoder
        template = decoder.init_state(1)
        self.live = live_state_indices(template)
        self.flat_shapes = [tuple(x.shape[1:]) for x in flatten_state(template)]
        self.num_conv, self.num_layers = len(template.conv), len(template.keys)

    def forward(self, codes: torch.Tensor, *live: torch.Tensor):
        flat, it = [], iter(live)
        for i, shape in enumerate(self.flat_shapes):
            # Empty carried tensors ([B, C, 0]) are rebuilt inside the graph, not inputs.
            flat.append(next(it) if i in self.live else live[0].new_zeros((codes.shape[0], *shape)))
        c, n = self.num_conv, self.num_layers
        state = DecoderState(flat[:c], flat[c:c + n], flat[c + n:c + 2 * n], flat[c + 2 * n])
        wav, new = self.decoder.decode_step(codes, state)
        out = flatten_state(new)
        return (wav, *[out[i] for i in self.live])


class DecoderFullGraph(nn.Module):
    def __init__(self, decoder: CodecDecoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decoder(codes)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _export(module: nn.Module, args: tuple, path: Path, inputs: list[TensorSpec], outputs: list[TensorSpec],
            profile: dict[str, AxisRange], exporter: str) -> None:
    """ONNX export with named dynamic axes taken from the specs."""
    if exporter == "torchscript":
        axes = {t.name: {i: a for i, a in enumerate(t.shape) if isinstance(a, str)} for t in (*inputs, *outputs)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=OPSET, dynamic_axes=axes,
                              input_names=[t.name for t in inputs], output_names=[t.name for t in outputs])
        return
    dims = {a: torch.export.Dim(a, min=1, max=r.max) for a, r in profile.items()}
    dynamic_shapes = {t.name: {i: dims[a] for i, a in enumerate(t.shape) if isinstance(a, str)} for t in inputs}
    if isinstance(module, DecoderStepGraph):  # *live is one positional varargs entry
        dynamic_shapes = (dynamic_shapes["codes"], tuple(dynamic_shapes[t.name] for t in inputs[1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter is chatty about axis renames
        program = torch.onnx.export(module, args, dynamo=True, optimize=True, opset_version=OPSET,
                                    input_names=[t.name for t in inputs], output_names=[t.name for t in outputs],
                                    dynamic_shapes=dynamic_shapes, external_data=False, verbose=False)
    program.save(str(path))


def _example_sizes(profile: dict[str, AxisRange]) -> dict[str, int]:
    # Example sizes > 1 and distinct per axis, so the tracer cannot specialize or merge axes.
    sizes = {"batch": 3, "frames": 7, "enc_len": 5}
    return {a: min(max(sizes.get(a, 2), r.min), r.max) for a, r in profile.items()}


def export_dit(dit: FlowDiT, path: Path, profile: dict[str, AxisRange], dtype: torch.dtype,
               exporter: str = "torchscript") -> GraphSpec:
    cfg = dit.cfg
    fdt = _name(dtype)
    inputs = [TensorSpec("x", fdt, ("batch", "frames", cfg.latent_dim)),
              TensorSpec("positions", "int64", ("batch", "frames")),
              TensorSpec("context_mask", "bool", ("batch", "frames")),
              TensorSpec("frame_mask", "bool", ("batch", "frames")),
              TensorSpec("t", "float32", ("batch",)),
              TensorSpec("enc", fdt, ("batch", "enc_len", cfg.cond_dim)),
              TensorSpec("enc_mask", "bool", ("batch", "enc_len"))]
    outputs = [TensorSpec("v", fdt, ("batch", "frames", cfg.latent_dim))]
    n = _example_sizes(profile)
    B, T, L = n["batch"], n["frames"], n["enc_len"]
    frame_mask = torch.ones(B, T, dtype=torch.bool)
    frame_mask[0, T - 1:] = False
    enc_mask = torch.ones(B, L, dtype=torch.bool)
    enc_mask[0, L - 1:] = False
    args = (torch.randn(B, T, cfg.latent_dim, dtype=dtype), torch.arange(T).expand(B, T).contiguous(),
            torch.arange(T).expand(B, T) < 2, frame_mask, torch.rand(B), torch.randn(B, L, cfg.cond_dim, dtype=dtype),
            enc_mask)
    _export(dit, args, path, inputs, outputs, profile, exporter)
    return GraphSpec("dit", path.name, tuple(inputs), tuple(outputs), profile)


def export_decoder_step(decoder: CodecDecoder, path: Path, profile: dict[str, AxisRange],
                        dtype: torch.dtype, exporter: str = "torchscript") -> GraphSpec:
    graph = DecoderStepGraph(decoder).eval()
    template = decoder.init_state(1, torch.device("cpu"), dtype)
    flat = flatten_state(template)
    names = state_names(graph.num_conv, graph.num_layers)
    G = decoder.cfg.num_quantizers
    inputs = [TensorSpec("codes", "int64", ("batch", G, "frames"))]
    outputs = [TensorSpec("wav", _name(dtype), ("batch", "frames_out"))]
    for i in graph.live:
        shape = ("batch", *flat[i].shape[1:])
        inputs.append(TensorSpec(names[i], _name(flat[i].dtype), shape))
        outputs.append(TensorSpec("next_" + names[i], _name(flat[i].dtype), shape))
    n = _example_sizes(profile)
    B, T = n["batch"], n["frames"]
    state = decoder.init_state(B, torch.device("cpu"), dtype)
    # A non-trivial state (as after a first chunk) so no input is constant-folded away.
    state.position = torch.full((B,), 5, dtype=torch.int64)
    state = DecoderState([torch.randn_like(x) for x in state.conv], [torch.randn_like(x) for x in state.keys],
                         [torch.randn_like(x) for x in state.values], state.position)
    live = [flatten_state(state)[i] for i in graph.live]
    codes = torch.randint(0, decoder.cfg.codebook_size, (B, G, T))
    _export(graph, (codes, *live), path, inputs, outputs, profile, exporter)
    spec_out = tuple(outputs)
    return GraphSpec("decoder", path.name, tuple(inputs), spec_out, profile)


def export_decoder_full(decoder: CodecDecoder, path: Path, profile: dict[str, AxisRange],
                        dtype: torch.dtype, exporter: str = "torchscript") -> GraphSpec:
    G = decoder.cfg.num_quantizers
    inputs = [TensorSpec("codes", "int64", ("batch", G, "frames"))]
    outputs = [TensorSpec("wav", _name(dtype), ("batch", "frames_out"))]
    n = _example_sizes(profile)
    codes = torch.randint(0, decoder.cfg.codebook_size, (n["batch"], G, n["frames"]))
    _export(DecoderFullGraph(decoder).eval(), (codes,), path, inputs, outputs, profile, exporter)
    return GraphSpec("decoder", path.name, tuple(inputs), tuple(outputs), profile)


def export_models(models, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                  graphs: tuple[str, ...] = GRAPHS, profiles: dict[str, dict[str, AxisRange]] | None = None,
                  checkpoint: str | None = None, exporter: str = "torchscript") -> Manifest:
    """Export ``graphs`` of ``models`` (engines.pipelines.modules.Models, fp32 as loaded) into ``out_dir``
    and write manifest.json. The weights hash is taken from the models as given."""
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}; choose one of {EXPORTERS}")
    unknown = set(graphs) - set(GRAPHS)
    if unknown:
        raise ValueError(f"unknown graphs {sorted(unknown)}; choose from {GRAPHS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config: ModelConfig = models.config
    profiles = {**default_profiles(config), **(profiles or {})}
    weights = {"dit": weights_hash(models.dit), "decoder": weights_hash(models.decoder)}
    # Export from fp32-on-CPU copies cast to the target dtype; the served modules stay as they are.
    dit = copy.deepcopy(models.dit).to("cpu", dtype).eval()
    decoder = copy.deepcopy(models.decoder).to("cpu", dtype).eval()
    exporters = {"dit": lambda p, pr, e: export_dit(dit, p, pr, dtype, e),
                 "decoder_step": lambda p, pr, e: export_decoder_step(decoder, p, pr, dtype, e),
                 "decoder_full": lambda p, pr, e: export_decoder_full(decoder, p, pr, dtype, e)}
    specs = {}
    with torch.no_grad():
        for g in graphs:
            use = exporter
            if exporter == "torchscript" and dtype == torch.bfloat16 and g.startswith("decoder"):
                # The torchscript exporter fails on the bf16 decoder ("ScalarType ComplexDouble
                # is an unexpected tensor scalar type", torch 2.13); the dynamo one exports it.
                log.warning("%s in bfloat16: the torchscript exporter cannot export it, using dynamo", g)
                use = "dynamo"
            log.info("exporting %s (%s)", g, use)
            spec = exporters[g](out / f"{g}.onnx", profiles[g], use)
            specs[g] = dataclasses.replace(spec, exporter=use)
    ck = {"path": str(checkpoint), "sha256": file_hash(checkpoint)} if checkpoint and Path(checkpoint).is_file() else (
        {"path": str(checkpoint)} if checkpoint else None)
    manifest = Manifest(preset=config.name, dtype=_name(dtype),
                        config=jsonable({"dit": config.dit.to_dict(), "decoder": config.decoder.to_dict()}),
                        weights=weights, graphs=specs, opset=OPSET, checkpoint=ck, exporter=exporter)
    manifest.save(out)
    return manifest
