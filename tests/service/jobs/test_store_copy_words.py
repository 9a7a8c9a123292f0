"""`streamvox migrate-store` copies a job's word timestamps: captions that an embedded server
answers answer the same from PostgreSQL after the copy; stored words that are not a word list
skip their job with a reason (checked like the rest of the row). Real command, real PostgreSQL,
real servers on the tiny engine with the random aligner."""

from __future__ import annotations

import json
import sqlite3

import aiohttp
from conftest import start_server
from test_job_captions import finished_job
from test_store_copy import migrate

KEY = "alice-key-1"
HEADERS = {"Authorization": f"Bearer {KEY}"}


async def captions(http, url: str, job_id: str, fmt: str) -> tuple[int, str]:
    async with http.get(f"{url}/v1/jobs/{job_id}/captions?format={fmt}", headers=HEADERS) as response:
        return response.status, await response.text()


async def test_captions_survive_migrate_store(aligned_engine, tmp_path, pg_url):
    data_dir = tmp_path / "embedded"
    embedded = await start_server(aligned_engine, data_dir, api_keys=(KEY,))
    try:
        async with aiohttp.ClientSession() as http:
            job_id = await finished_job(http, embedded.url, KEY)
            crafted_id = await finished_job(http, embedded.url, KEY)
            before = {fmt: await captions(http, embedded.url, job_id, fmt) for fmt in ("json", "srt", "vtt")}
    finally:
        await embedded.stop()
    assert all(status == 200 for status, _ in before.values()) and json.loads(before["json"][1])["words"]
    db = sqlite3.connect(data_dir / "jobs.sqlite3")  # a row whose words are not a word list
    db.execute("UPDATE jobs SET words = ? WHERE id = ?",
               (json.dumps([{"word": "x", "start_ms": 5, "end_ms": 1, "char_start": 0, "char_end": 1}]), crafted_id))
    db.commit()
    db.close()

    code, out, err = await migrate(data_dir, pg_url)
    assert code == 0 and "jobs: 1 copied" in out and f"skipped job '{crafted_id}': words" in out, (out, err)

    shared = await start_server(aligned_engine, tmp_path / "replica", jobs_db=pg_url, job_workers=0,
                                api_keys=(KEY,))
    try:
        async with aiohttp.ClientSession() as http:
            after = {fmt: await captions(http, shared.url, job_id, fmt) for fmt in ("json", "srt", "vtt")}
    finally:
        await shared.stop()
    assert after == before
