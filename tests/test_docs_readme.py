"""README as printed works on what it says to install, with the SDKs as installed:

* the 30-second tour (scripts/readme-tour.sh runs it after README command 1) imports only what
  command 1 installs (`pip install -e .`: the project's dependencies and theirs), what the tour
  itself installs before it, or the standard library (all a bare `python3` has);
* no doc sends a user to an extra for what is a dependency of streamvox already;
* the README's Python snippets, run against a live server with the installed SDKs (the
  voice-agent ones under .venv-agents), raise no deprecation warning at a README line.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata as metadata
import json
import os
import re
import shlex
import sys
import tomllib

from agents_helpers import AGENTS_PYTHON, needs_agents
from conftest import REPO, start_server
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

README = (REPO / "README.md").read_text()
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
PYTHON_CALLS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}


def section(title: str) -> tuple[str, int]:
    """A README section's text (up to the next ``## ``) and the line it starts on."""
    start = README.index(f"\n## {title}\n") + 1
    end = README.find("\n## ", start)
    return README[start:end if end >= 0 else None], README.count("\n", 0, start)


def code_blocks(text: str, first_line: int = 0) -> list[tuple[str, str, int]]:
    """(language, code, README line of the code's first line) of each ```bash / ```python block."""
    blocks = []
    for match in re.finditer(r"^```(bash|python)\n(.*?)^```", text, re.S | re.M):
        blocks.append((match.group(1), match.group(2), first_line + text.count("\n", 0, match.start(2))))
    return blocks


def with_dependencies(requirements: list[str]) -> set[str]:
    """The distributions ``pip install`` of ``requirements`` brings, followed through the installed
    packages' own requirements (extras only where asked for)."""
    found: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        for wanted in ("", *requirement.extras):
            if (name, wanted) in found:
                continue
            found.add((name, wanted))
            try:
                todo += [(Requirement(r), wanted) for r in metadata.requires(requirement.name) or []]
            except metadata.PackageNotFoundError:
                pass
    return {name for name, _ in found}


def imports(code: str) -> set[str]:
    """The top-level modules ``code`` imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def bash_commands(block: str) -> list[list[str]]:
    """A bash block's simple commands, as the shell splits them (comments dropped)."""
    lexer = shlex.shlex(block, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, current = [], []
    for token in lexer:
        if token in ("|", "||", "&&", ";", "(", ")", "$("):
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [command for command in commands + [current] if command]


def test_the_tour_runs_on_what_command_1_installs():
    distributions = metadata.packages_distributions()
    installed = with_dependencies(PROJECT["dependencies"])  # command 1: pip install -e .
    tour, first_line = section("30-second tour")
    problems = []
    for language, code, line in code_blocks(tour, first_line):
        if language == "python":  # the tour runs these with .venv/bin/python
            snippets = [(code, False)]
        else:
            snippets = []
            for command in bash_commands(code):
                program = command[0].rsplit("/", 1)[-1] if command[0].startswith(".venv/") else command[0]
                if program == "pip" and command[1:2] == ["install"]:
                    installed |= with_dependencies([arg for arg in command[2:] if not arg.startswith("-")])
                if command[0] in PYTHON_CALLS and "-c" in command:  # a bare python3 has the standard library alone
                    snippets.append((command[command.index("-c") + 1], not command[0].startswith(".venv/")))
        for snippet, bare in snippets:
            for module in sorted(imports(snippet) - set(sys.stdlib_module_names)):
                owners = {canonicalize_name(d) for d in distributions.get(module, [])}
                if bare or not owners & installed:
                    problems.append(f"README.md:{line}: `import {module}` ({', '.join(sorted(owners)) or '?'}) "
                                    + ("in a bare python3" if bare else "is not installed by command 1 "
                                                                          "or by the tour before it"))
    assert not problems, "\n".join(problems)


def test_no_doc_sends_a_user_to_an_extra_for_a_dependency():
    """A paragraph that names an extra (`'.[onnx]'`, `streamvox[onnx]`, the `onnx` extra) names
    what only the extra brings (onnxscript), not only what streamvox has anyway (onnx, onnxruntime)."""
    core = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    own = {extra: {canonicalize_name(Requirement(r).name) for r in requirements} - core
           for extra, requirements in PROJECT["optional-dependencies"].items()}
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    sources = [path for top in ("clients", "service", "engines") for path in sorted((REPO / top).rglob("*.py"))]
    problems = []
    for path in docs + sources:
        text = path.read_text()
        pieces = re.split(r"\n\s*\n", text) if path.suffix == ".md" else text.splitlines()
        for piece in pieces:
            for extra, packages in own.items():
                named = re.search(rf"\[{extra}\]|`{extra}` extra\b", piece)
                if named and not any(re.search(rf"\b{re.escape(p)}\b", piece, re.I) for p in packages):
                    problems.append(f"{path.relative_to(REPO)}: sends to the `{extra}` extra without naming what "
                                    f"only it brings ({', '.join(sorted(packages))}): {' '.join(piece.split())[:160]}")
    assert not problems, "\n".join(problems)


# Runs one README snippet (stdin) the way a reader runs it, recording the warnings raised at its
# lines (the code is compiled as README.md, at its line numbers). --in-loop: inside a running
# event loop with an aiohttp session, as a voice agent constructs its services.
RUNNER = r"""
import asyncio, json, sys, warnings
code = sys.stdin.read()
def run(names):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(code, "README.md", "exec"), {"__name__": "__main__", **names})
    return [f"README.md:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught if w.filename == "README.md"
            and issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning))]
async def in_loop():
    import aiohttp
    async with aiohttp.ClientSession() as session:
        return run({"KEY": "unused", "session": session})
print(json.dumps(asyncio.run(in_loop()) if "--in-loop" in sys.argv else run({})))
"""


def readme_snippets() -> list[tuple[str, str, int, bool]]:
    """(section, code, first line, agents) of every Python block the README asks a reader to run."""
    snippets = []
    for title, agents in (("30-second tour", False), ("Voice agents: Pipecat and LiveKit", True)):
        text, first_line = section(title)
        snippets += [(title, code, line, agents) for language, code, line in code_blocks(text, first_line)
                     if language == "python"]
    return snippets


@needs_agents
async def test_the_readme_python_snippets_raise_no_deprecation_warning(engine, tmp_path):
    snippets = readme_snippets()
    assert {title for title, *_ in snippets} == {"30-second tour", "Voice agents: Pipecat and LiveKit"}
    live = await start_server(engine, tmp_path / "data")
    warned = []
    try:
        for title, code, line, agents in snippets:
            python = AGENTS_PYTHON if agents else sys.executable
            source = "\n" * line + code.replace("127.0.0.1:8000", f"{live.host}:{live.port}")
            process = await asyncio.create_subprocess_exec(
                str(python), "-c", RUNNER, *(["--in-loop"] if agents else []), cwd=tmp_path,
                env={**os.environ, "PYTHONPATH": "", "LOGURU_LEVEL": "WARNING"}, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            stdout, stderr = await asyncio.wait_for(process.communicate(source.encode()), 300)
            assert process.returncode == 0, f"README.md:{line} ({title}) failed:\n{stderr.decode()[-3000:]}"
            warned += json.loads(stdout.decode().strip().splitlines()[-1])
    finally:
        await live.stop()
    assert not warned, "\n".join(warned)

