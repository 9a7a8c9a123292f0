"""`streamvox export`: the DiT and codec decoder as ONNX graphs + manifest.json.

The artifacts serve ``--backend onnxruntime`` directly and are the input of
``streamvox build-engines`` (TensorRT). Use the same --preset / --model / --seed
as the server: the manifest records the weights' hash and the backends refuse others.
"""

from __future__ import annotations

import argparse
import sys

from .errors import fail


def register(subparsers: argparse._SubParsersAction) -> None:
    from clients.commands.model_option import add_model_option

    p = subparsers.add_parser("export", help="export the DiT and codec decoder to ONNX (+ manifest.json)")
    p.add_argument("--preset", choices=("tiny", "small", "base"), default="small")
    p.add_argument("--out", required=True, help="output directory")
    add_model_option(p, "default: none (random weights)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-init components (as the server's)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="graph precision; half precision keeps the torch path's fp32 islands (for TensorRT)")
    p.add_argument("--graphs", default="dit,decoder_step,decoder_full", help="comma-separated subset to export")
    p.add_argument("--exporter", choices=("torchscript", "dynamo"), default="torchscript",
                   help="torch.onnx exporter (torchscript: seconds; dynamo: torch.export based, minutes)")
    p.add_argument("--max-full-frames", type=int, default=1500, help="longest whole-utterance decode (frames)")
    p.add_argument("--verify", action="store_true",
                   help="after export, run the graphs in ONNX Runtime and print the max |diff| to torch")
    p.set_defaults(func=run)


def missing_packages(args: argparse.Namespace) -> list[str]:
    """The packages this export needs and the environment lacks: onnx (and onnxruntime for
    --verify) come with streamvox, onnxscript (--exporter dynamo) with the ``onnx`` extra."""
    import importlib

    needed = ["onnx"] + (["onnxscript"] if args.exporter == "dynamo" else []) + (["onnxruntime"] if args.verify else [])
    missing = []
    for name in needed:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    missing = missing_packages(args)
    if missing == ["onnxscript"]:
        return fail(args.command, "--exporter dynamo needs onnxscript, the `onnx` extra: pip install -e '.[onnx]'")
    if missing:  # dependencies of streamvox itself: a broken installation
        return fail(args.command, f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing, "
                                  "a dependency of streamvox: reinstall it (pip install -e .)")

    import torch

    from clients.commands.model_option import show_hub_logs
    from engines.checkpoints.hub import ModelUnavailable, resolve_model
    from engines.config import get_preset
    from engines.export.onnx_export import DTYPES, default_profiles, export_models
    from engines.pipelines.dit.weights import load_models

    checkpoint = None
    if args.model:
        show_hub_logs()
        try:
            checkpoint = str(resolve_model(args.model))  # a hub id is fetched into the cache first
        except ModelUnavailable as exc:
            return fail(args.command, exc)
    config = get_preset(args.preset)
    models = load_models(Path(checkpoint) if checkpoint else None, config, args.seed)
    graphs = tuple(g.strip() for g in args.graphs.split(",") if g.strip())
    print(f"exporting {', '.join(graphs)} ({args.preset}, {args.dtype}, {args.exporter} exporter) to {args.out} ...",
          flush=True)  # tens of seconds with nothing else to show
    t0 = time.perf_counter()
    try:
        manifest = export_models(models, args.out, dtype=DTYPES[args.dtype], graphs=graphs,
                                 profiles=default_profiles(models.config, args.max_full_frames),
                                 checkpoint=checkpoint, exporter=args.exporter)
    except ValueError as exc:
        return fail(args.command, exc)
    print(f"exported {', '.join(manifest.graphs)} ({manifest.preset}, {manifest.dtype}) to {args.out} "
          f"in {time.perf_counter() - t0:.1f}s")
    for name, g in manifest.graphs.items():
        ranges = ", ".join(f"{a} {r.min}..{r.max}" for a, r in g.profile.items())
        print(f"  {g.onnx:20s} {ranges}")
    if args.verify:
        if args.dtype != "float32":
            print("--verify compares fp32 graphs only; skipped", file=sys.stderr)
            return 0
        from engines.export.parity import parity_report

        torch.manual_seed(0)
        for name, err in parity_report(models, args.out).items():
            print(f"  onnxruntime vs torch {name:28s} max |diff| {err:.2e}")
    return 0
