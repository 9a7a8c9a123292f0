"""Where a command writes its file (``--out``): checked before any work, so a typo costs one
line on stderr, not a traceback after the audio was made."""

from __future__ import annotations

import os
from pathlib import Path


class OutputError(Exception):
    """The file cannot be written there; the message is one line for stderr."""


def output_file(path: str, flag: str = "--out") -> Path:
    """``path``, its folder created when missing; OutputError saying why it cannot be written."""
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{flag} {path}: is a folder; name a file in it")
    folder = target.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{flag} {path}: cannot create the folder {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK):
        raise OutputError(f"{flag} {path}: the folder {folder} is not writable")
    return target


def write_bytes(target: Path, data: bytes, flag: str = "--out") -> None:
    try:
        target.write_bytes(data)
    except OSError as exc:
        raise OutputError(f"{flag} {target}: {exc.strerror or exc}") from None
