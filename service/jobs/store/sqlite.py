"""The embedded job store: SQLite (WAL) and audio files under ``--data-dir``.

One replica owns the directory. Every database and file call runs on one thread of its own
(``_call``), so the event loop never waits on the disk and the SQLite connection is used by
one thread only. An attempt's audio grows in ``audio/.<id>.<token>.part`` and is fsynced and
renamed to ``audio/<id>.<ext>`` when the attempt's completion is recorded, so a crash never
leaves a half-written file under a finished job. Jobs found ``running`` at start-up were
interrupted (crash, ``kill -9``, shutdown) and go back to ``queued``.

The space a job keeps while it runs (kept segments in the database, its growing audio) is
given back when it ends: the database is in incremental auto-vacuum mode, so the pages its
segments freed are returned to the disk (``PRAGMA incremental_vacuum``), and the WAL is
checkpointed and truncated (``_reclaim``); a database made before is converted once, at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator

from service.db.sqlite import migrate
from service.jobs.store.base import (
    CANCELLED,
    FINISHED,
    KEPT_PROGRESS,
    LOST,
    RENEWED,
    SUMMARY_SELECT,
    Clock,
    Job,
    JobStore,
    Progress,
    Segment,
    job_from_record,
    kept_in_order,
    new_job_id,
    new_lease_token,
)

log = logging.getLogger("streamvox.jobs")

READ_BLOCK = 256 * 1024
DB_NAME = "jobs.sqlite3"
AUTO_VACUUM_INCREMENTAL = 2  # PRAGMA auto_vacuum's value for INCREMENTAL

class SqliteJobStore(JobStore):
    kind = "sqlite"
    shared = False

    def __init__(self, data_dir: Path, clock: Clock = time.time):
        super().__init__()
        self.lease_clock = clock  # when leases expire (a test passes a clock it advances)
        self.data_dir = Path(data_dir)
        self.audio_dir = self.data_dir / "audio"
        self._db: sqlite3.Connection | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="job-store")

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- lifecycle --------------------------------------------------------------------
    async def open(self) -> None:
        await self._call(self._open)

    def _open(self) -> None:
        self.audio_dir.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.data_dir / DB_NAME, isolation_level=None, check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")  # a new database: set before its first table
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        try:
            migrate(db)  # service/db/schema.py: the versions both stores share
            if db.execute("PRAGMA auto_vacuum").fetchone()[0] != AUTO_VACUUM_INCREMENTAL:
                # made before: the mode takes one VACUUM (which also returns the pages it kept free)
                log.info("job store: %s converted to incremental auto-vacuum (one VACUUM)", DB_NAME)
                db.execute("VACUUM")
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except BaseException:
            db.close()
            raise
        self._db = db

    async def close(self) -> None:
        if self._db is not None:
            await self._call(self._db.close)
            self._db = None
        self._thread.shutdown(wait=True)

    async def ping(self) -> None:
        return None  # a local file: reachable while the process runs

    # -- records ----------------------------------------------------------------------
    def _job(self, row: sqlite3.Row) -> Job:
        return job_from_record(row)

    def _execute(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        return self._db.execute(sql, args)

    def _reclaim(self) -> None:
        """Give the space deleted rows held back to the disk: the free pages (incremental
        auto-vacuum; executescript steps the pragma to its end, execute would free one page) and
        the WAL (checkpointed, then truncated to nothing)."""
        self._db.executescript("PRAGMA incremental_vacuum; PRAGMA wal_checkpoint(TRUNCATE);")

    async def create(self, params: dict, owner: str | None = None, frames_total: int = 0,
                     utterances_total: int = 0) -> Job:
        job = Job(id=new_job_id(), status="queued", params=params, created_at=time.time(), owner=owner,
                  response_format=params.get("response_format", "wav"), frames_total=frames_total,
                  utterances_total=utterances_total)
        await self._call(self._execute, "INSERT INTO jobs (id, status, params, created_at, owner, response_format, "
                                        "frames_total, utterances_total) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (job.id, job.status, json.dumps(params), job.created_at, owner, job.response_format,
                          frames_total, utterances_total))
        self._notify("queued")
        return job

    async def get(self, job_id: str) -> Job | None:
        def get():
            row = self._execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return self._job(row) if row else None
        return await self._call(get)

    async def list(self, status=None, limit=100, owner=None, any_owner=True) -> list[Job]:
        where, args = [], []
        if status:
            where.append("status = ?")
            args.append(status)
        if not any_owner:
            where.append("owner IS ?")
            args.append(owner)
        clause = f"WHERE {' AND '.join(where)} " if where else ""

        def rows():
            return [self._job(row) for row in
                    self._execute(f"SELECT {SUMMARY_SELECT} FROM jobs {clause}ORDER BY created_at DESC LIMIT ?",
                                  (*args, limit))]
        return await self._call(rows)

    async def unfinished(self, owner=None, any_owner=True) -> int:
        if any_owner:
            sql, args = "SELECT COUNT(*) FROM jobs WHERE status IN ('queued', 'running')", ()
        else:
            sql, args = "SELECT COUNT(*) FROM jobs WHERE status IN ('queued', 'running') AND owner IS ?", (owner,)
        return await self._call(lambda: self._execute(sql, args).fetchone()[0])

    async def queued(self) -> int:
        return await self._call(lambda: self._execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued'").fetchone()[0])

    # -- claims and leases -------------------------------------------------------------------
    # Each change is one conditional statement on the store's only connection (one thread), so
    # it is atomic with any other: a job moves only from the state the caller saw.
    async def claim(self, worker: str, limit: int, lease_seconds: float) -> list[Job]:
        def claim():
            now = self.lease_clock()
            rows = self._execute("SELECT id, status FROM jobs WHERE status = 'queued' OR (status = 'running' AND "
                                 "lease_expires < ?) ORDER BY created_at LIMIT ?", (now, limit)).fetchall()
            claimed = []
            for row in rows:
                token = new_lease_token()
                cursor = self._execute(
                    "UPDATE jobs SET status = 'running', started_at = coalesce(started_at, ?), error = NULL, "
                    f"eta_at = NULL, {KEPT_PROGRESS}, attempts = attempts + 1, lease_owner = ?, lease_token = ?, "
                    "lease_expires = ? "
                    "WHERE id = ? AND (status = 'queued' OR (status = 'running' AND lease_expires < ?))",
                    (time.time(), worker, token, now + lease_seconds, row["id"], now))
                if cursor.rowcount == 1:
                    self._remove_parts(row["id"])
                    job = self._job(self._execute("SELECT * FROM jobs WHERE id = ?", (row["id"],)).fetchone())
                    job.taken_over = row["status"] == "running"
                    claimed.append(job)
            return claimed
        return await self._call(claim)

    async def renew(self, job_id, token, lease_seconds, progress: Progress | None = None) -> str:
        def renew():
            expires = self.lease_clock() + lease_seconds
            if progress is None:
                cursor = self._execute("UPDATE jobs SET lease_expires = ? WHERE id = ? AND lease_token = ? "
                                       "AND status = 'running'", (expires, job_id, token))
            else:
                cursor = self._execute(f"UPDATE jobs SET lease_expires = ?, {self._PROGRESS} "
                                       "WHERE id = ? AND lease_token = ? AND status = 'running'",
                                       (expires, *self._progress(progress), job_id, token))
            if cursor.rowcount == 1:
                return RENEWED
            row = self._execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return CANCELLED if row is not None and row["status"] == "cancelled" else LOST
        return await self._call(renew)

    _PROGRESS = "frames_done = ?, frames_total = ?, utterances_done = ?, utterances_total = ?, audio_samples = ?, eta_at = ?"

    @staticmethod
    def _progress(p: Progress) -> tuple:
        return p.frames_done, p.frames_total, p.utterances_done, p.utterances_total, p.audio_samples, p.eta_at

    def _holds(self, job_id: str, token: str) -> bool:
        row = self._execute("SELECT 1 FROM jobs WHERE id = ? AND lease_token = ? AND status = 'running'",
                            (job_id, token)).fetchone()
        return row is not None

    def _part(self, job_id: str, token: str) -> Path:
        return self.audio_dir / f".{job_id}.{token}.part"

    def _remove_part(self, job_id: str, token: str) -> None:
        with contextlib.suppress(OSError):  # the directory itself may be what failed
            self._part(job_id, token).unlink(missing_ok=True)

    def _remove_parts(self, job_id: str) -> None:
        for path in self.audio_dir.glob(f".{job_id}.*.part"):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    async def put_audio(self, job_id, token, offset, data) -> bool:
        def put():
            if not self._holds(job_id, token):
                return False
            part = self._part(job_id, token)
            with open(part, "r+b" if part.exists() else "wb") as handle:
                handle.seek(offset)
                handle.write(data)
            return True
        return await self._call(put)

    async def finish(self, job_id, token, status, error=None, audio_size=None) -> bool:
        assert status in FINISHED

        def finish():
            if not self._holds(job_id, token):
                self._remove_part(job_id, token)
                return False
            name = None
            if status == "succeeded":
                job = self._job(self._execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())
                name = f"{job_id}.{job.response_format}"
                part = self._part(job_id, token)
                with open(part, "r+b" if part.exists() else "wb") as handle:
                    handle.truncate(audio_size or 0)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(part, self.audio_dir / name)
            else:
                self._remove_part(job_id, token)
            cursor = self._execute("UPDATE jobs SET status = ?, finished_at = ?, error = ?, audio_file = ?, "
                                   "audio_size = ?, lease_expires = NULL, eta_at = NULL "
                                   "WHERE id = ? AND lease_token = ? AND status = 'running'",
                                   (status, time.time(), error, name, audio_size, job_id, token))
            if cursor.rowcount == 1:  # the kept segments served their purpose: their space goes back
                self._execute("DELETE FROM job_segments WHERE job_id = ?", (job_id,))
                self._reclaim()
            return cursor.rowcount == 1
        return await self._call(finish)

    # -- segments (a long job's finished utterances: resume) ---------------------------------------
    async def start_plan(self, job_id, token, plan, total) -> list[Segment]:
        def start():
            row = self._execute("SELECT plan_key FROM jobs WHERE id = ? AND lease_token = ? AND status = 'running'",
                                (job_id, token)).fetchone()
            if row is None:
                return []
            if row["plan_key"] != plan:
                self._execute("DELETE FROM job_segments WHERE job_id = ?", (job_id,))
            kept = kept_in_order(self._execute("SELECT idx, samples, words, frames FROM job_segments WHERE job_id = ? "
                                               "ORDER BY idx", (job_id,)).fetchall())
            self._execute("DELETE FROM job_segments WHERE job_id = ? AND idx >= ?", (job_id, len(kept)))
            self._execute("UPDATE jobs SET plan_key = ?, utterances_total = ?, utterances_done = ?, audio_samples = ?, "
                          "frames_done = ? WHERE id = ?", (plan, total, len(kept), sum(s.samples for s in kept),
                                                           sum(s.frames for s in kept), job_id))
            return kept
        return await self._call(start)

    async def put_segment(self, job_id, token, index, samples, frames, pcm, words, encoding, progress=None) -> bool:
        def put():
            if not self._holds(job_id, token):
                return False
            self._execute("INSERT OR REPLACE INTO job_segments (job_id, idx, samples, frames, pcm, words, encoding) "
                          "VALUES (?, ?, ?, ?, ?, ?, ?)", (job_id, index, samples, frames, pcm, words, encoding))
            if progress is None:
                self._execute(f"UPDATE jobs SET {KEPT_PROGRESS} WHERE id = ?", (job_id,))
            else:
                self._execute(f"UPDATE jobs SET {self._PROGRESS} WHERE id = ?", (*self._progress(progress), job_id))
            # into the database file at once: the WAL never holds a second copy of the segments
            self._execute("PRAGMA wal_checkpoint(TRUNCATE)")
            return True
        return await self._call(put)

    async def read_segment(self, job_id, index) -> tuple[bytes, str] | None:
        row = await self._call(lambda: self._execute("SELECT pcm, encoding FROM job_segments WHERE job_id = ? AND "
                                                     "idx = ?", (job_id, index)).fetchone())
        return (bytes(row["pcm"]), row["encoding"]) if row is not None else None

    async def put_words(self, job_id, token, words) -> bool:
        cursor = await self._call(self._execute, "UPDATE jobs SET words = ? WHERE id = ? AND lease_token = ? "
                                                 "AND status = 'running'", (words, job_id, token))
        return cursor.rowcount == 1

    async def get_words(self, job_id) -> str | None:
        row = await self._call(lambda: self._execute("SELECT words FROM jobs WHERE id = ?", (job_id,)).fetchone())
        return row["words"] if row is not None else None

    # A job given back to the queue keeps its first start and shows what its kept segments hold.
    _REQUEUE = f"status = 'queued', lease_owner = NULL, lease_token = NULL, lease_expires = NULL, eta_at = NULL, {KEPT_PROGRESS}"

    async def release(self, job_id, token) -> bool:
        def release():
            self._remove_part(job_id, token)
            cursor = self._execute(f"UPDATE jobs SET {self._REQUEUE} "
                                   "WHERE id = ? AND lease_token = ? AND status = 'running'", (job_id, token))
            return cursor.rowcount == 1
        released = await self._call(release)
        if released:
            self._notify("queued")
        return released

    async def cancel(self, job_id, error="cancelled by the client") -> bool:
        def cancel():
            cursor = self._execute("UPDATE jobs SET status = 'cancelled', finished_at = ?, error = ?, "
                                   "lease_owner = NULL, lease_expires = NULL "
                                   "WHERE id = ? AND status IN ('queued', 'running')", (time.time(), error, job_id))
            if cursor.rowcount == 1:
                self._remove_parts(job_id)
                self._execute("DELETE FROM job_segments WHERE job_id = ?", (job_id,))
                self._reclaim()
            return cursor.rowcount == 1
        cancelled = await self._call(cancel)
        if cancelled:
            self._notify("cancelled", job_id)
        return cancelled

    async def requeue_interrupted(self) -> int:
        cursor = await self._call(self._execute, f"UPDATE jobs SET {self._REQUEUE} WHERE status = 'running'")
        await self._call(lambda: [p.unlink(missing_ok=True) for p in self.audio_dir.glob(".*.part")])
        return cursor.rowcount

    # -- retention, quota, download ---------------------------------------------------------
    async def delete_finished_before(self, cutoff: float) -> int:
        def delete():
            rows = self._execute("SELECT id, audio_file FROM jobs WHERE status IN ('succeeded', 'failed', "
                                 "'cancelled') AND finished_at < ?", (cutoff,)).fetchall()
            for row in rows:
                if row["audio_file"]:
                    (self.audio_dir / row["audio_file"]).unlink(missing_ok=True)
                self._execute("DELETE FROM jobs WHERE id = ?", (row["id"],))
                self._execute("DELETE FROM job_segments WHERE job_id = ?", (row["id"],))
            if rows:
                self._reclaim()
            return len(rows)
        return await self._call(delete)

    def _audio_bytes(self) -> int:
        return sum(entry.stat().st_size for entry in os.scandir(self.audio_dir) if entry.is_file())

    async def audio_bytes(self) -> int:
        return await self._call(self._audio_bytes)

    async def stored_bytes(self) -> int:
        def size():
            database = 0
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    database += (self.data_dir / (DB_NAME + suffix)).stat().st_size
            return database + self._audio_bytes()
        return await self._call(size)

    def audio_path(self, job: Job) -> Path | None:
        return self.audio_dir / f"{job.id}.{job.response_format}" if job.status == "succeeded" else None

    async def read_audio(self, job: Job) -> AsyncIterator[bytes]:
        path = self.audio_path(job)
        if path is None:  # not succeeded: no audio
            return
        try:
            handle = await self._call(open, path, "rb")
        except OSError:
            return
        try:
            while block := await self._call(handle.read, READ_BLOCK):
                yield block
        finally:
            await self._call(handle.close)
