"""The docs a user reads stay true to the code: every server flag and env var is documented."""

from __future__ import annotations

from pathlib import Path

from service.settings import _OPTIONS, ENV_API_KEYS

REPO = Path(__file__).resolve().parents[1]


def test_every_serve_flag_and_env_var_is_in_the_readme_table():
    readme = (REPO / "README.md").read_text()
    for flag, env, _, _ in _OPTIONS:
        assert f"`{flag}`" in readme, f"README configuration table lacks {flag}"
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
