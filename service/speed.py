"""The real-time factor in words, the same on every surface: the server's start-up line,
``GET /v1/models`` ``speed``, the playground's hint and the CLI (``say``, ``synthesize``).

The real-time factor is wall seconds per audio second: below 1 the audio comes faster than it
plays, above 1 slower (a listener hears gaps)."""

from __future__ import annotations


def real_time_words(rtf: float) -> str:
    """``real-time factor 0.25 (4.0x faster than real time)``, ``… 4.00 (4.0x slower than real
    time)``: the factor and how many times faster or slower than playback, right on both sides of 1."""
    if rtf <= 0:
        return "real-time factor n/a (no audio)"
    if rtf < 1:
        return f"real-time factor {rtf:.2f} ({1 / rtf:.1f}x faster than real time)"
    if rtf > 1:
        return f"real-time factor {rtf:.2f} ({rtf:.1f}x slower than real time)"
    return f"real-time factor {rtf:.2f} (as fast as real time)"
