"""`streamvox serve` on a port that is taken: one line naming the address, before any
model loads (no traceback, no minutes of loading first)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from conftest import REPO


def test_busy_port_is_one_line_before_the_models_load(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "clients.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--preset", "tiny",
             "--device", "cpu", "--data-dir", str(tmp_path)],
            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("streamvox serve:")]
    assert errors == [f"streamvox serve: cannot listen on 127.0.0.1:{port}: Address already in use "
                      "(another server is running there: stop it or pick --port)"]
    assert "loading the models" not in result.stderr  # refused before the load began
    assert "engine ready" not in result.stderr


def test_a_free_port_still_serves(tmp_path):
    """The reserved socket is the one the server listens on (no second bind)."""
    from conftest import ServerProcess

    server = ServerProcess(tmp_path)
    try:
        url = server.wait_listening()
        import urllib.request

        with urllib.request.urlopen(url + "/healthz", timeout=30) as response:
            assert response.status == 200
        assert server.log.index("loading the models") < server.log.index("listening on")
    finally:
        server.terminate()
        server.wait_exit()
