"""Saved voices: a reference voice's features, persisted so requests clone it with no upload.

    store = FileVoiceStore(settings.data_dir / "voices")   # or the shared database (service/voices/store_postgres.py)
    saved = await store.add(SavedVoice(name="alice", owner="key:...", xvector=..., codes=..., ref_text="..."))
    await store.get("alice", owner="key:...")        # None for any other owner
    page = await store.list(owner="key:...", limit=100, after=None)   # page.voices, page.next_after
    await store.delete("alice", owner="key:...")

A voice belongs to the API key that uploaded it (``owner``: the key's digest, as jobs'); names
are unique per owner, so no key can see, use, delete or take over another key's voice. ``None``
is the unowned namespace: every voice with auth off, and voices saved before voices had
owners (with keys on only admin keys see those; service/voices/routes.py).

What is stored is what the prompt needs (the x-vector and the reference codes, computed once at
upload), never only the audio: a restart serves the voice without running an encoder. Files:
two per voice, ``<name>.safetensors`` (tensors) and ``<name>.json`` (the rest), in ``voices/``
for unowned voices (the layout before owners, so an old directory needs no migration) and in
``voices/owners/<digest of owner>/`` for a key's; each written to a temporary name and
renamed into place, the JSON last (a voice exists once its JSON does).
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import json
import os
import re
import stat
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
NAME_RULE = "1-64 characters: letters, digits, '_', '-', '.', starting with a letter or digit"
OWNERS_DIR = "owners"


class VoiceExists(Exception):
    """This owner has a saved voice of that name already."""


class VoiceLimitReached(Exception):
    """The owner's or the store's cap on saved voices is reached (the message says which)."""


@dataclass(frozen=True)
class SavedVoice:
    name: str
    xvector: np.ndarray  # [D] float32
    codes: np.ndarray  # [T, G] int64 reference codes (in-context cloning needs ref_text too)
    ref_text: str | None = None
    consent: str | None = None
    speaker_description: str | None = None
    audio_sha256: str = ""  # content key of the uploaded reference
    seconds: float = 0.0
    created_at: float = field(default_factory=time.time)
    owner: str | None = None  # digest of the uploading API key ("key:..."); None: unowned

    def describe(self) -> dict:
        """The JSON a client sees (no tensors, no owner)."""
        return {"name": self.name, "ref_text": self.ref_text, "consent": self.consent,
                "speaker_description": self.speaker_description, "audio_sha256": self.audio_sha256,
                "seconds": round(self.seconds, 3), "reference_frames": int(self.codes.shape[0]),
                "in_context": bool(self.ref_text), "created_at": self.created_at}


@dataclass(frozen=True)
class VoicePage:
    voices: list[SavedVoice]
    next_after: str | None  # pass as ``after`` for the next page; None: this was the last


class VoiceStore(abc.ABC):
    """Where saved voices live: files under ``--data-dir`` or the shared database. Async, so
    neither blocks the event loop; a shared store raises ``StoreUnavailable`` while down.
    Every call names the owner whose namespace it works in (None: the unowned one)."""

    @staticmethod
    def valid_name(name: str) -> bool:
        return bool(NAME_PATTERN.match(name or ""))

    @abc.abstractmethod
    async def get(self, name: str, owner: str | None) -> SavedVoice | None: ...

    @abc.abstractmethod
    async def list(self, owner: str | None = None, any_owner: bool = False, limit: int = 100,
                   after: str | None = None) -> VoicePage:
        """One page in name order: ``owner``'s voices, or every owner's with ``any_owner``
        (then ordered by name, then owner). ``after``: the previous page's ``next_after``."""

    @abc.abstractmethod
    async def count(self, owner: str | None = None, any_owner: bool = False) -> int: ...

    @abc.abstractmethod
    async def add(self, voice: SavedVoice, max_per_owner: int = 0, max_total: int = 0) -> SavedVoice:
        """Store a new voice in ``voice.owner``'s namespace: VoiceExists when the name is taken
        there, VoiceLimitReached when the owner holds ``max_per_owner`` voices or the store
        ``max_total`` (0: no cap), checked atomically with the insert."""

    @abc.abstractmethod
    async def delete(self, name: str, owner: str | None) -> bool: ...


def limit_message(held: int, cap: int, whose: str) -> str:
    return f"{whose} {held} saved voices, the limit ({cap}); delete some with DELETE /v1/audio/voices/NAME"


def voice_tensors(voice: SavedVoice) -> dict[str, np.ndarray]:
    return {"xvector": np.ascontiguousarray(voice.xvector, dtype=np.float32),
            "codes": np.ascontiguousarray(voice.codes, dtype=np.int64)}


def voice_meta(voice: SavedVoice) -> dict:
    """Everything but the tensors (JSON)."""
    return {k: v for k, v in asdict(voice).items() if k not in ("xvector", "codes")}


