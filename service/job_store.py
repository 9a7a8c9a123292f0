"""Durable job records (SQLite in WAL mode) and job audio files in the data directory.

Audio is written to a temporary file, flushed and renamed, so a crash never leaves a
half-written file under a finished job. Jobs found ``running`` at start-up were
interrupted (crash, ``kill -9``, shutdown) and go back to ``queued``.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED = frozenset({"succeeded", "failed", "cancelled"})
UNFINISHED = ("queued", "running")
JOB_ID_RE = re.compile(r"[0-9a-f]{32}")  # always used with fullmatch: "$" would accept a trailing newline

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    params TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    error TEXT,
    frames_done INTEGER NOT NULL DEFAULT 0,
    frames_total INTEGER NOT NULL DEFAULT 0,
    audio_file TEXT,
    owner TEXT
);
CREATE INDEX IF NOT EXISTS jobs_status_created ON jobs (status, created_at);
"""


@dataclass
class Job:
    id: str
    status: str
    params: dict
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    frames_done: int = 0
    frames_total: int = 0
    audio_file: str | None = None
    owner: str | None = None  # digest of the API key that made it; None with auth off

    @property
    def response_format(self) -> str:
        return self.params.get("response_format", "wav")

    def to_json(self) -> dict:
        body = {
            "id": self.id, "status": self.status,
            "progress": {"frames_done": self.frames_done, "frames_total": self.frames_total},
            "created_at": self.created_at, "started_at": self.started_at, "finished_at": self.finished_at,
            "response_format": self.response_format,
        }
        if self.error:
            body["error"] = self.error
        if self.status == "succeeded":
            body["audio_url"] = f"/v1/jobs/{self.id}/audio"
        return body


def new_job_id() -> str:
    return uuid.uuid4().hex


