"""Saved voices: a reference voice's features, persisted so requests clone it with no upload.

    store = FileVoiceStore(settings.data_dir / "voices")   # or the jobs' PostgreSQL (service/jobs/store/postgres.py)
    saved = await store.add(SavedVoice(name="alice", xvector=..., codes=..., ref_text="..."))  # VoiceExists on a clash
    await store.get("alice"); await store.list(); await store.delete("alice")

What is stored is what the prompt needs (the x-vector and the reference codes, computed once at
upload), never only the audio: a restart serves the voice without running an encoder. One
directory, two files per voice: ``<name>.safetensors`` (tensors) and ``<name>.json`` (the rest),
each written to a temporary name and renamed into place, the JSON last (a voice exists once its
JSON does). With ``--jobs-db`` voices live in the jobs' PostgreSQL instead
(:class:`service.jobs.store.postgres.PostgresVoiceStore`), so every replica serves every voice.
"""

from __future__ import annotations

import abc
import asyncio
import json
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
NAME_RULE = "1-64 characters: letters, digits, '_', '-', '.', starting with a letter or digit"


class VoiceExists(Exception):
    """A saved voice of that name exists already."""


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

    def describe(self) -> dict:
        """The JSON a client sees (no tensors)."""
        return {"name": self.name, "ref_text": self.ref_text, "consent": self.consent,
                "speaker_description": self.speaker_description, "audio_sha256": self.audio_sha256,
                "seconds": round(self.seconds, 3), "reference_frames": int(self.codes.shape[0]),
                "in_context": bool(self.ref_text), "created_at": self.created_at}


class VoiceStore(abc.ABC):
    """Where saved voices live: files under ``--data-dir`` or the jobs' PostgreSQL. Async, so
    neither blocks the event loop; a shared store raises ``StoreUnavailable`` while down."""

    @staticmethod
    def valid_name(name: str) -> bool:
        return bool(NAME_PATTERN.match(name or ""))

    @abc.abstractmethod
    async def get(self, name: str) -> SavedVoice | None: ...

    @abc.abstractmethod
    async def list(self) -> list[SavedVoice]: ...

    @abc.abstractmethod
    async def add(self, voice: SavedVoice) -> SavedVoice:
        """Store a new voice; VoiceExists when the name is taken."""

    @abc.abstractmethod
    async def delete(self, name: str) -> bool: ...


def voice_tensors(voice: SavedVoice) -> dict[str, np.ndarray]:
    return {"xvector": np.ascontiguousarray(voice.xvector, dtype=np.float32),
            "codes": np.ascontiguousarray(voice.codes, dtype=np.int64)}


def voice_meta(voice: SavedVoice) -> dict:
    """Everything but the tensors (JSON)."""
    return {k: v for k, v in asdict(voice).items() if k not in ("xvector", "codes")}


class FileVoiceStore(VoiceStore):
    """One directory, two files per voice (see the module's docstring); file work on a thread."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._lock = threading.Lock()

    def _paths(self, name: str) -> tuple[Path, Path]:
        if not self.valid_name(name):
            raise ValueError(f"voice name: {NAME_RULE}")
        return self.directory / f"{name}.safetensors", self.directory / f"{name}.json"

    async def get(self, name: str) -> SavedVoice | None:
        return await asyncio.to_thread(self._get, name)

    def _get(self, name: str) -> SavedVoice | None:
        if not self.valid_name(name):
            return None
        tensors, meta = self._paths(name)
        try:
            info = json.loads(meta.read_text(encoding="utf-8"))
            arrays = load_file(str(tensors))
        except (OSError, ValueError):
            return None
        return SavedVoice(xvector=arrays["xvector"], codes=arrays["codes"], **info)

    async def list(self) -> list[SavedVoice]:
        def voices():
            if not self.directory.is_dir():
                return []
            names = sorted(p.stem for p in self.directory.glob("*.json"))
            return [v for v in (self._get(n) for n in names) if v is not None]
        return await asyncio.to_thread(voices)

    async def add(self, voice: SavedVoice) -> SavedVoice:
        return await asyncio.to_thread(self._add, voice)

    def _add(self, voice: SavedVoice) -> SavedVoice:
        tensors, meta = self._paths(voice.name)
        with self._lock:
            if meta.exists():
                raise VoiceExists(voice.name)
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = tensors.with_suffix(".safetensors.tmp")
            save_file(voice_tensors(voice), str(tmp))
            os.replace(tmp, tensors)
            tmp = meta.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(voice_meta(voice), ensure_ascii=False), encoding="utf-8")
            os.replace(tmp, meta)
        return voice

    async def delete(self, name: str) -> bool:
        return await asyncio.to_thread(self._delete, name)

    def _delete(self, name: str) -> bool:
        if not self.valid_name(name):
            return False
        tensors, meta = self._paths(name)
        with self._lock:
            if not meta.exists():
                return False
            meta.unlink()
            tensors.unlink(missing_ok=True)
        return True


__all__ = ["NAME_RULE", "FileVoiceStore", "SavedVoice", "VoiceExists", "VoiceStore", "voice_meta", "voice_tensors"]
