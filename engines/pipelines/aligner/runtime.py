"""The batched forced-alignment runtime: finished pieces of audio + their text -> word times.

    aligner = Aligner.load("Qwen/Qwen3-ForcedAligner-0.6B", device="cuda", dtype=torch.bfloat16)
    [[WordTime("Hello", 0, 400, 0, 5), ...], ...] = aligner.align_batch([AlignItem(pcm24k, "Hello world", "English")])

Blocking, for the engine thread (no asyncio). Each item is processed as the official
``Qwen3ForcedAligner.align`` processes it on its own: mono float PCM resampled to 16 kHz
(soxr ``HQ``, librosa's default, trimmed or zero-padded to ceil(n * 16000 / sr)), scaled
down if it peaks above 1, Whisper log-mel, the prompt ``<|audio_start|>`` + one
``<|audio_pad|>`` per audio token + ``<|audio_end|>`` + ``word<timestamp><timestamp>``...
The batch runs as one encoder pass and one decoder pass; an item's result never depends on
what shares its batch (the official batched call pads every waveform to the longest one
before its mel, which changes the last frames of the shorter ones; see docs/ALIGNER.md).

Times are integer milliseconds from the start of the item's audio plus ``offset_ms`` (the
piece's start on the stream's clock). Units are words for space-separated scripts and single
characters for CJK ideographs; ``char_start``/``char_end`` locate each unit in the item's text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engines.checkpoints.qwen3_aligner import AlignerParts, load_aligner
from engines.models.forced_aligner import cnn_output_length
from engines.models.mel import WhisperLogMel
from engines.pipelines.aligner.timestamps import class_times, fix_timestamps
from engines.pipelines.aligner.words import (
    UnsupportedLanguage,
    aligner_text,
    language_support,
    locate,
    split_words,
)

SAMPLE_RATE = 16_000
MAX_SECONDS = 180.0  # the official MAX_FORCE_ALIGN_INPUT_SECONDS: longer pieces are refused
# Languages the official package lists (qwen_asr.inference.utils.SUPPORTED_LANGUAGES); a
# checkpoint's config.json support_languages, when present, takes precedence.
OFFICIAL_LANGUAGES = (
    "Chinese", "English", "Cantonese", "Arabic", "German", "French", "Spanish", "Portuguese", "Indonesian",
    "Italian", "Korean", "Russian", "Thai", "Vietnamese", "Japanese", "Turkish", "Hindi", "Malay", "Dutch",
    "Swedish", "Danish", "Finnish", "Polish", "Czech", "Filipino", "Persian", "Greek", "Romanian", "Hungarian",
    "Macedonian")


@dataclass(frozen=True)
class AlignItem:
    audio: np.ndarray | torch.Tensor  # mono float PCM in [-1, 1] ([N], or [C, N] / [N, C]: averaged)
    text: str
    language: str  # e.g. "English", "Chinese" (any case)
    sample_rate: int = 24_000  # what the engine produces
    offset_ms: float = 0.0  # added to every time: where this piece starts on the stream's clock


@dataclass(frozen=True)
class WordTime:
    text: str  # the unit as aligned (punctuation removed)
    start_ms: float
    end_ms: float
    char_start: int  # [char_start, char_end): the unit's characters in AlignItem.text
    char_end: int


@dataclass(frozen=True)
class AlignerCapabilities:
    """What the loaded aligner can time, for ``/v1/models`` and request validation."""

    model: str
    languages: tuple[str, ...]  # lower-case names the aligner accepts now
    needs_extra: dict[str, str] = field(default_factory=dict)  # language -> package to install
    units: str = "words (space-separated scripts); characters (CJK ideographs)"
    max_seconds: float = MAX_SECONDS


def to_16k(audio: np.ndarray | torch.Tensor, sample_rate: int) -> np.ndarray:
    """The official ``normalize_audio_input`` for an in-memory waveform."""
    import soxr

    wav = audio.detach().float().cpu().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio)
    if wav.ndim == 2:  # the official to_mono: channels first when few and short side first
        if wav.shape[0] <= 8 and wav.shape[1] > wav.shape[0]:
            wav = wav.T
        wav = np.mean(wav, axis=-1).astype(np.float32)
    elif wav.ndim != 1:
        raise ValueError(f"audio must be mono [N] or [C, N], got shape {wav.shape}")
    if sample_rate != SAMPLE_RATE:
        n = int(np.ceil(wav.shape[-1] * float(SAMPLE_RATE) / sample_rate))
        out = soxr.resample(wav, sample_rate, SAMPLE_RATE, quality="soxr_hq")
        wav = np.asarray(out[:n] if out.shape[0] >= n else np.pad(out, (0, n - out.shape[0])), dtype=wav.dtype)
    wav = wav.astype(np.float32)
    peak = float(np.max(np.abs(wav))) if wav.size else 0.0
    if peak > 1.0:
        wav = wav / peak
    return np.clip(wav, -1.0, 1.0) if peak else wav


class Aligner:
    """A loaded Qwen3-ForcedAligner; :meth:`align_batch` is the one entry point."""

    def __init__(self, parts: AlignerParts, name: str | None = None):
        self.parts = parts
        self.model, self.tokenizer, self.cfg = parts.model, parts.tokenizer, parts.config
        self.device = next(self.model.parameters()).device
        self.mel = WhisperLogMel(n_mels=self.cfg.audio.num_mel_bins).to(self.device)
        self.name = name or str(parts.path)
        self._prefix_ids = self.tokenizer.encode("<|audio_start|>")
        self._end_ids = self.tokenizer.encode("<|audio_end|>")

    @classmethod
    def load(cls, name: str | Path, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32) -> "Aligner":
        """From an official-layout directory or a Hugging Face id (``ORG/NAME[@REVISION]``)."""
        return cls(load_aligner(name, device=device, dtype=dtype), name=str(name))

    def capabilities(self) -> AlignerCapabilities:
        declared = self.parts.languages or tuple(x.lower() for x in OFFICIAL_LANGUAGES)
        ok, extra = [], {}
        for lang in declared:
            support = language_support(lang)
            if support.supported:
                ok.append(lang)
            else:
                extra[lang] = support.needs or ""
        return AlignerCapabilities(self.name, tuple(ok), extra)

    # ------------------------------------------------------------------ batch

    def _prepare(self, item: AlignItem) -> tuple[list[str], list[int], torch.Tensor] | None:
        lang = item.language.strip().lower()
        if lang not in (self.parts.languages or tuple(x.lower() for x in OFFICIAL_LANGUAGES)):
            raise UnsupportedLanguage(f"the aligner does not support language {item.language!r}")
        words = split_words(item.text, lang)
        wav = to_16k(item.audio, item.sample_rate)
        if wav.shape[0] > MAX_SECONDS * SAMPLE_RATE:
            raise ValueError(f"audio of {wav.shape[0] / SAMPLE_RATE:.1f} s is longer than {MAX_SECONDS:g} s")
        frames = wav.shape[0] // self.mel.hop
        if not words or frames == 0:
            return None  # nothing to time, or no audio: no times (never invented ones)
        features = self.mel(torch.from_numpy(wav).to(self.device))
        n_audio = int(cnn_output_length(frames))
        ids = (self._prefix_ids + [self.cfg.audio_token_id] * n_audio + self._end_ids
               + self.tokenizer.encode(aligner_text(words)))
        return words, ids, features

    @torch.inference_mode()
    def align_batch(self, items: list[AlignItem]) -> list[list[WordTime]]:
        """One list of unit times per item, in order ([] for an item with no word or no audio).
        Raises UnsupportedLanguage / ValueError for an item it cannot align (nothing is run)."""
        prepared = [self._prepare(item) for item in items]
        live = [(i, p) for i, p in enumerate(prepared) if p is not None]
        results: list[list[WordTime]] = [[] for _ in items]
        if not live:
            return results
        width = max(len(p[1]) for _, p in live)
        pad = self.tokenizer.token_to_id("<|endoftext|>") or 0
        ids = torch.full((len(live), width), pad, dtype=torch.long)
        for row, (_, (_, row_ids, _)) in enumerate(live):
            ids[row, :len(row_ids)] = torch.tensor(row_ids)
        ids = ids.to(self.device)
        classes = self.model.timestamp_classes(ids, [p[2] for _, p in live]).cpu()
        offset = 0
        for i, (words, _, _) in ((i, p) for i, p in live):
            n = 2 * len(words)
            times = fix_timestamps(class_times(classes[offset:offset + n], self.cfg.timestamp_segment_time))
            offset += n
            item = items[i]
            units = locate(item.text, words)
            results[i] = [WordTime(u.text, times[2 * k] + item.offset_ms, times[2 * k + 1] + item.offset_ms,
                                   u.start, u.end) for k, u in enumerate(units)]
        return results

    def align(self, audio, text: str, language: str, sample_rate: int = 24_000) -> list[WordTime]:
        return self.align_batch([AlignItem(audio, text, language, sample_rate)])[0]


__all__ = ["AlignItem", "Aligner", "AlignerCapabilities", "MAX_SECONDS", "WordTime", "to_16k"]
