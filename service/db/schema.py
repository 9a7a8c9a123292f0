"""The stores' schema as one ordered list of versioned migrations, for both databases: the
embedded SQLite (jobs under ``--data-dir``: service/db/sqlite.py applies it) and the shared
PostgreSQL (jobs, their audio and saved voices: service/db/postgres.py applies it under an
advisory lock, so replicas starting together migrate once). Each database records the versions
it has in ``streamvox_schema``.

A step says what each dialect does at that version; "" where a dialect has nothing to do (the
embedded store keeps audio and saved voices as files, not rows). Append a step to change the
schema; never edit an applied one. SQLite steps are written so that a database made before
versions existed (it has some of their tables and columns already) adopts them: every CREATE
says IF NOT EXISTS, and service/db/sqlite.py skips an ADD COLUMN such a database has.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("streamvox.db")


@dataclass(frozen=True)
class Migration:
    version: int
    postgresql: str  # one script; "" when PostgreSQL has nothing to do at this version
    sqlite: str  # one script; "" when SQLite has nothing to do at this version


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer streamvox: this one must not write to it."""


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, postgresql="""
CREATE TABLE jobs (
    id text PRIMARY KEY,
    status text NOT NULL CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    params text NOT NULL,  -- JSON, kept as text: jsonb cannot hold a NUL character, which a request text may
    owner text,
    created_at double precision NOT NULL,
    started_at double precision,
    finished_at double precision,
    error text,
    frames_done integer NOT NULL DEFAULT 0,
    frames_total integer NOT NULL DEFAULT 0,
    audio_size bigint,
    attempts integer NOT NULL DEFAULT 0,
    lease_owner text,
    lease_token text,
    lease_expires timestamptz
);
CREATE INDEX jobs_queued ON jobs (created_at) WHERE status = 'queued';
CREATE INDEX jobs_leased ON jobs (lease_expires) WHERE status = 'running';
CREATE INDEX jobs_created ON jobs (created_at DESC);
CREATE INDEX jobs_unfinished_owner ON jobs (owner) WHERE status IN ('queued', 'running');
CREATE INDEX jobs_finished ON jobs (finished_at) WHERE status IN ('succeeded', 'failed', 'cancelled');
CREATE TABLE job_audio (
    job_id text NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    pos bigint NOT NULL,
    token text NOT NULL,
    data bytea NOT NULL,
    PRIMARY KEY (job_id, pos)
);
-- Saved voices: service/voices/store_postgres.py; tensors are a safetensors blob.
CREATE TABLE voices (
    name text PRIMARY KEY,
    meta text NOT NULL,  -- JSON (as params)
    tensors bytea NOT NULL,
    created_at double precision NOT NULL
);
""", sqlite="""
-- The jobs table as first released, and the columns it gained before versions existed.
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
    audio_file TEXT  -- the finished audio's name under audio/
);
CREATE INDEX IF NOT EXISTS jobs_status_created ON jobs (status, created_at);
ALTER TABLE jobs ADD COLUMN owner TEXT;
ALTER TABLE jobs ADD COLUMN audio_size INTEGER;
ALTER TABLE jobs ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN lease_owner TEXT;
ALTER TABLE jobs ADD COLUMN lease_token TEXT;
ALTER TABLE jobs ADD COLUMN lease_expires REAL;  -- seconds since the epoch (PostgreSQL: timestamptz)
"""),
    # Saved voices belong to the API key that uploaded them; names are unique per owner.
    # Voices saved before this have owner '' (unowned): with keys on only admin keys see them.
    # (The embedded store keeps voices as files: service/voices/store.py.)
    Migration(2, postgresql="""
ALTER TABLE voices ADD COLUMN owner text NOT NULL DEFAULT '';
ALTER TABLE voices DROP CONSTRAINT voices_pkey;
ALTER TABLE voices ADD PRIMARY KEY (owner, name);
CREATE INDEX voices_by_name ON voices (name, owner);
""", sqlite=""),
    # Word timestamps of a finished job (JSON text: [{word, start_ms, end_ms, char_start, char_end}]).
    Migration(3, postgresql="""
ALTER TABLE jobs ADD COLUMN words text;
""", sqlite="""
ALTER TABLE jobs ADD COLUMN words TEXT;
"""),
    # A long job's plan (service/synthesis/plan.py) and its finished segments (float32 PCM, word
    # times), kept while it runs so that an interrupted job resumes at the next one.
    Migration(4, postgresql="""
ALTER TABLE jobs ADD COLUMN plan_key text;
ALTER TABLE jobs ADD COLUMN utterances_total integer NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN utterances_done integer NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN audio_samples bigint NOT NULL DEFAULT 0;
CREATE TABLE job_segments (
    job_id text NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    idx integer NOT NULL,
    samples bigint NOT NULL,
    pcm bytea NOT NULL,
    words text,
    PRIMARY KEY (job_id, idx)
);
""", sqlite="""
ALTER TABLE jobs ADD COLUMN plan_key TEXT;
ALTER TABLE jobs ADD COLUMN utterances_total INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN utterances_done INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN audio_samples INTEGER NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS job_segments (
    job_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    pcm BLOB NOT NULL,
    words TEXT,
    PRIMARY KEY (job_id, idx)
);
"""),
    # Listing reads summaries, never a job's input: its response format gets a column (rows from
    # before keep NULL, and the list reads their params instead). Progress over the whole plan:
    # when the running attempt expects to end (``eta_at``, seconds since the epoch), and each kept
    # segment's codec frames. Segments from now on are int16 PCM (``s16``: half of float32, and the
    # samples the job's file holds); those kept before stay float32 (``f32``) until used.
    Migration(5, postgresql="""
ALTER TABLE jobs ADD COLUMN response_format text;
ALTER TABLE jobs ADD COLUMN eta_at double precision;
ALTER TABLE job_segments ADD COLUMN frames integer NOT NULL DEFAULT 0;
ALTER TABLE job_segments ADD COLUMN encoding text NOT NULL DEFAULT 'f32';
""", sqlite="""
ALTER TABLE jobs ADD COLUMN response_format TEXT;
ALTER TABLE jobs ADD COLUMN eta_at REAL;
ALTER TABLE job_segments ADD COLUMN frames INTEGER NOT NULL DEFAULT 0;
ALTER TABLE job_segments ADD COLUMN encoding TEXT NOT NULL DEFAULT 'f32';
"""),
)
SCHEMA_VERSION = MIGRATIONS[-1].version


def log_migration(store: str, before: int) -> None:
    """One line when a store's schema changed (not one per step): made new, or from which version."""
    if before == 0:
        log.info("%s: created at schema v%d", store, SCHEMA_VERSION)
    elif before < SCHEMA_VERSION:
        log.info("%s: schema migrated from v%d to v%d", store, before, SCHEMA_VERSION)


def pending(version: int) -> list[Migration]:
    """The steps a database at ``version`` (0: none yet) still needs, in order; SchemaTooNew
    when a newer streamvox migrated it."""
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(f"the job database has schema v{version}, newer than this streamvox "
                           f"(v{SCHEMA_VERSION}); upgrade streamvox")
    return [step for step in MIGRATIONS if step.version > version]
