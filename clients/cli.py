"""The `streamvox` command line.

Each subcommand lives in its own module under ``clients/commands/`` and exposes
``register(subparsers)``; heavy packages (`engines`, `service`, torch) are imported
lazily inside the command so ``streamvox --help`` stays instant.
"""

from __future__ import annotations

import argparse
import difflib
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
CLOSED_PIPE_EXIT = 141  # what a shell reports for a program a closed pipe stopped (128 + SIGPIPE), as `ls | head`


class Parser(argparse.ArgumentParser):
    """A usage error is one line, ``streamvox COMMAND: what is wrong (see ... --help)``, in the
    style of every other failure (clients/commands/errors.py), not argparse's whole usage
    (47 lines for `serve`) above it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}; see `{self.prog} --help`\n")

    def unrecognized(self, unknown: list[str]):
        flags = [flag for action in self._actions for flag in action.option_strings]
        guesses = [difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1) for arg in unknown if arg.startswith("-")]
        hint = ", ".join(f"{guess[0]}?" for guess in guesses if guess)
        self.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" (did you mean {hint})" if hint else ""))


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("streamvox")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="streamvox", description="Streaming text-to-speech server and tools")
    parser.add_argument("--version", action="version", version=f"streamvox {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a command not written yet must not break the others
            if exc.name != name:
                raise
            continue
        module.register(subparsers)
    for command in subparsers.choices.values():  # a bad flag is reported with its command's own name
        command.set_defaults(command_parser=command)
    return parser


def quiet_closed_stdout() -> int:
    """The reader of our stdout went away (`streamvox jobs | head -1`): stop without a word.
    Python's own advice: point stdout at /dev/null so the exit's flush does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return CLOSED_PIPE_EXIT


def main(argv: list[str] | None = None) -> int:
    # Before torch loads OpenMP: its idle threads sleep instead of spinning, so the talker's ONNX
    # Runtime kernels (the CPU default, engines/models/quantize_nbits.py) get the cores; spinning
    # OpenMP workers made a 2-thread int4 step ~4x slower, and fp32 runs the same either way.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    argv = sys.argv[1:] if argv is None else argv
    try:
        try:
            return run(argv)
        finally:  # argparse's --help and --version leave through SystemExit: flushed here too
            sys.stdout.flush()
    except BrokenPipeError:
        return quiet_closed_stdout()


def run(argv: list[str]) -> int:
    parser = build_parser()
    if not argv:  # a bare `streamvox`: what it can do, not an error
        parser.print_help()
        return 0
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.unrecognized(unknown)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
