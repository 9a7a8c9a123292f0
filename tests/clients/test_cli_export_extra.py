"""`streamvox export` without the `onnx` extra: one line naming the extra, no traceback."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

# Runs the real CLI with the onnx package hidden, as in an environment installed without the extra.
WITHOUT_ONNX = """
import importlib.abc, sys
class HideOnnx(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "onnx" or name.startswith("onnx."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, HideOnnx())
from clients.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_export_without_the_onnx_extra_names_it(tmp_path):
    result = subprocess.run([sys.executable, "-c", WITHOUT_ONNX, "export", "--preset", "tiny", "--out", str(tmp_path / "onnx")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "streamvox export: needs the `onnx` extra (onnx not installed): pip install -e '.[onnx]'"]
    assert not (tmp_path / "onnx").exists()
