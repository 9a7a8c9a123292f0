"""Running the voice-agent SDK clients (tests/agents_clients.py) under .venv-agents against a
live server, for the dialect tests of tests/service/ws/dialects/.

The SDKs live in their own virtualenv (.venv-agents, scripts/agents-env.sh, built by
scripts/dev-setup.sh) and run as subprocesses. Without that venv the tests fail under CI and
are skipped on a developer machine that has not built it (``needs_agents``)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from conftest import REPO

AGENTS_PYTHON = REPO / ".venv-agents" / "bin" / "python"
CLIENTS = REPO / "tests" / "agents_clients.py"
TEXT = "Hello there. How are you today? Fine, thanks."  # what agents_clients.PIECES joins to
KEY = "agent-key"

needs_agents = pytest.mark.skipif(not AGENTS_PYTHON.exists() and not os.environ.get("CI"),
                                  reason="run scripts/agents-env.sh to build .venv-agents (CI builds it)")


async def run_client(kind: str, base: str, cert: Path | None = None, voice: str | None = None) -> dict:
    """``python tests/agents_clients.py KIND BASE KEY [VOICE]`` under .venv-agents: its JSON line."""
    assert AGENTS_PYTHON.exists(), "build .venv-agents with scripts/agents-env.sh"
    env = {**os.environ, "PYTHONPATH": "", "LOGURU_LEVEL": "WARNING"}
    if cert is not None:
        env["SSL_CERT_FILE"] = str(cert)
    process = await asyncio.create_subprocess_exec(str(AGENTS_PYTHON), str(CLIENTS), kind, base, KEY,
                                                   *([voice] if voice else []), env=env,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), 300)
    except asyncio.TimeoutError:
        process.kill()
        raise
    assert process.returncode == 0, f"{kind} failed:\n{stderr.decode()[-3000:]}"
    return json.loads(stdout.decode().strip().splitlines()[-1])
