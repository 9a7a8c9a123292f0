"""The shared database's schema, versioned in ``streamvox_schema``: every table the stores keep
there (jobs and their audio, saved voices). Applied at start-up by :class:`service.db.postgres.Database`
under an advisory lock, so replicas starting together migrate once."""

from __future__ import annotations

# (version, statements). Append a new entry to change the schema; never edit an applied one.
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, """
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
"""),
    # Saved voices belong to the API key that uploaded them; names are unique per owner.
    # Voices saved before this have owner '' (unowned): with keys on only admin keys see them.
    (2, """
ALTER TABLE voices ADD COLUMN owner text NOT NULL DEFAULT '';
ALTER TABLE voices DROP CONSTRAINT voices_pkey;
ALTER TABLE voices ADD PRIMARY KEY (owner, name);
CREATE INDEX voices_by_name ON voices (name, owner);
"""),
    # Word timestamps of a finished job (JSON text: [{word, start_ms, end_ms, char_start, char_end}]).
    (3, """
ALTER TABLE jobs ADD COLUMN words text;
"""),
    # A long job's plan (service/synthesis/plan.py) and its finished segments (float32 PCM, word
    # times), kept while it runs so that an interrupted job resumes at the next one.
    (4, """
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
"""),
)
SCHEMA_VERSION = MIGRATIONS[-1][0]
