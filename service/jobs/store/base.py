"""The job store: job records, their leases, and their audio. One async interface, two backends.

* :class:`service.jobs.store.sqlite.SqliteJobStore` (the default): SQLite + audio files under
  ``--data-dir``, no server needed; one replica owns the directory. Its blocking calls run on
  one thread of their own, never on the event loop.
* :class:`service.jobs.store.postgres.PostgresJobStore` (``--jobs-db postgresql://...``): every
  replica talks to the same database, so any replica lists, serves and cancels any job.

A runner *claims* queued jobs into a lease (its replica id, a fresh token, an expiry) and
renews the lease while the job runs. Every write a runner makes about a job (progress, audio,
completion, release) names the lease token and is ignored once the token is no longer the
job's: a replica that lost its lease (it stalled, its node died and came back) can never
overwrite the work of the replica that took the job over, and a job is recorded
``succeeded`` exactly once. A job whose lease expired is claimable again by anyone.
"""

from __future__ import annotations

import abc
import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from engines.contract import SAMPLE_RATE
from service.synthesis.audio import CONTENT_TYPES
from service.voices.store import FileVoiceStore, VoiceStore

STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED = frozenset({"succeeded", "failed", "cancelled"})
JOB_ID_RE = re.compile(r"[0-9a-f]{32}")  # always used with fullmatch: "$" would accept a trailing newline
AUDIO_READ_CHUNKS = 16  # audio chunks fetched per round trip when a download is served


# GET /v1/jobs reads these columns: a job's summary, never its input (``params``, up to
# --max-job-chars) or its word times. A row from before ``response_format`` had a column has its
# params read instead (``legacy_params``; such rows age out with retention).
SUMMARY_COLUMNS = ("id", "status", "owner", "created_at", "started_at", "finished_at", "error", "frames_done",
                   "frames_total", "utterances_done", "utterances_total", "audio_samples", "audio_size", "attempts",
                   "response_format", "eta_at")
SUMMARY_SELECT = ", ".join(SUMMARY_COLUMNS) + ", CASE WHEN response_format IS NULL THEN params END AS legacy_params"


# SQL (either dialect) for an UPDATE of ``jobs``: the progress its kept segments hold. A job shows
# it when it goes back to the queue and when an attempt takes it, before it speaks again: the part
# an attempt was speaking when it stopped is spoken again.
KEPT_PROGRESS = ("frames_done = (SELECT coalesce(sum(frames), 0) FROM job_segments WHERE job_id = jobs.id), "
                 "audio_samples = (SELECT coalesce(sum(samples), 0) FROM job_segments WHERE job_id = jobs.id), "
                 "utterances_done = (SELECT count(*) FROM job_segments WHERE job_id = jobs.id)")


@dataclass(frozen=True)
class Progress:
    """A running job's progress over its whole plan (service/jobs/progress.py measures it)."""

    frames_done: int  # codec frames spoken, by every attempt (kept segments and this attempt's)
    frames_total: int  # the whole job's frames: spoken ones, and the plan's estimate of the rest
    utterances_done: int  # segments (utterances and pauses) finished
    utterances_total: int  # segments in its plan
    audio_samples: int  # audio made so far (24 kHz)
    eta_at: float | None = None  # when this attempt expects to end, at its pace so far (Unix seconds)


