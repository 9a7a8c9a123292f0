"""The shared job store: PostgreSQL through asyncpg, so any replica serves any job.

* Connection pool and schema: :class:`service.db.postgres.Database` (shared with the saved
  voices, service/voices/store_postgres.py); the schema is service/db/schema.py.
* Jobs are claimed with ``SELECT ... FOR UPDATE SKIP LOCKED``: concurrent claims never wait
  on each other and never take the same job. A claim sets a lease (replica, token, expiry
  on the database's clock, so replicas' clocks do not matter; a test may pass a clock of its
  own, which then decides when leases expire).
* Audio is stored as ``bytea`` chunks (``job_audio``) while the job runs. A chunk write locks
  the job row ``FOR SHARE`` and checks the lease token, so it serialises with a claim (which
  deletes the old attempt's chunks): a stale replica's chunk can never land in a new attempt.
* Wake-ups: ``NOTIFY streamvox_jobs`` on a new or released job (``queued``) and on a cancel
  (``cancelled:<id>``), heard by one ``LISTEN`` connection per replica. The replica whose
  listening connection holds the advisory lock :data:`LEADER_LOCK` is the leader: it exports
  the shared queue depth (docs/DEPLOY.md says why one replica and not all).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

import asyncpg

from service.db.postgres import UNREACHABLE, Database
from service.errors import StoreUnavailable
from service.jobs.store.base import (
    AUDIO_READ_CHUNKS,
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
)
from service.voices.store import VoiceStore
from service.voices.store_postgres import PostgresVoiceStore

log = logging.getLogger("streamvox.jobs")

CHANNEL = "streamvox_jobs"
LEADER_LOCK = 0x5754_0018  # pg_try_advisory_lock key held by the leader's listening connection
PING_TIMEOUT_S = 2.0
_NOW = "extract(epoch from clock_timestamp())"


def _lease_now(param: int) -> str:
    """SQL for "now" in lease times: parameter ``$param`` (the injected clock's time) or, when it
    is NULL, the database's clock."""
    return f"coalesce(to_timestamp(${param}::double precision), clock_timestamp())"


def _text(value: str | None) -> str | None:
    """A message fit for a text column: PostgreSQL text cannot hold NUL (an error may quote input)."""
    return value.replace("\x00", "\ufffd") if value else value


def _job(row: asyncpg.Record) -> Job:
    return job_from_record(row, taken_over=bool(row.get("taken_over")))


class PostgresJobStore(JobStore):
    kind = "postgresql"
    shared = True

    def __init__(self, url: str, pool_size: int = 8, password: str | None = None, clock: Clock | None = None):
        super().__init__()
        self.lease_clock = clock  # None: the database's (replicas' clocks never decide a lease)
        self.db = Database(url, pool_size=pool_size, password=password)
        self._listen: asyncpg.Connection | None = None
        self._leader = False
        self._expiring: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return self.db.url

    def __repr__(self) -> str:
        return f"PostgresJobStore({self.db!r})"

    # -- lifecycle --------------------------------------------------------------------
    async def open(self) -> None:
        await self.db.open()
        await self.maintain()

    async def close(self) -> None:
        if self._listen is not None:
            self._listen.remove_termination_listener(self._on_listen_lost)
            await self._listen.close()  # also releases the leader lock
            self._listen = None
        await self.db.close()

    def connection(self):
        """A pooled connection (opening the store if needed); StoreUnavailable while unreachable."""
        return self.db.connection()

    def voice_store(self, data_dir) -> VoiceStore:
        return PostgresVoiceStore(self.db)

    async def ping(self) -> None:
        async with self.connection() as conn:
            await conn.fetchval("SELECT 1", timeout=PING_TIMEOUT_S)

    @property
    def leader(self) -> bool:
        return self._leader and self._listen is not None and not self._listen.is_closed()

    async def maintain(self) -> None:
        """(Re)open the listening connection and try for the leader lock; the runner calls this
        every poll. A listening connection that dies wakes the runner (it may have missed
        notifications) and drops the pool's other connections, which died with it."""
        if not self.db.is_open:
            await self.open()
            return
        if self._listen is None or self._listen.is_closed():
            self._leader = False
            conn = await self.db.connect()
            try:
                await conn.add_listener(CHANNEL, self._on_notification)
                conn.add_termination_listener(self._on_listen_lost)
            except UNREACHABLE as exc:
                raise StoreUnavailable(f"job database unreachable: {exc}") from None
            self._listen = conn
            self._notify("queued")  # anything queued while we were not listening
        if not self._leader:
            try:
                self._leader = await self._listen.fetchval("SELECT pg_try_advisory_lock($1)", LEADER_LOCK)
            except UNREACHABLE as exc:
                raise StoreUnavailable(f"job database unreachable: {exc}") from None

    def _on_notification(self, conn, pid, channel, payload: str) -> None:
        event, _, job_id = payload.partition(":")
        self._notify(event, job_id or None)

    def _on_listen_lost(self, conn) -> None:
        self._leader = False
        if self.db.is_open:  # they died with it; new ones are made on the next acquire
            self._expiring = asyncio.get_running_loop().create_task(self.db.expire_connections())
        self._notify("queued")

    # -- records ----------------------------------------------------------------------
    async def create(self, params: dict, owner: str | None = None, frames_total: int = 0,
                     utterances_total: int = 0) -> Job:
        async with self.connection() as conn, conn.transaction():
            row = await conn.fetchrow(f"INSERT INTO jobs (id, status, params, owner, created_at, response_format, "
                                      f"frames_total, utterances_total) VALUES ($1, 'queued', $2, $3, {_NOW}, $4, $5, $6) "
                                      "RETURNING *", new_job_id(), json.dumps(params), owner,
                                      params.get("response_format", "wav"), frames_total, utterances_total)
            await conn.execute("SELECT pg_notify($1, 'queued')", CHANNEL)
        return _job(row)

    async def get(self, job_id: str) -> Job | None:
        async with self.connection() as conn:
            row = await conn.fetchrow("SELECT * FROM jobs WHERE id = $1", job_id)
        return _job(row) if row else None

    async def list(self, status=None, limit=100, owner=None, any_owner=True) -> list[Job]:
        where, args = [], []
        if status:
            args.append(status)
            where.append(f"status = ${len(args)}")
        if not any_owner:
            args.append(owner)
            where.append(f"owner IS NOT DISTINCT FROM ${len(args)}")
        clause = f"WHERE {' AND '.join(where)} " if where else ""
        args.append(limit)
        async with self.connection() as conn:
            rows = await conn.fetch(f"SELECT {SUMMARY_SELECT} FROM jobs {clause}ORDER BY created_at DESC "
                                    f"LIMIT ${len(args)}", *args)
        return [_job(row) for row in rows]

    async def unfinished(self, owner=None, any_owner=True) -> int:
        async with self.connection() as conn:
            if any_owner:
                return await conn.fetchval("SELECT count(*) FROM jobs WHERE status IN ('queued', 'running')")
            return await conn.fetchval("SELECT count(*) FROM jobs WHERE status IN ('queued', 'running') "
                                       "AND owner IS NOT DISTINCT FROM $1", owner)

    async def queued(self) -> int:
        async with self.connection() as conn:
            return await conn.fetchval("SELECT count(*) FROM jobs WHERE status = 'queued'")

    # -- claims and leases -------------------------------------------------------------------
    def _lease_time(self) -> float | None:
        return None if self.lease_clock is None else self.lease_clock()

    async def claim(self, worker: str, limit: int, lease_seconds: float) -> list[Job]:
        async with self.connection() as conn, conn.transaction():
            rows = await conn.fetch(
                "WITH picked AS (SELECT id, status AS was FROM jobs WHERE status = 'queued' "
                f"    OR (status = 'running' AND lease_expires < {_lease_now(4)}) "
                "    ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED) "
                f"UPDATE jobs SET status = 'running', started_at = coalesce(started_at, {_NOW}), error = NULL, eta_at = NULL, "
                f"    {KEPT_PROGRESS}, "
                "    attempts = attempts + 1, lease_owner = $1, lease_token = md5(gen_random_uuid()::text), "
                f"    lease_expires = {_lease_now(4)} + make_interval(secs => $3) "
                "FROM picked WHERE jobs.id = picked.id RETURNING jobs.*, picked.was = 'running' AS taken_over",
                worker, limit, float(lease_seconds), self._lease_time())
            if rows:  # an earlier attempt's chunks (its replica died mid-job) are not this one's
                await conn.execute("DELETE FROM job_audio WHERE job_id = ANY($1::text[])", [row["id"] for row in rows])
        return sorted((_job(row) for row in rows), key=lambda job: job.created_at)

    async def renew(self, job_id, token, lease_seconds, progress: Progress | None = None) -> str:
        p = progress
        async with self.connection() as conn:
            # a NULL progress keeps each column as it is (coalesce); eta_at only moves with a progress
            renewed = await conn.fetchval(
                f"UPDATE jobs SET lease_expires = {_lease_now(4)} + make_interval(secs => $3), "
                "frames_done = coalesce($5, frames_done), frames_total = coalesce($6, frames_total), "
                "utterances_done = coalesce($7, utterances_done), utterances_total = coalesce($8, utterances_total), "
                "audio_samples = coalesce($9, audio_samples), eta_at = CASE WHEN $5::integer IS NULL THEN eta_at "
                "ELSE $10 END WHERE id = $1 AND lease_token = $2 AND status = 'running' RETURNING true",
                job_id, token, float(lease_seconds), self._lease_time(), *(
                    (None,) * 6 if p is None else (p.frames_done, p.frames_total, p.utterances_done,
                                                   p.utterances_total, p.audio_samples, p.eta_at)))
            if renewed:
                return RENEWED
            status = await conn.fetchval("SELECT status FROM jobs WHERE id = $1", job_id)
        return CANCELLED if status == "cancelled" else LOST

    async def put_audio(self, job_id, token, offset, data) -> bool:
        async with self.connection() as conn, conn.transaction():
            held = await conn.fetchval("SELECT true FROM jobs WHERE id = $1 AND lease_token = $2 "
                                       "AND status = 'running' FOR SHARE", job_id, token)
            if not held:
                return False
            await conn.execute("INSERT INTO job_audio (job_id, pos, token, data) VALUES ($1, $2, $3, $4) "
                               "ON CONFLICT (job_id, pos) DO UPDATE SET token = EXCLUDED.token, data = EXCLUDED.data",
                               job_id, offset, token, data)
        return True

    async def finish(self, job_id, token, status, error=None, audio_size=None) -> bool:
        assert status in FINISHED
        async with self.connection() as conn, conn.transaction():
            done = await conn.fetchval(
                f"UPDATE jobs SET status = $3, finished_at = {_NOW}, error = $4, audio_size = $5, "
                "lease_expires = NULL, eta_at = NULL WHERE id = $1 AND lease_token = $2 AND status = 'running' "
                "RETURNING true", job_id, token, status, _text(error), audio_size)
            if done and status != "succeeded":
                await conn.execute("DELETE FROM job_audio WHERE job_id = $1", job_id)
            if done:  # the kept segments served their purpose
                await conn.execute("DELETE FROM job_segments WHERE job_id = $1", job_id)
        return bool(done)

    # -- segments (a long job's finished utterances: resume) ---------------------------------------
    async def start_plan(self, job_id, token, plan, total) -> list[Segment]:
        async with self.connection() as conn, conn.transaction():
            key = await conn.fetchrow("SELECT plan_key FROM jobs WHERE id = $1 AND lease_token = $2 "
                                      "AND status = 'running' FOR UPDATE", job_id, token)
            if key is None:
                return []
            if key["plan_key"] != plan:
                await conn.execute("DELETE FROM job_segments WHERE job_id = $1", job_id)
            kept = kept_in_order(await conn.fetch("SELECT idx, samples, words, frames FROM job_segments "
                                                  "WHERE job_id = $1 ORDER BY idx", job_id))
            await conn.execute("DELETE FROM job_segments WHERE job_id = $1 AND idx >= $2", job_id, len(kept))
            await conn.execute("UPDATE jobs SET plan_key = $2, utterances_total = $3, utterances_done = $4, "
                               "audio_samples = $5, frames_done = $6 WHERE id = $1", job_id, plan, total, len(kept),
                               sum(s.samples for s in kept), sum(s.frames for s in kept))
        return kept

    async def put_segment(self, job_id, token, index, samples, frames, pcm, words, encoding, progress=None) -> bool:
        async with self.connection() as conn, conn.transaction():
            held = await conn.fetchval("SELECT true FROM jobs WHERE id = $1 AND lease_token = $2 "
                                       "AND status = 'running' FOR UPDATE", job_id, token)
            if not held:
                return False
            await conn.execute("INSERT INTO job_segments (job_id, idx, samples, frames, pcm, words, encoding) "
                               "VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (job_id, idx) DO UPDATE SET "
                               "samples = EXCLUDED.samples, frames = EXCLUDED.frames, pcm = EXCLUDED.pcm, "
                               "words = EXCLUDED.words, encoding = EXCLUDED.encoding",
                               job_id, index, samples, frames, pcm, _text(words), encoding)
            if progress is None:
                await conn.execute(f"UPDATE jobs SET {KEPT_PROGRESS} WHERE id = $1", job_id)
            else:
                p = progress
                await conn.execute("UPDATE jobs SET frames_done = $2, frames_total = $3, utterances_done = $4, "
                                   "utterances_total = $5, audio_samples = $6, eta_at = $7 WHERE id = $1", job_id,
                                   p.frames_done, p.frames_total, p.utterances_done, p.utterances_total,
                                   p.audio_samples, p.eta_at)
        return True

    async def read_segment(self, job_id, index) -> tuple[bytes, str] | None:
        async with self.connection() as conn:
            row = await conn.fetchrow("SELECT pcm, encoding FROM job_segments WHERE job_id = $1 AND idx = $2",
                                      job_id, index)
        return (bytes(row["pcm"]), row["encoding"]) if row is not None else None

    async def put_words(self, job_id, token, words) -> bool:
        async with self.connection() as conn:
            return bool(await conn.fetchval("UPDATE jobs SET words = $3 WHERE id = $1 AND lease_token = $2 "
                                            "AND status = 'running' RETURNING true", job_id, token, _text(words)))

    async def get_words(self, job_id) -> str | None:
        async with self.connection() as conn:
            return await conn.fetchval("SELECT words FROM jobs WHERE id = $1", job_id)

    async def release(self, job_id, token) -> bool:
        async with self.connection() as conn, conn.transaction():
            released = await conn.fetchval(
                "UPDATE jobs SET status = 'queued', lease_owner = NULL, lease_token = NULL, lease_expires = NULL, "
                f"eta_at = NULL, {KEPT_PROGRESS} "  # it keeps its first start
                "WHERE id = $1 AND lease_token = $2 AND status = 'running' RETURNING true", job_id, token)
            if released:
                await conn.execute("DELETE FROM job_audio WHERE job_id = $1", job_id)
                await conn.execute("SELECT pg_notify($1, 'queued')", CHANNEL)
        return bool(released)

    async def cancel(self, job_id, error="cancelled by the client") -> bool:
        async with self.connection() as conn, conn.transaction():
            cancelled = await conn.fetchval(
                f"UPDATE jobs SET status = 'cancelled', finished_at = {_NOW}, error = $2, lease_owner = NULL, "
                "lease_expires = NULL WHERE id = $1 AND status IN ('queued', 'running') RETURNING true", job_id, _text(error))
            if cancelled:
                await conn.execute("DELETE FROM job_audio WHERE job_id = $1", job_id)
                await conn.execute("DELETE FROM job_segments WHERE job_id = $1", job_id)
                await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, f"cancelled:{job_id}")
        return bool(cancelled)

    # -- moving in from the embedded store (service/jobs/store/copy.py) -----------------------------
    async def import_job(self, job: Job, audio: AsyncIterator[bytes], words: str | None = None) -> bool:
        """Insert a job made elsewhere, with its id, times, (succeeded) audio and word timestamps
        (``words``: checked JSON), in one transaction; False, nothing written, when a job with
        that id exists. One that was running is queued again (its runner is gone)."""
        status = "queued" if job.status == "running" else job.status
        async with self.connection() as conn, conn.transaction():
            added = await conn.fetchval(
                "INSERT INTO jobs (id, status, params, owner, created_at, started_at, finished_at, error, frames_done, "
                "frames_total, audio_size, attempts, utterances_total, utterances_done, audio_samples, words, "
                "response_format) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17) "
                "ON CONFLICT (id) DO NOTHING RETURNING true", job.id, status, json.dumps(job.params), job.owner, job.created_at,
                None if status == "queued" else job.started_at, job.finished_at, _text(job.error),
                0 if status == "queued" else job.frames_done, job.frames_total, job.audio_size, job.attempts,
                job.utterances_total, 0 if status == "queued" else job.utterances_done,
                0 if status == "queued" else job.audio_samples,  # a queued job's segments stay behind: it starts over
                _text(words) if status == "succeeded" else None, job.response_format)
            if not added:
                return False
            position = 0
            async for block in audio:
                await conn.execute("INSERT INTO job_audio (job_id, pos, token, data) VALUES ($1, $2, 'imported', $3)",
                                   job.id, position, block)
                position += len(block)
            if status == "succeeded" and job.audio_size is None:  # recorded before sizes were
                await conn.execute("UPDATE jobs SET audio_size = $2 WHERE id = $1", job.id, position)
            if status == "queued":
                await conn.execute("SELECT pg_notify($1, 'queued')", CHANNEL)
        return True

    # -- retention, quota, download ---------------------------------------------------------
    async def delete_finished_before(self, cutoff: float) -> int:
        async with self.connection() as conn:
            result = await conn.execute("DELETE FROM jobs WHERE status IN ('succeeded', 'failed', 'cancelled') "
                                        "AND finished_at < $1", cutoff)
        return int(result.split()[-1])

    async def audio_bytes(self) -> int:
        async with self.connection() as conn:  # octet_length reads a TOASTed value's size, not the value
            return await conn.fetchval("SELECT coalesce(sum(octet_length(data)), 0) FROM job_audio")

    async def stored_bytes(self) -> int:
        async with self.connection() as conn:  # the values the jobs keep: audio, segments, inputs, word times
            return await conn.fetchval(
                "SELECT (SELECT coalesce(sum(octet_length(data)), 0) FROM job_audio) "
                "+ (SELECT coalesce(sum(octet_length(pcm)), 0) FROM job_segments) "
                "+ (SELECT coalesce(sum(octet_length(params) + coalesce(octet_length(words), 0)), 0) FROM jobs)")

    async def read_audio(self, job: Job) -> AsyncIterator[bytes]:
        position = 0
        while True:  # a page of chunks per round trip; no connection is held between pages
            async with self.connection() as conn:
                rows = await conn.fetch("SELECT pos, data FROM job_audio WHERE job_id = $1 AND pos >= $2 "
                                        "ORDER BY pos LIMIT $3", job.id, position, AUDIO_READ_CHUNKS)
            for row in rows:
                if row["pos"] != position:  # a gap: never serve a file with a hole in it
                    raise StoreUnavailable(f"job {job.id}: audio chunk at {position} missing")
                yield bytes(row["data"])
                position += len(row["data"])
            if len(rows) < AUDIO_READ_CHUNKS:
                return
