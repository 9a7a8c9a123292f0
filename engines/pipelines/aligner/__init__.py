"""Word timestamps with the Qwen3-ForcedAligner (see runtime.py)."""

from engines.pipelines.aligner.runtime import Aligner, AlignerCapabilities, AlignItem, WordTime
from engines.pipelines.aligner.words import UnsupportedLanguage

__all__ = ["AlignItem", "Aligner", "AlignerCapabilities", "UnsupportedLanguage", "WordTime"]
