"""scripts/lib/venv.sh, the virtualenv and fixture-stamp functions every setup script sources:
run in bash against the project's own .venv and a throwaway fixture folder."""

from __future__ import annotations

import hashlib
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


def fake_venv(root: Path) -> Path:
    """A folder whose bin/python is this interpreter: enough for the fixture functions."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(sys.executable)
    return root


def test_pins_match_only_the_installed_versions():
    pytest_version = md.version("pytest")
    ok = bash(f'venv_has_pins "{VENV}" "pytest=={pytest_version}" "numpy=={md.version("numpy")}"')
    assert ok.returncode == 0, ok.stderr
    # Extras are not part of the distribution's name.
    assert bash(f'venv_has_pins "{VENV}" "pytest[extra]=={pytest_version}"').returncode == 0
    assert bash(f'venv_has_pins "{VENV}" "pytest=={pytest_version}" "pytest==0.0.1"').returncode != 0
    assert bash(f'venv_has_pins "{VENV}" "no-such-distribution-streamvox==1.0"').returncode != 0


def test_venv_create_keeps_an_existing_venv(tmp_path):
    fake = fake_venv(tmp_path / "venv")
    proc = bash(f'venv_create "{fake}"; echo made')
    assert proc.returncode == 0 and proc.stdout.strip() == "made"  # nothing created, nothing said
    assert sorted(p.name for p in fake.iterdir()) == ["bin"]


def test_fixtures_are_written_once_per_script_content(tmp_path):
    venv = fake_venv(tmp_path / "venv")
    helper = tmp_path / "helper.py"
    helper.write_text("v1\n")
    # The builder (the last script) records each run and the thread setting it got; OUT is its argument.
    builder = tmp_path / "make.py"
    builder.write_text("import os, sys\n"
                       f"open({str(tmp_path / 'runs')!r}, 'a').write('run\\n')\n"
                       "open(os.path.join(sys.argv[1], 'threads'), 'w').write(os.environ['OMP_NUM_THREADS'])\n")
    out = tmp_path / "out"
    refresh = f'fixtures_refresh "{venv}" "{out}" "{helper}" "{builder}"'

    def runs() -> int:
        return len((tmp_path / "runs").read_text().split())

    first = bash(refresh)
    assert "fixtures written" in first.stdout, first.stderr
    assert (out / "threads").read_text() == "1"  # single-threaded unless the caller says otherwise
    stamp = hashlib.sha256(helper.read_bytes() + builder.read_bytes()).hexdigest()
    assert (out / "STAMP").read_text().strip() == stamp  # what tests/oracle/*fixtures.py compare against
    assert "up to date" in bash(refresh).stdout and runs() == 1
    assert "fixtures written" in bash(refresh, ORACLE_FORCE="1").stdout and runs() == 2
    helper.write_text("v2\n")  # a script the builder imports changed: stale
    assert "fixtures written" in bash(refresh).stdout and runs() == 3
    assert "up to date" in bash(refresh).stdout and runs() == 3


def test_a_failed_build_leaves_no_stamp(tmp_path):
    venv = fake_venv(tmp_path / "venv")
    builder = tmp_path / "make.py"
    builder.write_text("raise SystemExit('broken builder')\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("old")
    refresh = f'fixtures_refresh "{venv}" "{out}" "{builder}"'
    proc = bash(refresh + "; echo unreachable")
    assert proc.returncode != 0 and "unreachable" not in proc.stdout and "broken builder" in proc.stderr
    assert not (out / "STAMP").exists() and not (out / "stale").exists()
    builder.write_text("")  # fixed: the next run builds instead of trusting the half-written folder
    assert "fixtures written" in bash(refresh).stdout and (out / "STAMP").exists()
