"""`streamvox export` where a package it needs is missing: one line naming the package and how to
get it (onnx comes with streamvox; onnxscript, for `--exporter dynamo`, with the `onnx` extra), no
traceback, nothing written."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

# Runs the real CLI with a package hidden, as in an environment installed without it.
HIDING = """
import importlib.abc, sys
HIDDEN = sys.argv.pop(1)
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == HIDDEN or name.startswith(HIDDEN + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
from clients.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("hidden, extra_args, line", [
    ("onnx", [], "streamvox export: onnx is missing, a dependency of streamvox: reinstall it (pip install -e .)"),
    ("onnxscript", ["--exporter", "dynamo"],
     "streamvox export: --exporter dynamo needs onnxscript, the `onnx` extra: pip install -e '.[onnx]'"),
])
def test_export_without_a_package_it_needs_names_it(hidden, extra_args, line, tmp_path):
    result = subprocess.run([sys.executable, "-c", HIDING, hidden, "export", "--preset", "tiny", *extra_args,
                             "--out", str(tmp_path / "onnx")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [line]
    assert not (tmp_path / "onnx").exists()
