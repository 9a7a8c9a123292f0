"""How every command reports a failure: one line on stderr, ``streamvox COMMAND: what went
wrong``, and an exit code: 2 when the command line, a file or the model named is wrong (found
before any work), 1 when the work itself failed (the server, the synthesis)."""

from __future__ import annotations

import sys


class CommandError(Exception):
    """A command's own failure: one line for stderr and the exit code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def fail(command: str, message: object, code: int = 2) -> int:
    """Print the line and return ``code`` (``return fail(args.command, exc)``)."""
    print(f"streamvox {command}: {message}", file=sys.stderr)
    return code
