"""The import contracts of pyproject.toml ([tool.importlinter]) hold, and each one can fail.

``lint-imports`` passes on the tree (.ci/run runs the same command). Then, for every contract, a
scratch copy of the packages gets one import across it (an existing module made to import what
the contract forbids, or a module no layer names) and ``lint-imports --contract ID`` must report
that contract broken by exactly that import: a contract that nothing could break would pass here
for nothing. The cases for ``engine-layers`` include the imports the three contracts it replaced
forbade (models, checkpoints and runtime importing no pipelines, core or composition root). And
what clients and service import from engines is never a private (``_``) name.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"  # installed by the test extra
PACKAGES = ("engines", "service", "clients")


def lint(cwd: Path, *contracts: str) -> subprocess.CompletedProcess:
    assert LINT.is_file(), f"{LINT} not found: pip install -e '.[test]' (import-linter)"
    only = [arg for contract in contracts for arg in ("--contract", contract)]
    # PYTHONPATH: the packages under cwd, never another checkout's
    return subprocess.run([str(LINT), "--no-cache", "--no-logo", *only], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(cwd)})


def test_import_contracts_are_kept():
    run = lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


# (contract id, {module: line added (a new module when there is none)}, the import or module that must
# be reported)
CROSSINGS = [
    ("layers", {"engines/hardware/devices.py": "import service.errors"}, "engines.hardware.devices -> service.errors"),
    ("service-engines", {"service/ws/utterances.py": "import engines.core.scheduler"},
     "service.ws.utterances -> engines.core.scheduler"),
    ("service-engines", {"service/app.py": "import engines.build"},  # the composition root: the server's alone
     "service.app -> engines.build"),
    ("service-engines", {"engines/future/__init__.py": "", "service/rest/speech.py": "import engines.future"},
     "service.rest.speech -> engines.future"),  # an allow-list: a new engines package is private
    ("service-engines", {"service/app.py": "import engines.pipelines.registry"},  # no pipeline reaches the service
     "service.app -> engines.pipelines.registry"),
    ("service-layers", {"service/synthesis/submit.py": "import service.ws.core"},  # a back-arrow
     "service.synthesis.submit -> service.ws.core"),
    ("service-layers", {"service/voices/clones.py": "import service.http.body"},  # siblings independent
     "service.voices.clones -> service.http.body"),
    ("service-layers", {"service/speech.py": "import service.rest.speech"},  # a route stands on the service
     "service.speech -> service.rest.speech"),
    ("service-layers", {"service/unplaced.py": ""}, "service.unplaced"),  # exhaustive: every module has a layer
    ("acyclic", {"engines/core/aligning.py": "import engines.core.worker"}, "No cycles are allowed in engines.core"),
    ("export-facade", {"engines/export/manifest.py": "import engines.export"},
     "engines.export.manifest -> engines.export"),
    ("pipeline-folders", {"engines/core/engine.py": "import engines.pipelines.dit.weights"},  # the facade
     "engines.core.engine -> engines.pipelines.dit.weights"),
    ("pipeline-folders", {"engines/build.py": "import engines.pipelines.talker.reference"},  # the composition root
     "engines.build -> engines.pipelines.talker.reference"),
    ("engine-layers", {"engines/models/layers.py": "import engines.core.worker"},  # was the "models" contract
     "engines.models.layers -> engines.core.worker"),
    ("engine-layers", {"engines/checkpoints/files.py": "import engines.pipelines.base"},  # was "checkpoints"
     "engines.checkpoints.files -> engines.pipelines.base"),
    ("engine-layers", {"engines/runtime/cuda_graphs.py": "import engines.build"},  # was "runtime"
     "engines.runtime.cuda_graphs -> engines.build"),
    ("engine-layers", {"engines/text/sentences.py": "import engines.models.text"},  # the shared text module: a leaf
     "engines.text.sentences -> engines.models.text"),
    ("engine-layers", {"engines/unplaced.py": ""}, "engines.unplaced"),  # exhaustive
]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The packages and the contracts, copied once; each case works on its own copy of this."""
    root = tmp_path_factory.mktemp("contracts")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def test_every_contract_has_a_crossing():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert {c["id"] for c in contracts} == {case[0] for case in CROSSINGS}


@pytest.mark.parametrize("contract, edits, reported", CROSSINGS, ids=[f"{c[0]}:{next(iter(c[1]))}" for c in CROSSINGS])
def test_an_import_across_the_contract_breaks_it(pristine, tmp_path, contract, edits, reported):
    scratch = tmp_path / "tree"
    shutil.copytree(pristine, scratch)
    for module, line in edits.items():
        path = scratch / module
        path.parent.mkdir(exist_ok=True)
        path.write_text((path.read_text() if path.exists() else "") + f"\n{line}\n")
    run = lint(scratch, contract)
    assert run.returncode == 1 and "BROKEN" in run.stdout, f"{contract} kept despite {edits}\n{run.stdout}"
    assert reported in run.stdout, run.stdout


def test_nothing_outside_engines_imports_a_private_name_of_it():
    """What clients and service take from engines is public: no ``from engines.x import _name``
    (import-linter checks modules, not the names imported from them)."""
    import grimp

    graph = grimp.build_graph(*PACKAGES)
    private = []
    for importer in sorted(m for m in graph.modules if not m.startswith("engines")):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if imported.startswith("engines"):
                for detail in graph.get_import_details(importer=importer, imported=imported):
                    names = re.sub(r"^from\s+\S+\s+import\s+|[()]", "", detail["line_contents"])
                    if any(name.strip().split(" as ")[0].startswith("_") for name in names.split(",")):
                        private.append(f"{importer}:{detail['line_number']}: {detail['line_contents']}")
    assert not private, "\n".join(private)
