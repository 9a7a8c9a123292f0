"""`streamvox download`: fetch a model into the Hugging Face cache ahead of time.

For images (``docker build --build-arg STREAMVOX_MODEL=...``) and init containers: a later
``streamvox serve --model`` (with ``HF_HUB_OFFLINE=1`` if you like) then loads it from the
cache. Prints the local directory on standard output, everything else on standard error.
"""

from __future__ import annotations

import argparse
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from engines.checkpoints.hub import DEFAULT_MODEL  # light: no huggingface_hub, no torch

    p = subparsers.add_parser("download", help="fetch a model into the Hugging Face cache (HF_HOME) ahead of time",
                              description="Fetch the files streamvox loads from a Qwen3-TTS release into the "
                                          "Hugging Face cache and print where they are. HF_HOME, HF_TOKEN, "
                                          "HF_ENDPOINT and HF_HUB_OFFLINE apply as for every Hugging Face tool.")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help=f"ORG/NAME[@REVISION] (default: $STREAMVOX_MODEL, else {DEFAULT_MODEL})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from clients.commands.model_option import show_hub_logs
    from engines.checkpoints.hub import DEFAULT_MODEL, RANDOM, ModelUnavailable, resolve_model

    # The server's variables, so an init container next to `serve` needs no argument of its own.
    name = args.model or os.environ.get("STREAMVOX_MODEL") or os.environ.get("STREAMVOX_CHECKPOINT") or DEFAULT_MODEL
    name = name.strip()
    if name == RANDOM:
        print(f"streamvox download: {RANDOM!r} means random weights: nothing to download", file=sys.stderr)
        return 2
    show_hub_logs()
    try:
        path = resolve_model(name)
    except ModelUnavailable as exc:
        print(f"streamvox download: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
