"""The docs a user reads stay true to the code: every server flag and env var is documented."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

from service.settings import ENV_API_KEYS, OPTIONS

REPO = Path(__file__).resolve().parents[1]


def test_every_serve_flag_and_env_var_is_in_the_readme_table():
    readme = (REPO / "README.md").read_text()
    for option in OPTIONS:
        for flag in (option.flag, *option.flag_aliases):
            assert f"`{flag}`" in readme, f"README configuration table lacks {flag}"
        for env in option.envs:
            assert f"`{env}`" in readme, f"README configuration table lacks {env}"
    assert ENV_API_KEYS in readme


def test_readme_keeps_exactly_two_setup_commands_at_the_top():
    readme = (REPO / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in first_block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2
    assert "streamvox serve" in commands[0] and "torch==2.13.0" in commands[0]
    assert "pytest" in commands[1]
    ci = (REPO / ".ci" / "run").read_text()
    assert "scripts/dev-setup.sh" in ci and "-m pytest" in ci  # CI runs the README's test command


def readme_code_blocks() -> list[str]:
    return re.findall(r"^\s*```bash\n(.*?)^\s*```", (REPO / "README.md").read_text(), re.S | re.M)


def test_readme_commands_are_runnable_as_printed():
    """One way to call the CLI (the `.venv/bin/streamvox` command 1 installs, not a `streamvox`
    that may not be on PATH), and curl fails on an HTTP error instead of saving the error
    body as the audio file. scripts/readme-tour.sh runs the tour itself (.ci/run)."""
    blocks = readme_code_blocks()
    assert len(blocks) >= 3  # setup, tour, cloning
    curls = 0
    for block in blocks:
        lexer = shlex.shlex(block, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        tokens = list(lexer)
        for i, token in enumerate(tokens):
            if token.endswith("streamvox") and i + 1 < len(tokens) and re.fullmatch(r"[a-z-]+", tokens[i + 1]):
                assert token == ".venv/bin/streamvox", (token, tokens[i + 1])
            if token == "curl":
                curls += 1
                args = []
                for arg in tokens[i + 1:]:
                    if arg in ("|", "||", "&&", ";", ")", "curl") or arg.endswith("streamvox"):
                        break
                    args.append(arg)
                assert "--fail" in args or any(re.fullmatch(r"-[a-zA-Z]*f[a-zA-Z]*", a) for a in args), args
    assert curls >= 2
    tour = (REPO / "README.md").read_text().split("## 30-second tour", 1)[1].split("\n## ", 1)[0]
    assert "llm-cli" not in tour and "JOB_ID --out" not in tour  # placeholders a reader cannot run


def test_the_package_license_is_an_spdx_expression():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"  # a table is deprecated (setuptools >= 77)
    assert any(req.startswith("setuptools>=") and int(req.split(">=")[1].split(".")[0]) >= 77
               for req in project["build-system"]["requires"])


def serve_flag_defaults() -> dict[str, str | None]:
    """Every flag ``streamvox serve --help`` shows, with the default its help states (None: none stated)."""
    from clients.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {}
    for action in serve._actions:
        if not action.option_strings or action.dest == "help":
            continue
        match = re.search(r"; default (.+?)\]$", action.help or "")
        flags[action.option_strings[0]] = match.group(1) if match else None
    return flags


def configuration_table(path: Path) -> dict[str, str]:
    """flag -> its default cell, from a markdown table whose rows start ``| `--flag` ... |``."""
    rows = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^\| `(--[a-z0-9-]+)`[^|]*\|[^|]*\| (.*) \|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def same_default(stated: str, cell: str) -> bool:
    """The doc's default (the cell's first `code`) is the one --help states: numbers by value, paths normalised."""
    first = re.match(r"`([^`]*)`", cell)
    if first is None:
        return False
    shown = first.group(1)
    try:
        return float(shown) == float(stated)
    except ValueError:
        return Path(shown) == Path(stated) if "/" in shown + stated else shown == stated


def test_every_serve_flag_is_in_both_configuration_tables_with_its_default():
    flags = serve_flag_defaults()
    assert len(flags) > 40 and "--voice-aliases" in flags
    for doc in ("README.md", "docs/API.md"):
        table = configuration_table(REPO / doc)
        missing = sorted(set(flags) - set(table))
        assert not missing, f"{doc}'s configuration table lacks {missing}"
        wrong = {flag: (stated, table[flag]) for flag, stated in flags.items()
                 if stated is not None and not same_default(stated, table[flag])}
        assert not wrong, f"{doc} states other defaults than serve --help: {wrong}"
        unknown = sorted(set(table) - set(flags))
        assert not unknown, f"{doc}'s configuration table names flags serve does not have: {unknown}"


def documented_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "scripts").glob("*.sh")),
            REPO / "benchmarks" / "RESULTS.md"]


# A path of this repository as docs write it: from one of its top folders, up to a space, a
# quote, a backtick or a bracket; a trailing dot or comma is the sentence's.
REPO_PATH = re.compile(r"(?<![\w./$-])((?:tests|scripts|service|engines|clients|benchmarks|docs|deploy|docker|\.ci)"
                       r"/[\w./*{},-]*[\w/*}])")


def path_exists(name: str) -> bool:
    """``name`` is a file or folder, a glob (``tests/test_*.py``; ``run{1,2}.log``: each) matching
    one, or ``module.attribute`` of a module (``engines/models/sampling.hash_keys``)."""
    braces = re.match(r"(.*)\{([^{}]*)\}(.*)", name)
    if braces:
        head, options, tail = braces.groups()
        return all(path_exists(head + option + tail) for option in options.split(","))
    if "*" in name:
        return any(REPO.glob(name))
    if (REPO / name).exists():
        return True
    module, _, attribute = name.rpartition(".")
    return bool(attribute) and "/" in module and (REPO / (module + ".py")).is_file()


def test_every_path_a_doc_names_exists():
    missing = []
    for doc in documented_files():
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for path in REPO_PATH.findall(line):
                name = path.split("::")[0]
                if not path_exists(name) and not name.startswith("tests/fixtures/"):
                    missing.append(f"{doc.relative_to(REPO)}:{number}: {name}")
    assert not missing, "docs name paths that do not exist:\n" + "\n".join(missing)


def test_every_flag_a_doc_names_exists():
    """A ``--flag`` named beside ``serve`` or in docs/API.md is one of serve's (or of another command)."""
    from clients.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    known = {flag for command in (parser, *commands.values()) for action in command._actions
             for flag in action.option_strings}
    api = (REPO / "docs" / "API.md").read_text()
    named = set(re.findall(r"`(--[a-z][a-z0-9-]+)`", api))
    assert not named - known, f"docs/API.md names flags no command has: {sorted(named - known)}"


def test_the_readme_names_every_venv_dev_setup_builds():
    script = (REPO / "scripts" / "dev-setup.sh").read_text()
    built = set(re.findall(r"^#\s+(\.venv[\w-]*)\s", script, re.M))
    assert {".venv", ".venv-oracle", ".venv-agents"} <= built
    tests = (REPO / "README.md").read_text().split("\n## Tests", 1)[1]
    named = set(re.findall(r"`(\.venv[\w-]*)`", tests))
    assert named == built, (named, built)
    words = {2: "two", 3: "three", 4: "four", 5: "five"}
    assert f"builds {words[len(built)]} virtualenvs" in " ".join(tests.split())
