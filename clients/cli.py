"""The `streamvox` command line.

Each subcommand lives in its own module under ``clients/commands/`` and exposes
``register(subparsers)``; heavy packages (`engines`, `service`, torch) are imported
lazily inside the command so ``streamvox --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Subcommand modules, in the order `--help` lists them.
COMMAND_MODULES = (
    "clients.commands.serve",
    "clients.commands.synthesize",
    "clients.commands.download",
    "clients.commands.say",
    "clients.commands.jobs",
    "clients.commands.migrate_store",
    "clients.commands.export",
    "clients.commands.build_engines",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamvox", description="Streaming text-to-speech server and tools")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a command not written yet must not break the others
            if exc.name != name:
                raise
            continue
        module.register(subparsers)
    for command in subparsers.choices.values():  # a bad flag is reported with its command's own usage
        command.set_defaults(command_parser=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before torch loads OpenMP: its idle threads sleep instead of spinning, so the talker's ONNX
    # Runtime kernels (the CPU default, engines/models/quantize_nbits.py) get the cores; spinning
    # OpenMP workers made a 2-thread int4 step ~4x slower, and fp32 runs the same either way.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