class JobStore:
    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.audio_dir = self.data_dir / "audio"
        self.audio_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.data_dir / "jobs.sqlite3", isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row["name"] for row in self._db.execute("PRAGMA table_info(jobs)")}
        if "owner" not in columns:  # a database made before jobs had owners
            self._db.execute("ALTER TABLE jobs ADD COLUMN owner TEXT")

    def close(self) -> None:
        self._db.close()

    # -- records -----------------------------------------------------------------
    def _job(self, row: sqlite3.Row) -> Job:
        return Job(id=row["id"], status=row["status"], params=json.loads(row["params"]), created_at=row["created_at"],
                   started_at=row["started_at"], finished_at=row["finished_at"], error=row["error"],
                   frames_done=row["frames_done"], frames_total=row["frames_total"], audio_file=row["audio_file"],
                   owner=row["owner"])

    def create(self, params: dict, owner: str | None = None) -> Job:
        job = Job(id=new_job_id(), status="queued", params=params, created_at=time.time(), owner=owner)
        self._db.execute("INSERT INTO jobs (id, status, params, created_at, owner) VALUES (?, ?, ?, ?, ?)",
                         (job.id, job.status, json.dumps(params), job.created_at, owner))
        return job

    def get(self, job_id: str) -> Job | None:
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return self._job(row) if row else None

    def list(self, status: str | None = None, limit: int = 100, owner: str | None = None,
             any_owner: bool = True) -> list[Job]:
        """Newest first; with ``any_owner=False`` only the jobs of ``owner``."""
        where, args = [], []
        if status:
            where.append("status = ?")
            args.append(status)
        if not any_owner:
            where.append("owner IS ?")
            args.append(owner)
        clause = f"WHERE {' AND '.join(where)} " if where else ""
        rows = self._db.execute(f"SELECT * FROM jobs {clause}ORDER BY created_at DESC LIMIT ?", (*args, limit))
        return [self._job(row) for row in rows]

    def unfinished(self, owner: str | None = None, any_owner: bool = True) -> int:
        """How many jobs are queued or running (those of ``owner`` with ``any_owner=False``)."""
        if any_owner:
            row = self._db.execute("SELECT COUNT(*) FROM jobs WHERE status IN ('queued', 'running')").fetchone()
        else:
            row = self._db.execute("SELECT COUNT(*) FROM jobs WHERE status IN ('queued', 'running') AND owner IS ?",
                                   (owner,)).fetchone()
        return row[0]

    def oldest_queued(self, limit: int) -> list[Job]:
        rows = self._db.execute("SELECT * FROM jobs WHERE status = 'queued' ORDER BY created_at LIMIT ?", (limit,))
        return [self._job(row) for row in rows]

    # Every status change is one conditional UPDATE, so it is atomic with any other: a job
    # moves only from the status the caller saw, and the loser of a race learns it lost.
    def mark_running(self, job_id: str) -> bool:
        cursor = self._db.execute("UPDATE jobs SET status = 'running', started_at = ?, error = NULL "
                                  "WHERE id = ? AND status = 'queued'", (time.time(), job_id))
        return cursor.rowcount == 1

    def set_progress(self, job_id: str, frames_done: int, frames_total: int) -> None:
        self._db.execute("UPDATE jobs SET frames_done = ?, frames_total = ? WHERE id = ?",
                         (frames_done, frames_total, job_id))

    def finish(self, job_id: str, status: str, error: str | None = None, audio_file: str | None = None,
               from_statuses: tuple[str, ...] = ("running",)) -> bool:
        """Record the end of a job that is still in one of ``from_statuses``; False (nothing
        written) when it has already ended, e.g. cancelled while its audio was being written."""
        assert status in FINISHED
        marks = ", ".join("?" for _ in from_statuses)
        cursor = self._db.execute(f"UPDATE jobs SET status = ?, finished_at = ?, error = ?, audio_file = ? "
                                  f"WHERE id = ? AND status IN ({marks})",
                                  (status, time.time(), error, audio_file, job_id, *from_statuses))
        return cursor.rowcount == 1

    def cancel(self, job_id: str, error: str = "cancelled by the client") -> bool:
        """queued/running -> cancelled, atomically; False when the job had already ended."""
        return self.finish(job_id, "cancelled", error=error, from_statuses=UNFINISHED)

    def requeue(self, job_id: str) -> bool:
        cursor = self._db.execute("UPDATE jobs SET status = 'queued', started_at = NULL, frames_done = 0 "
                                  "WHERE id = ? AND status = 'running'", (job_id,))
        return cursor.rowcount == 1

    def requeue_interrupted(self) -> int:
        cursor = self._db.execute("UPDATE jobs SET status = 'queued', started_at = NULL, frames_done = 0 "
                                  "WHERE status = 'running'")
        return cursor.rowcount

    def delete_finished_before(self, cutoff: float) -> int:
        """Retention: drop finished jobs (records and audio) that finished before ``cutoff``."""
        rows = self._db.execute("SELECT id, audio_file FROM jobs WHERE status IN ('succeeded', 'failed', 'cancelled') "
                                "AND finished_at < ?", (cutoff,)).fetchall()
        for row in rows:
            if row["audio_file"]:
                (self.audio_dir / row["audio_file"]).unlink(missing_ok=True)
            self._db.execute("DELETE FROM jobs WHERE id = ?", (row["id"],))
        return len(rows)

    # -- audio files ---------------------------------------------------------------
    def audio_bytes(self) -> int:
        return sum(entry.stat().st_size for entry in os.scandir(self.audio_dir) if entry.is_file())

    def audio_path(self, job: Job) -> Path | None:
        return self.audio_dir / job.audio_file if job.audio_file else None

    def write_audio(self, job_id: str, extension: str, data: bytes) -> str:
        """Write atomically (temp file, fsync, rename); returns the file name. Blocking."""
        name = f"{job_id}.{extension}"
        final = self.audio_dir / name
        temp = self.audio_dir / f".{name}.tmp"
        try:
            with open(temp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        return name

    def discard_audio(self, name: str) -> None:
        (self.audio_dir / name).unlink(missing_ok=True)
