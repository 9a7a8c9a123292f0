"""The embedded default (SQLite) serves on a host without the PostgreSQL driver: asyncpg is
imported only when ``--jobs-db`` names a database (GPU images often lack it)."""

from __future__ import annotations

import json
import os
import time
import urllib.request

from conftest import REPO, ServerProcess


def test_sqlite_default_serves_jobs_without_asyncpg(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "asyncpg.py").write_text('raise ImportError("asyncpg is not installed on this host")\n')
    path = os.pathsep.join([str(blocked), str(REPO), os.environ.get("PYTHONPATH", "")])
    server = ServerProcess(tmp_path / "data", env={"PYTHONPATH": path})
    try:
        url = server.wait_listening()
        request = urllib.request.Request(url + "/v1/jobs", data=json.dumps({"input": "Hello there."}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 202
            job = json.load(response)
        deadline = time.monotonic() + 120
        while True:
            with urllib.request.urlopen(f"{url}/v1/jobs/{job['id']}", timeout=30) as response:
                status = json.load(response)["status"]
            if status not in ("queued", "running") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status == "succeeded", status
    finally:
        server.terminate()
        server.wait_exit()
    assert "asyncpg" not in server.log