@dataclass
class Job:
    id: str
    status: str
    params: dict  # the request as stored; {} in a listing (a summary: service/jobs/store/base.py SUMMARY_COLUMNS)
    created_at: float
    started_at: float | None = None  # when its first attempt started (kept across attempts)
    finished_at: float | None = None
    error: str | None = None
    frames_done: int = 0
    frames_total: int = 0
    owner: str | None = None  # digest of the API key that made it (the address with auth off)
    audio_size: int | None = None  # bytes of the finished audio
    attempts: int = 0  # how many times a runner claimed it
    taken_over: bool = False  # this claim took it from a runner whose lease expired (not stored)
    lease_owner: str | None = None  # the replica running it
    lease_token: str | None = None  # this attempt's fence
    corrupt: str | None = None  # why the stored record cannot be used (see job_from_record); never run
    utterances_done: int = 0  # segments of its plan finished and kept (a restart resumes after them)
    utterances_total: int = 0  # segments its text is spoken in (utterances and pauses), planned at submit
    audio_samples: int = 0  # samples of audio made so far
    response_format: str = "wav"
    eta_at: float | None = None  # when the running attempt expects to end (Unix seconds)

    def percent(self) -> float:
        """How much of the job is done: its frames (its utterances when it plans none), 0-100;
        100 only once it has succeeded (a part that runs past its plan's estimate is not done)."""
        if self.status == "succeeded":
            return 100.0
        done, total = ((self.frames_done, self.frames_total) if self.frames_total
                       else (self.utterances_done, self.utterances_total))
        return round(min(99.9, 100.0 * done / total), 1) if total else 0.0

    def seconds_left(self, now: float) -> float | None:
        """The running attempt's estimate of the time to its end; None when it has none yet."""
        if self.status == "succeeded":
            return 0.0
        if self.status != "running" or self.eta_at is None:
            return None
        return round(max(0.0, self.eta_at - now), 1)

    def to_json(self, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        body = {
            "id": self.id, "status": "failed" if self.corrupt else self.status,
            "progress": {"frames_done": self.frames_done, "frames_total": self.frames_total,
                         "utterances_done": self.utterances_done, "utterances_total": self.utterances_total,
                         "audio_seconds": round(self.audio_samples / SAMPLE_RATE, 3),
                         "percent": self.percent(), "seconds_left": self.seconds_left(now)},
            "attempt": self.attempts,
            "created_at": self.created_at, "started_at": self.started_at, "finished_at": self.finished_at,
            "response_format": self.response_format,
        }
        if self.corrupt:
            body["error"] = f"corrupt job record: {self.corrupt}"
        elif self.error:
            body["error"] = self.error
        if self.status == "succeeded" and not self.corrupt:
            body["audio_url"] = f"/v1/jobs/{self.id}/audio"
        return body


def _number(value: Any, kind: type, default=None):
    """A stored number, or ValueError (SQLite keeps whatever a hostile file holds)."""
    if value is None:
        if default is None:
            return None
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number")
    if not math.isfinite(value):
        raise ValueError(f"{value!r} is not finite")
    return kind(value)


def _params(text: Any) -> dict:
    params = json.loads(text)
    if not isinstance(params, dict):
        raise ValueError(f"params are a JSON {type(params).__name__}, not an object")
    return params


def _response_format(value: Any) -> str:
    if value not in CONTENT_TYPES:
        raise ValueError(f"response_format {str(value)[:32]!r} is not one of {', '.join(CONTENT_TYPES)}")
    return value


def job_from_record(row, taken_over: bool = False) -> Job:
    """A stored row (SQLite or PostgreSQL) -> Job: a whole record, or a summary (the
    SUMMARY_SELECT columns: no params). Never raises on what a row holds: a record that does not
    parse (params not a JSON object, a response_format outside the fixed set, a status or number
    of the wrong kind) comes back with ``corrupt`` saying why; the API shows it as failed and the
    runner fails it instead of running it. (A summary checks the columns it has: params it does
    not read cannot be found corrupt there.)"""
    names = set(row.keys())

    def field(name):
        return row[name] if name in names else None

    job = Job(id=str(field("id")), status="failed", params={}, created_at=0.0, taken_over=taken_over)
    try:  # the lease first: a corrupt job is still failed under the lease its claim took
        for name in ("lease_owner", "lease_token", "owner", "error"):
            value = field(name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} is not text")
            setattr(job, name, value)
        job.status = field("status")
        if job.status not in STATUSES:
            raise ValueError(f"unknown status {str(job.status)[:32]!r}")
        job.created_at = _number(field("created_at"), float, 0.0)
        job.started_at = _number(field("started_at"), float)
        job.finished_at = _number(field("finished_at"), float)
        job.frames_done = _number(field("frames_done"), int, 0)
        job.frames_total = _number(field("frames_total"), int, 0)
        job.audio_size = _number(field("audio_size"), int)
        job.attempts = _number(field("attempts"), int, 0)
        job.utterances_done = _number(field("utterances_done"), int, 0)
        job.utterances_total = _number(field("utterances_total"), int, 0)
        job.audio_samples = _number(field("audio_samples"), int, 0)
        job.eta_at = _number(field("eta_at"), float)
        if "params" in names:  # a whole record
            job.params = _params(field("params"))
            stored = job.params.get("response_format", "wav")
        elif field("legacy_params") is not None:  # a summary of a row from before the column
            stored = _params(field("legacy_params")).get("response_format", "wav")
        else:
            stored = field("response_format") or "wav"
        job.response_format = _response_format(stored)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        job.corrupt = str(exc)[:200] or type(exc).__name__
    if not isinstance(job.status, str) or job.status not in STATUSES:
        job.status = "failed"
    return job


def new_job_id() -> str:
    return uuid.uuid4().hex


def new_lease_token() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Segment:
    """A finished segment of a job's plan (an utterance or a pause, service/synthesis/plan.py),
    kept while the job runs so that an interrupted job resumes after it."""

    index: int
    samples: int
    words: str | None = None  # JSON: its word times from its own start (words_json), when aligned
    frames: int = 0  # codec frames it took (0 for a pause, and for a segment kept before they were counted)


# A kept segment's PCM as segments were kept before they were int16 (``job_segments.encoding``;
# the int16 ones: service/jobs/segments.py).
SEGMENT_F32 = "f32"


def kept_in_order(rows) -> list[Segment]:
    """Stored segment rows (idx, samples, words, frames; by idx) -> the run of them from the
    first: a job resumes after the last segment before any gap."""
    kept: list[Segment] = []
    for row in rows:
        if row["idx"] != len(kept):
            break
        kept.append(Segment(int(row["idx"]), int(row["samples"]), row["words"], int(row["frames"])))
    return kept


# What a renewal finds: the lease is still ours, the job was cancelled, or the lease is gone
# (expired and taken by another replica, or the job deleted by retention).
RENEWED, CANCELLED, LOST = "renewed", "cancelled", "lost"

# Seconds since the epoch, now: what decides when a lease expires (a store's ``lease_clock``).
Clock = Callable[[], float]

# Wake-up events a store delivers to its listener: ("queued", None) when work may be
# claimable, ("cancelled", job_id) when a job was cancelled (on any replica).
Listener = Callable[[str, "str | None"], None]


class JobStore(abc.ABC):
    kind: str  # "sqlite" | "postgresql"
    shared: bool  # other replicas use the same store (claims may race; leases can expire under us)

    def __init__(self) -> None:
        self._listener: Listener | None = None

    def set_listener(self, listener: Listener) -> None:
        self._listener = listener

    def _notify(self, event: str, job_id: str | None = None) -> None:
        if self._listener is not None:
            self._listener(event, job_id)

    # -- lifecycle --------------------------------------------------------------------
    @abc.abstractmethod
    async def open(self) -> None:
        """Connect, create or migrate the schema. Raises StoreUnavailable when unreachable."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise StoreUnavailable unless the store answers now."""

    async def maintain(self) -> None:
        """Called by the runner every poll: reconnect what dropped (a shared store's listening
        connection, the leader lock). Raises StoreUnavailable while unreachable."""
        return None

    @property
    def leader(self) -> bool:
        """This replica exports the shared queue depth (one replica per store does)."""
        return True

    # -- records ----------------------------------------------------------------------
    @abc.abstractmethod
    async def create(self, params: dict, owner: str | None = None, frames_total: int = 0,
                     utterances_total: int = 0) -> Job:
        """A queued job; ``frames_total`` / ``utterances_total``: its plan (progress from the first poll)."""

    @abc.abstractmethod
    async def get(self, job_id: str) -> Job | None: ...

    @abc.abstractmethod
    async def list(self, status: str | None = None, limit: int = 100, owner: str | None = None,
                   any_owner: bool = True) -> list[Job]:
        """Summaries (SUMMARY_COLUMNS: no params, no word times), newest first; with
        ``any_owner=False`` only the jobs of ``owner``."""

    @abc.abstractmethod
    async def unfinished(self, owner: str | None = None, any_owner: bool = True) -> int:
        """How many jobs are queued or running (those of ``owner`` with ``any_owner=False``)."""

    @abc.abstractmethod
    async def queued(self) -> int:
        """Jobs waiting for a runner (the shared queue depth)."""

    # -- runner side: claims and leases -------------------------------------------------
    @abc.abstractmethod
    async def claim(self, worker: str, limit: int, lease_seconds: float) -> list[Job]:
        """Take up to ``limit`` jobs, oldest first, that are queued or whose lease expired:
        each becomes ``running`` under a new lease (``job.lease_token``), its old audio gone; its
        first attempt's ``started_at`` and its kept segments stay."""

    @abc.abstractmethod
    async def renew(self, job_id: str, token: str, lease_seconds: float, progress: Progress | None = None) -> str:
        """Extend the lease and record ``progress`` (when given): RENEWED, CANCELLED or LOST."""

    @abc.abstractmethod
    async def put_audio(self, job_id: str, token: str, offset: int, data: bytes) -> bool:
        """Store ``data`` at ``offset`` of the job's audio (a rewrite of an earlier chunk
        replaces it); False when the lease is no longer ours."""

    @abc.abstractmethod
    async def finish(self, job_id: str, token: str, status: str, error: str | None = None,
                     audio_size: int | None = None) -> bool:
        """Record the end of the attempt holding ``token``; False (nothing written) when the
        job is no longer that attempt's: cancelled, or taken over after the lease expired."""

    # -- segments: a long job's finished utterances, kept as they finish (resume) -----------------
    @abc.abstractmethod
    async def start_plan(self, job_id: str, token: str, plan: str, total: int) -> list[Segment]:
        """The attempt holding ``token`` speaks the job as ``total`` segments of plan ``plan`` (a
        digest of them): -> the segments an earlier attempt finished of that same plan, in order
        from the first (it resumes after them); those of another plan are dropped. Progress
        (frames and utterances done, audio) becomes theirs."""

    @abc.abstractmethod
    async def put_segment(self, job_id: str, token: str, index: int, samples: int, frames: int, pcm: bytes,
                          words: str | None, encoding: str, progress: Progress | None = None) -> bool:
        """Keep finished segment ``index`` (its PCM as ``encoding`` says: service/jobs/segments.py;
        the codec frames it took; its word times); False when the lease is no longer ours. The
        job's progress moves with it, in the same write: ``progress``, or (None) what its kept
        segments hold (KEPT_PROGRESS)."""

    @abc.abstractmethod
    async def read_segment(self, job_id: str, index: int) -> tuple[bytes, str] | None:
        """A kept segment's PCM and its encoding; None when it is not kept."""

    async def put_words(self, job_id: str, token: str, words: str) -> bool:
        """Store the word timestamps (JSON text) of the running attempt holding ``token``;
        False when the job is no longer that attempt's. Stores without them keep none."""
        return False

    async def get_words(self, job_id: str) -> str | None:
        """The stored word timestamps (JSON text), None when there are none."""
        return None

    @abc.abstractmethod
    async def release(self, job_id: str, token: str) -> bool:
        """Give the job back to the queue (shutdown): running -> queued, lease cleared."""

    @abc.abstractmethod
    async def cancel(self, job_id: str, error: str = "cancelled by the client") -> bool:
        """queued/running -> cancelled, atomically, wherever it runs; False when it had ended."""

    async def requeue_interrupted(self) -> int:
        """Start-up: jobs this store's only replica left running go back to queued. A shared
        store does nothing here: the leases of a dead replica expire instead."""
        return 0

    # -- retention, quota, download -------------------------------------------------------
    @abc.abstractmethod
    async def delete_finished_before(self, cutoff: float) -> int:
        """Retention: drop finished jobs (records and audio) that finished before ``cutoff``."""

    @abc.abstractmethod
    async def audio_bytes(self) -> int:
        """Bytes of job audio stored (finished and growing)."""

    @abc.abstractmethod
    async def stored_bytes(self) -> int:
        """Bytes of everything the jobs keep (``--jobs-disk-quota-mb``): their audio, kept
        segments and records (SQLite: the database and its WAL; PostgreSQL: the stored values)."""

    @abc.abstractmethod
    def read_audio(self, job: Job) -> AsyncIterator[bytes]:
        """The finished audio of a succeeded job, in order; nothing when it is gone."""

    # -- saved voices ---------------------------------------------------------------------------
    def voice_store(self, data_dir: Path) -> VoiceStore:
        """Where this store's replicas keep saved voices: files under ``data_dir`` (one replica),
        or the shared database's ``voices`` table."""
        return FileVoiceStore(data_dir / "voices")
