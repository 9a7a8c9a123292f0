"""`streamvox build-engines`: TensorRT engines from `streamvox export` graphs (polygraphy)."""

from __future__ import annotations

import argparse

from .errors import fail


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("build-engines", help="build TensorRT engines from exported ONNX graphs")
    p.add_argument("--onnx", required=True, help="directory written by streamvox export")
    p.add_argument("--out", required=True, help="output directory for the .plan files + manifest.json")
    p.add_argument("--graphs", default=None, help="comma-separated subset (default: every exported graph)")
    p.add_argument("--workspace-gb", type=float, default=None, help="TensorRT workspace limit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from engines.export import BackendError
    from engines.export.tensorrt_backend import build_engines

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    graphs = tuple(g.strip() for g in args.graphs.split(",")) if args.graphs else None
    try:
        manifest = build_engines(args.onnx, args.out, graphs, args.workspace_gb)
    except BackendError as exc:
        return fail(args.command, exc)
    for name, g in manifest.graphs.items():
        print(f"  {g.engine}: profile " + ", ".join(f"{a} {r.min}/{r.opt}/{r.max}" for a, r in g.profile.items()))
    print(f"TensorRT {manifest.tensorrt.get('version')} engines written to {args.out}")
    return 0
