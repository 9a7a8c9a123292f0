"""Saved voices: a reference voice's features, persisted so requests clone it with no upload.

    store = VoiceStore(settings.data_dir / "voices")
    saved = store.add(SavedVoice(name="alice", xvector=..., codes=..., ref_text="...", ...))  # VoiceExists on a clash
    store.get("alice"); store.list(); store.delete("alice")

What is stored is what the prompt needs (the x-vector and the reference codes, computed once at
upload), never only the audio: a restart serves the voice without running an encoder. One
directory, two files per voice: ``<name>.safetensors`` (tensors) and ``<name>.json`` (the rest),
each written to a temporary name and renamed into place, the JSON last (a voice exists once its
JSON does). The interface is small on purpose: a database-backed store (the jobs' PostgreSQL)
can replace this one without touching the routes.
"""

from __future__ import annotations

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


class VoiceStore:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._lock = threading.Lock()

    @staticmethod
    def valid_name(name: str) -> bool:
        return bool(NAME_PATTERN.match(name or ""))

    def _paths(self, name: str) -> tuple[Path, Path]:
        if not self.valid_name(name):
            raise ValueError(f"voice name: {NAME_RULE}")
        return self.directory / f"{name}.safetensors", self.directory / f"{name}.json"

    def get(self, name: str) -> SavedVoice | None:
        if not self.valid_name(name):
            return None
        tensors, meta = self._paths(name)
        try:
            info = json.loads(meta.read_text(encoding="utf-8"))
            arrays = load_file(str(tensors))
        except (OSError, ValueError):
            return None
        return SavedVoice(xvector=arrays["xvector"], codes=arrays["codes"], **info)

    def list(self) -> list[SavedVoice]:
        if not self.directory.is_dir():
            return []
        names = sorted(p.stem for p in self.directory.glob("*.json"))
        return [v for v in (self.get(n) for n in names) if v is not None]

    def add(self, voice: SavedVoice) -> SavedVoice:
        tensors, meta = self._paths(voice.name)
        with self._lock:
            if meta.exists():
                raise VoiceExists(voice.name)
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = tensors.with_suffix(".safetensors.tmp")
            save_file({"xvector": np.ascontiguousarray(voice.xvector, dtype=np.float32),
                       "codes": np.ascontiguousarray(voice.codes, dtype=np.int64)}, str(tmp))
            os.replace(tmp, tensors)
            info = {k: v for k, v in asdict(voice).items() if k not in ("xvector", "codes")}
            tmp = meta.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(info, ensure_ascii=False), encoding="utf-8")
            os.replace(tmp, meta)
        return voice

    def delete(self, name: str) -> bool:
        if not self.valid_name(name):
            return False
        tensors, meta = self._paths(name)
        with self._lock:
            if not meta.exists():
                return False
            meta.unlink()
            tensors.unlink(missing_ok=True)
        return True


__all__ = ["NAME_RULE", "SavedVoice", "VoiceExists", "VoiceStore"]
