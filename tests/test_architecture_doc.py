"""docs/ARCHITECTURE.md is true of the tree: every file it names exists, and it names every module
and package of ``engines/`` and ``service/``.

Granularity: every module (``.py`` file) and every package, because the doc's two trees are "one
line per module": a reader looking for where something lives should find each file there, and a
module the doc does not name is one a new reader would not know is there (a package per line only
would let a package grow modules nobody has described). A package is named by its folder
(``virtual/``), which also covers its ``__init__.py``; every other module by its path: from its top
package (``models/layers.py``, ``ws/dialects/cartesia.py``) or from the repository root
(``engines/models/layers.py``); where the shorter path could mean a module of either top package,
only the full one counts. In prose a bare file name (``layers.py``) names nothing: too many repeat
(``talker.py``, ``routes.py``, ``base.py``). In a tree block a name stands under the folder lines
above it (``layers.py`` under ``models/`` under ``engines/``), one line may list several modules
(``talker.py, code_predictor.py``), and the modules a folder line's description names in passing
are that folder's (``store/  base, sqlite.py ...``).

A file the doc names (a token ending in ``.py``, ``.md``, ``.json`` ... or ``/``) must exist: from
the repository root, or, when written as a partial path (``talker/batch.py``), as the end of some
file's path in the repository.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "ARCHITECTURE.md"
TOPS = ("engines", "service")
# file names and folders as the doc writes them (``a/b.py``, ``a/b/``, ``docs/X.md``)
NAMED = re.compile(r"(?<![\w./*-])((?:[\w-]+/)*[\w-]+(?:\.(?:py|md|json|sh|toml|html|txt\.gz)|/))(?![\w/-])")


def repo_files() -> list[str]:
    """Tracked and untracked-but-not-ignored files: what a checkout of this tree has."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if (REPO / line).exists()]


def modules_and_packages() -> tuple[list[str], list[str]]:
    """-> (modules: engines/x/y.py, except __init__.py; packages: engines/x/), of both top packages."""
    files = [f for f in repo_files() if f.endswith(".py") and f.split("/")[0] in TOPS]
    packages = sorted({f.rsplit("/", 1)[0] + "/" for f in files if f.endswith("/__init__.py") and f.count("/") > 1})
    return sorted(f for f in files if not f.endswith("/__init__.py")), packages


def tree_entries(block: str) -> list[tuple[int, str, str]]:
    """A tree block's entries: (indent, names, description with its continuation lines). An entry's
    line starts with what it names (``core/``, ``engine.py``, ``app.py server.py``,
    ``talker.py, code_predictor.py``), then two spaces or more and what it does; a line that starts
    with anything else continues the entry above."""
    entries: list[tuple[int, str, str]] = []
    for line in block.splitlines():
        text = line.strip()
        names, description = (re.split(r"\s{2,}", text, maxsplit=1) + [""])[:2]
        if re.fullmatch(r"(?:[\w/]+(?:\.py|/)[, ]*)+", names):
            entries.append((len(line) - len(line.lstrip()), names, description))
        elif entries:
            indent, names, description = entries[-1]
            entries[-1] = (indent, names, description + " " + text)
    return entries


def names_in(doc: str) -> set[str]:
    """Every path the doc writes, and what its trees name: each entry's modules and folders under
    the folder entries above it; the files a folder's description names are that folder's
    (``access/  who may do what: API keys (auth.py)`` names ``access/auth.py``)."""
    names = set(NAMED.findall(doc))
    for block in re.findall(r"^```\n(.*?)^```", doc, re.S | re.M):
        folders: list[tuple[int, str]] = []  # the folder entries this one is under: (indent, path)
        for indent, entry, description in tree_entries(block):
            while folders and folders[-1][0] >= indent:
                folders.pop()
            parent = folders[-1][1] if folders else ""
            named = [parent + name for name in re.findall(r"[\w/]+(?:\.py|/)", entry)]
            names.update(named)
            inner = named[0] if len(named) == 1 and named[0].endswith("/") else parent
            names.update(inner + name for name in re.findall(r"(?<![\w/*])[\w/]+(?:\.py|/)(?![\w])", description))
            if len(named) == 1 and named[0].endswith("/"):
                folders.append((indent, named[0]))
    return names


def relative_forms(path: str) -> list[str]:
    """The ways the doc may name ``engines/a/b.py``: in full, or from its top package."""
    return [path, path.split("/", 1)[1]]


def test_every_module_and_package_of_engines_and_service_is_named():
    doc = DOC.read_text()
    names = names_in(doc)
    modules, packages = modules_and_packages()
    tails = [p.split("/", 1)[1] for p in modules + packages]
    missing = []
    for path in modules + packages:
        top, tail = path.split("/", 1)
        forms = [path] if tails.count(tail) > 1 else relative_forms(path)
        if not any(form in names for form in forms):
            folder, name = path.rstrip("/").rsplit("/", 1)
            missing.append(f"{path}: add the line `{name}{'/' if path.endswith('/') else ''}  <what it does>` "
                           f"under `{folder.split('/')[-1]}/` in the {top}/ tree")
    assert not missing, "docs/ARCHITECTURE.md does not name:\n  " + "\n  ".join(missing)


def test_every_file_the_doc_names_exists():
    doc = DOC.read_text()
    files = repo_files()
    folders = {f.rsplit("/", 1)[0] + "/" for f in files if "/" in f}
    folders |= {"/".join(f.split("/")[:i]) + "/" for f in files for i in range(1, f.count("/"))}
    everything = set(files) | folders
    unknown = []
    for name in sorted(set(NAMED.findall(doc))):
        if "/" not in name and not name.endswith(".py"):
            continue  # a bare file name that is not a module: a file some command writes (manifest.json)
        if name in everything or any(path.endswith("/" + name) for path in everything):
            continue
        unknown.append(name)
    assert not unknown, "docs/ARCHITECTURE.md names files the repository does not have: " + ", ".join(unknown)
