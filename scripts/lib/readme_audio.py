"""The audio files a README block writes, checked as its reader would: each one named exists
and holds audio (24 kHz mono, at least 0.1 s, finite, not silent; a .sse file must be
well-formed speech events whose base64 audio is such audio), and the block wrote no file it
does not name (it would go unchecked). Run in the folder the block ran in:

    python scripts/lib/readme_audio.py TAG NAMES_FILE

(used by scripts/readme-tour.sh and scripts/readme-clone.sh; TAG prefixes every line)."""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

tag, names = sys.argv[1], Path(sys.argv[2]).read_text().split()
problems = []


def audio_problem(name: str, data: bytes) -> str | None:
    """Why these bytes are not the audio the tour promises, or None."""
    try:
        audio, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # noqa: BLE001 - any reason soundfile gives is the answer
        return f"not readable as audio ({exc})"
    seconds = len(audio) / rate
    if rate != 24000 or audio.shape[1] != 1:
        return f"{rate} Hz, {audio.shape[1]} channels (expected 24000 Hz mono)"
    if seconds < 0.1 or not np.isfinite(audio).all() or np.abs(audio).max() < 1e-3:
        return f"{seconds:.2f} s, peak {np.abs(audio).max() if audio.size else 0:.4f}: empty or silent"
    print(f"{tag}: {name}: {seconds:.2f} s at {rate} Hz")
    return None


def sse_audio(text: str) -> bytes:
    """The audio bytes of `"stream": true` server-sent events; raises if they are malformed."""
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1].get("type") != "speech.audio.done":
        raise ValueError(f"{len(events)} events, the last not speech.audio.done")
    deltas = [e for e in events[:-1] if e.get("type") == "speech.audio.delta"]
    if len(deltas) != len(events) - 1:
        raise ValueError("an event other than speech.audio.delta before the end")
    return b"".join(base64.b64decode(e["audio"]) for e in deltas)


for name in names:
    path = Path(name)
    if not path.is_file() or path.stat().st_size == 0:
        problems.append(f"{name}: not written")
        continue
    data = path.read_bytes()
    if name.endswith(".sse"):
        try:
            data = sse_audio(data.decode())
        except (ValueError, KeyError, UnicodeDecodeError) as exc:
            problems.append(f"{name}: not server-sent speech events: {exc}")
            continue
    problem = audio_problem(name, data)
    if problem:
        problems.append(f"{name}: {problem}")
stray = sorted(p.name for p in Path(".").iterdir() if p.name != ".venv" and p.name not in names)
if stray:
    problems.append(f"files the block wrote but does not name (unchecked): {' '.join(stray)}")
for problem in problems:
    print(f"{tag}: FAIL {problem}")
sys.exit(1 if problems else 0)
