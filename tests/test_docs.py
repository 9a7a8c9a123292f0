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
