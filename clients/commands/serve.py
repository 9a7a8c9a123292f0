"""`streamvox serve`: run the HTTP + WebSocket server (flags also as STREAMVOX_* env vars)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    from service.settings import add_arguments  # light: no torch

    parser = subparsers.add_parser("serve", help="run the streaming TTS server",
                                   description="Run the server. Every flag can also be set by its environment variable.")
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from service.server import run as run_server
    from service.settings import from_args

    try:
        settings = from_args(args)
    except (ValueError, OSError) as exc:
        print(f"streamvox serve: {exc}", file=sys.stderr)
        return 2
    try:
        return run_server(settings)
    except Exception as exc:
        # imported here: it pulls in torch, which a fast failure (busy port, unknown model) never needs
        from engines.export.base import BackendError

        if not isinstance(exc, (ValueError, FileNotFoundError, BackendError)):
            raise
        print(f"streamvox serve: cannot start the engine: {exc}", file=sys.stderr)  # checkpoint / backend / device
        return 2
