"""scripts/lib/venv.sh, the virtualenv and fixture-stamp functions every setup script sources:
run in bash against the project's own .venv and a throwaway fixture folder."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)  # the interpreter running this test is a virtualenv's (the project's .venv)


def bash(script: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    """Run ``script`` with the library sourced, under the same ``set -euo pipefail`` as the scripts."""
    full_env = {k: v for k, v in os.environ.items() if k != "ORACLE_FORCE"} | env
    prelude = f"set -euo pipefail\nLOG_TAG=test\nsource {REPO / 'scripts/lib/venv.sh'}\n"
    return subprocess.run(["bash", "-c", prelude + script], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=120)


def test_pins_match_only_the_installed_versions():
    pytest_version = md.version("pytest")
    ok = bash(f'venv_has_pins "{VENV}" "pytest=={pytest_version}" "numpy=={md.version("numpy")}"')
    assert ok.returncode == 0, ok.stderr
    # Extras are not part of the distribution's name.
    assert bash(f'venv_has_pins "{VENV}" "pytest[extra]=={pytest_version}"').returncode == 0
    assert bash(f'venv_has_pins "{VENV}" "pytest=={pytest_version}" "pytest==0.0.1"').returncode != 0
    assert bash(f'venv_has_pins "{VENV}" "no-such-distribution-streamvox==1.0"').returncode != 0


def test_venv_create_keeps_an_existing_venv(tmp_path):
    fake = tmp_path / "venv"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "python").symlink_to(sys.executable)
    proc = bash(f'venv_create "{fake}"; echo made')
    assert proc.returncode == 0 and proc.stdout.strip() == "made"  # nothing created, nothing said
    assert sorted(p.name for p in fake.iterdir()) == ["bin"]


def test_fixtures_are_written_once_per_script_content(tmp_path):
    script = tmp_path / "make.py"
    script.write_text("v1\n")
    out = tmp_path / "out"
    # The "builder" records each run; OUT comes as its last argument.
    builder = f'bash -c \'echo run >> "{tmp_path}/runs"; echo "$OMP_NUM_THREADS" > "$0/threads"\''
    build = (f'if fixtures_current "{out}" "{script}"; then echo current; '
             f'else fixtures_write "{out}" {builder}; echo written; fi')

    def runs() -> int:
        return len((tmp_path / "runs").read_text().split())

    first = bash(build)
    assert first.stdout.strip() == "written", first.stderr
    assert (out / "threads").read_text().strip() == "1"  # single-threaded unless the caller says otherwise
    assert bash(build).stdout.strip() == "current" and runs() == 1
    assert bash(build, ORACLE_FORCE="1").stdout.strip() == "written" and runs() == 2
    script.write_text("v2\n")
    assert bash(build).stdout.strip() == "written" and runs() == 3
    assert bash(build).stdout.strip() == "current" and runs() == 3


def test_a_failed_build_leaves_no_stamp(tmp_path):
    script = tmp_path / "make.py"
    script.write_text("v1\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("old")
    proc = bash(f'fixtures_current "{out}" "{script}" || fixtures_write "{out}" false; echo unreachable')
    assert proc.returncode != 0 and "unreachable" not in proc.stdout
    assert not (out / "STAMP").exists() and not (out / "stale").exists()
    # So the next run builds again instead of trusting a half-written folder.
    assert bash(f'fixtures_current "{out}" "{script}"').returncode != 0