def owner_dir_name(owner: str) -> str:
    """A directory name for any owner string (a key digest today): its own digest."""
    return hashlib.sha256(owner.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _regular_file(path: Path) -> bool:
    """A plain file, not a link (the directory may come from elsewhere: migrate-store)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


class FileVoiceStore(VoiceStore):
    """Two files per voice, one directory per owner (see the module's docstring); file work on
    a thread, under one lock so caps and name checks are atomic with the writes."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._lock = threading.Lock()

    def _dir(self, owner: str | None) -> Path:
        return self.directory if owner is None else self.directory / OWNERS_DIR / owner_dir_name(owner)

    def _paths(self, name: str, owner: str | None) -> tuple[Path, Path]:
        if not self.valid_name(name):
            raise ValueError(f"voice name: {NAME_RULE}")
        directory = self._dir(owner)
        return directory / f"{name}.safetensors", directory / f"{name}.json"

    def _names(self, directory: Path) -> list[str]:
        """The voice names in one directory (sorted), by their JSON files; links and odd names skipped."""
        try:
            entries = list(os.scandir(directory))
        except OSError:
            return []
        return sorted(e.name[:-5] for e in entries
                      if e.name.endswith(".json") and self.valid_name(e.name[:-5]) and e.is_file(follow_symlinks=False))

    def _owner_dirs(self) -> list[tuple[str, Path]]:
        """(sort tag, directory) of every namespace: '' for the unowned one."""
        dirs = [("", self.directory)]
        try:
            entries = list(os.scandir(self.directory / OWNERS_DIR))
        except OSError:
            return dirs
        dirs += sorted((e.name, Path(e.path)) for e in entries if e.is_dir(follow_symlinks=False))
        return dirs

    async def get(self, name: str, owner: str | None) -> SavedVoice | None:
        return await asyncio.to_thread(self._get, name, owner)

    def _get(self, name: str, owner: str | None) -> SavedVoice | None:
        return self._read(self._dir(owner), name) if self.valid_name(name) else None

    def _read(self, directory: Path, name: str) -> SavedVoice | None:
        tensors, meta = directory / f"{name}.safetensors", directory / f"{name}.json"
        if not (_regular_file(meta) and _regular_file(tensors)):
            return None
        try:
            info = json.loads(meta.read_text(encoding="utf-8"))
            arrays = load_file(str(tensors))
            voice = SavedVoice(xvector=arrays["xvector"], codes=arrays["codes"], **info)
        except (OSError, ValueError, TypeError, KeyError, RecursionError):  # a damaged or foreign file: not a voice
            return None
        if voice.name != name or self._dir(voice.owner) != directory:
            return None  # a file renamed or moved by hand is not what its place says
        return voice

    async def list(self, owner=None, any_owner=False, limit=100, after=None) -> VoicePage:
        return await asyncio.to_thread(self._list, owner, any_owner, limit, after)

    def _list(self, owner, any_owner, limit, after) -> VoicePage:
        if any_owner:  # (name, namespace tag) order; the cursor is "name/tag" ('/' is never in a name)
            keys = sorted((name, tag, directory) for tag, directory in self._owner_dirs()
                          for name in self._names(directory))
            if after:
                name, slash, tag = after.partition("/")
                cursor = (name, tag) if slash else (name, "\U0010ffff")  # a bare name: past all of that name
                keys = [key for key in keys if key[:2] > cursor]
        else:
            directory = self._dir(owner)
            keys = [(name, "", directory) for name in self._names(directory) if after is None or name > after]
        page = keys[:limit]
        voices = [v for v in (self._read(directory, name) for name, _, directory in page) if v is not None]
        if len(keys) <= limit:
            return VoicePage(voices, None)
        name, tag, _ = page[-1]
        return VoicePage(voices, f"{name}/{tag}" if any_owner else name)

    async def count(self, owner=None, any_owner=False) -> int:
        return await asyncio.to_thread(self._count, owner, any_owner)

    def _count(self, owner, any_owner) -> int:
        if any_owner:
            return sum(len(self._names(directory)) for _, directory in self._owner_dirs())
        return len(self._names(self._dir(owner)))

    async def add(self, voice, max_per_owner=0, max_total=0) -> SavedVoice:
        return await asyncio.to_thread(self._add, voice, max_per_owner, max_total)

    def _add(self, voice: SavedVoice, max_per_owner: int, max_total: int) -> SavedVoice:
        tensors, meta = self._paths(voice.name, voice.owner)
        with self._lock:
            if os.path.lexists(meta):
                raise VoiceExists(voice.name)
            if max_per_owner and (held := self._count(voice.owner, False)) >= max_per_owner:
                raise VoiceLimitReached(limit_message(held, max_per_owner, "this key has"))
            if max_total and (held := self._count(None, True)) >= max_total:
                raise VoiceLimitReached(limit_message(held, max_total, "the server holds"))
            tensors.parent.mkdir(parents=True, exist_ok=True)
            tmp = tensors.with_suffix(".safetensors.tmp")
            save_file(voice_tensors(voice), str(tmp))
            os.replace(tmp, tensors)
            tmp = meta.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(voice_meta(voice), ensure_ascii=False), encoding="utf-8")
            os.replace(tmp, meta)
        return voice

    async def delete(self, name: str, owner: str | None) -> bool:
        return await asyncio.to_thread(self._delete, name, owner)

    def _delete(self, name: str, owner: str | None) -> bool:
        if not self.valid_name(name):
            return False
        tensors, meta = self._paths(name, owner)
        with self._lock:
            if not os.path.lexists(meta):
                return False
            meta.unlink()
            tensors.unlink(missing_ok=True)
        return True


__all__ = ["NAME_RULE", "FileVoiceStore", "SavedVoice", "VoiceExists", "VoiceLimitReached", "VoicePage",
           "VoiceStore", "limit_message", "owner_dir_name", "voice_meta",
           "voice_tensors"]
