"""The embedded default (SQLite) serves on a host without the PostgreSQL driver: asyncpg is
imported only when ``--jobs-db`` names a database (GPU images often lack it)."""

from __future__ import annotations

import os

import aiohttp
from conftest import REPO, ServerProcess, finished_job


async def test_sqlite_default_serves_jobs_without_asyncpg(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "asyncpg.py").write_text('raise ImportError("asyncpg is not installed on this host")\n')
    path = os.pathsep.join([str(blocked), str(REPO), os.environ.get("PYTHONPATH", "")])
    server = ServerProcess(tmp_path / "data", env={"PYTHONPATH": path})
    try:
        url = server.wait_listening()
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/jobs", json={"input": "Hello there."}) as response:
                assert response.status == 202
                job = await response.json()
            job = await finished_job(http, f"{url}/v1/jobs/{job['id']}")
        assert job["status"] == "succeeded", job
    finally:
        server.terminate()
        server.wait_exit()
    assert "asyncpg" not in server.log
