"""The ``--model`` option of the in-process commands (synthesize, export), and the hub's log
lines on their standard error. ``serve`` takes it with every other server flag
(service/settings.py); the names resolve in one place, engines/checkpoints/hub.py."""

from __future__ import annotations

import argparse
import logging
import sys

MODEL_HELP = ("a Hugging Face id ORG/NAME[@REVISION] (fetched into the HF_HOME cache), a local Qwen3-TTS "
              "directory or streamvox .safetensors file")


def add_model_option(parser: argparse.ArgumentParser, default_note: str) -> None:
    """``--model`` (``--checkpoint``: its older name)."""
    parser.add_argument("--model", "--checkpoint", dest="model", default=None, metavar="MODEL",
                        help=f"{MODEL_HELP}; {default_note}")


def show_hub_logs() -> None:
    """The hub's progress and fallback lines on stderr, for a command that sets up no logging."""
    logger = logging.getLogger("streamvox.hub")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
