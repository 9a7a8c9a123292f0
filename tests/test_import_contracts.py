"""The import contracts of pyproject.toml ([tool.importlinter]) hold: ``lint-imports`` passes.

service -> engines never back; engines.models / checkpoints / runtime import no pipelines,
core or composition root; no import cycles between sibling packages inside engines; the
export submodules never import the export facade back. .ci/run runs the same command.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"  # installed by the test extra
    assert lint.is_file(), f"{lint} not found: pip install -e '.[test]' (import-linter)"
    run = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout
