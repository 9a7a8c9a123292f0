"""Reading a ``--data-dir`` that may have been tampered with (``streamvox migrate-store``): every
record and file is hostile input until checked.

* The SQLite file is opened read-only and must be a regular file; each row is validated with a
  pydantic model (:class:`StoredJob`: id, status, times, params a JSON object whose
  ``response_format`` is one of the fixed formats, word timestamps a list of
  :class:`~service.synthesis.timestamps.StoredWord`). A row that fails is skipped, with the reason.
* Job audio is read only from ``audio/<id>.<format>`` as a regular file, opened without
  following links (``O_NOFOLLOW``), inside a real ``audio/`` directory (not a link).
* Saved voices: ``voices/`` and ``voices/owners/*/`` as real directories; each voice's JSON and
  safetensors files regular files, the JSON checked with :class:`StoredVoiceMeta`, the tensors'
  shapes and types checked. Anything else is skipped, with the reason.

Nothing here raises on what the directory holds: :class:`Skipped` entries say what was left
and why; :class:`UnreadableStore` means the store as a whole cannot be read (not SQLite).
"""

from __future__ import annotations

import errno
import json
import math
import os
import sqlite3
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from safetensors.numpy import load as load_tensors

from service.jobs.store.base import STATUSES, Job
from service.synthesis.audio import CONTENT_TYPES
from service.synthesis.timestamps import parse_words
from service.voices.store import NAME_PATTERN, OWNERS_DIR, SavedVoice, owner_dir_name

READ_BLOCK = 256 * 1024
MAX_VOICE_FILE_BYTES = 64 << 20  # a voice's tensors are a few hundred KB; beyond this it is not one
MAX_META_BYTES = 1 << 20
MAX_WORDS_JSON_CHARS = 64 << 20  # a job's word timestamps as stored (about 80 characters a word)


class UnreadableStore(Exception):
    """The directory's job database cannot be read at all (the message says why)."""


@dataclass(frozen=True)
class Skipped:
    kind: str  # "job" | "voice"
    name: str  # job id or voice name/path, shortened
    reason: str


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


@dataclass
class ImportedJob(Job):
    """A job read from an embedded store, with its word timestamps (checked JSON; None: none)."""

    words: str | None = field(default=None, repr=False)


class StoredParams(BaseModel):
    """What a job's ``params`` must at least be: the request as the server stored it."""

    model_config = ConfigDict(extra="allow")
    input: str = Field(min_length=1)
    response_format: Literal[tuple(CONTENT_TYPES)] = "wav"  # type: ignore[valid-type]


class StoredJob(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str = Field(pattern=r"^[0-9a-f]{32}$")
    status: Literal[STATUSES]  # type: ignore[valid-type]
    params: str
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = Field(default=None, max_length=100_000)
    frames_done: int = Field(default=0, ge=0)
    frames_total: int = Field(default=0, ge=0)
    owner: str | None = Field(default=None, max_length=256)
    audio_size: int | None = Field(default=None, ge=0)
    attempts: int = Field(default=0, ge=0)
    utterances_total: int = Field(default=0, ge=0)
    utterances_done: int = Field(default=0, ge=0)
    audio_samples: int = Field(default=0, ge=0)
    words: str | None = Field(default=None, max_length=MAX_WORDS_JSON_CHARS)

    _times = field_validator("created_at", "started_at", "finished_at")(_finite)

    def job(self) -> ImportedJob:
        """Raises ValueError (pydantic's ValidationError is one) when params are not a stored
        request or the word timestamps are not a word list."""
        params = json.loads(self.params)
        if not isinstance(params, dict):
            raise ValueError(f"params are a JSON {type(params).__name__}, not an object")
        checked = StoredParams.model_validate(params)
        words = json.dumps(parse_words(self.words)) if self.words is not None else None
        return ImportedJob(id=self.id, status=self.status, params=params, created_at=self.created_at,
                           started_at=self.started_at, finished_at=self.finished_at, error=self.error,
                           frames_done=self.frames_done, frames_total=self.frames_total, owner=self.owner,
                           audio_size=self.audio_size, attempts=self.attempts, utterances_total=self.utterances_total,
                           utterances_done=self.utterances_done, audio_samples=self.audio_samples,
                           response_format=checked.response_format, words=words)


class StoredVoiceMeta(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(pattern=NAME_PATTERN.pattern)
    ref_text: str | None = Field(default=None, max_length=16_384)
    consent: str | None = Field(default=None, max_length=16_384)
    speaker_description: str | None = Field(default=None, max_length=16_384)
    audio_sha256: str = Field(default="", max_length=64)
    seconds: float = Field(default=0.0, ge=0)
    created_at: float = 0.0
    owner: str | None = Field(default=None, min_length=1, max_length=256)

    _numbers = field_validator("seconds", "created_at")(_finite)


def reason(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
        return "a symbolic link (refused: only the directory's own files are copied)"
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "value"
        return f"{where}: {first.get('msg', 'invalid')}"[:200]
    return (str(exc) or type(exc).__name__)[:200]


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _read_regular(path: Path, limit: int | None = None) -> bytes:
    """A regular file's bytes, never through a link; OSError / ValueError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise ValueError("not a regular file")
        data = handle.read(limit + 1 if limit else -1)
    if limit and len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


# -- jobs -------------------------------------------------------------------------------


def read_jobs(data_dir: Path) -> Iterator[tuple[ImportedJob | None, Skipped | None]]:
    """Every job row, oldest first: (job, None) or (None, why it was skipped). UnreadableStore
    when ``jobs.sqlite3`` is absent-but-named, a link, or not an SQLite database."""
    path = Path(data_dir) / "jobs.sqlite3"
    if not os.path.lexists(path):
        return
    if not _is_regular(path):
        raise UnreadableStore(f"{path}: not a regular file (a link or a device); refused")
    try:  # read-only: a hostile file must not be written to (no schema upgrade, no WAL of ours)
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise UnreadableStore(f"{path}: {exc}") from None
    try:
        db.row_factory = sqlite3.Row
        try:
            rows = db.execute("SELECT * FROM jobs ORDER BY rowid").fetchall()
        except sqlite3.Error as exc:
            raise UnreadableStore(f"{path}: {exc}") from None
        for row in rows:
            record = {key: row[key] for key in row.keys()}
            shown = str(record.get("id"))[:40]
            try:
                yield StoredJob.model_validate(record).job(), None
            except (ValueError, TypeError, RecursionError) as exc:
                yield None, Skipped("job", shown, reason(exc))
    finally:
        db.close()


def read_job_audio(data_dir: Path, job: Job) -> Iterator[bytes]:
    """A succeeded job's audio file in blocks; ValueError / OSError when it is not a regular
    file of its own inside a real ``audio/`` directory."""
    audio_dir = Path(data_dir) / "audio"
    if not _is_real_dir(audio_dir):
        raise ValueError("audio/ is not a directory (a link?)")
    path = audio_dir / f"{job.id}.{job.response_format}"  # id and format already checked: no '/' or '..'
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise ValueError("the audio file is not a regular file")
        while block := handle.read(READ_BLOCK):
            yield block


# -- saved voices -------------------------------------------------------------------------


def _namespaces(voices_dir: Path) -> Iterator[tuple[Path, str | None, Skipped | None]]:
    """(directory, expected owner digest dir or None for the unowned one, or a Skipped)."""
    if not _is_real_dir(voices_dir):
        if os.path.lexists(voices_dir):
            yield voices_dir, None, Skipped("voice", "voices/", "not a directory (a link?); nothing copied from it")
        return
    yield voices_dir, None, None
    owners = voices_dir / OWNERS_DIR
    if not os.path.lexists(owners):
        return
    if not _is_real_dir(owners):
        yield owners, None, Skipped("voice", f"voices/{OWNERS_DIR}", "not a directory (a link?)")
        return
    for entry in sorted(os.scandir(owners), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False):
            yield Path(entry.path), entry.name, None
        else:
            yield Path(entry.path), None, Skipped("voice", f"voices/{OWNERS_DIR}/{entry.name[:40]}",
                                                  "not a directory (a link?)")


def _voice(directory: Path, name: str, owner_dir: str | None) -> SavedVoice:
    meta = StoredVoiceMeta.model_validate(json.loads(_read_regular(directory / f"{name}.json", MAX_META_BYTES)))
    if meta.name != name:
        raise ValueError(f"its JSON names another voice ({meta.name!r})")
    if (owner_dir is None) != (meta.owner is None) or (owner_dir is not None and owner_dir_name(meta.owner) != owner_dir):
        raise ValueError("its owner does not match the directory it is in")
    arrays = load_tensors(_read_regular(directory / f"{name}.safetensors", MAX_VOICE_FILE_BYTES))
    xvector, codes = arrays.get("xvector"), arrays.get("codes")
    if xvector is None or xvector.dtype != np.float32 or xvector.ndim != 1 or not np.isfinite(xvector).all():
        raise ValueError("xvector: not a finite float32 vector")
    if codes is None or codes.dtype != np.int64 or codes.ndim != 2:
        raise ValueError("codes: not an int64 matrix")
    return SavedVoice(xvector=xvector, codes=codes, **meta.model_dump())


def read_voices(data_dir: Path) -> Iterator[tuple[SavedVoice | None, Skipped | None]]:
    """Every saved voice: (voice, None) or (None, why it was skipped)."""
    for directory, owner_dir, skipped in _namespaces(Path(data_dir) / "voices"):
        if skipped is not None:
            yield None, skipped
            continue
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            if not entry.name.endswith(".json"):
                continue
            name = entry.name[:-5]
            shown = name[:64] if owner_dir is None else f"{owner_dir[:8]}/{name[:64]}"
            if not NAME_PATTERN.match(name):
                yield None, Skipped("voice", shown, "not a voice name")
                continue
            try:
                voice = _voice(directory, name, owner_dir)
            except Exception as exc:  # hostile files: any failure (safetensors has its own error type) skips it
                yield None, Skipped("voice", shown, reason(exc))
                continue
            yield voice, None
