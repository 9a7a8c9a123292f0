"""Numbers a client writes outside the pydantic schema - query strings, WebSocket handshakes,
the vendors' JSON fields - read one strict way on every surface.

Text is ASCII digits only (``str.isdigit()`` takes ``"²"``, which ``int()`` then refuses, and
``int()`` takes ``"١٢"``, ``" 12 "`` and ``"1_2"``), at most ``MAX_DIGITS`` of them (``int()`` of
thousands of digits is slow, and refused past 4,300), so a value is a number in range or the
caller's 400, never a 500. A whole number may be written as a float with nothing after its
point (``"24000.0"``; JSON ``24000.0``), as the vendors' SDKs send them.

    text = request.query.get("sample_rate", "24000")
    rate = whole_number(text)   # None: not a whole number (json_whole_number: a JSON value)
    if rate is None or not 8000 <= rate <= 48000:
        raise ApiError(400, "invalid_query_parameter", f"sample_rate: a whole number from 8000 to 48000, "
                                                       f"got {shown(text)}")
"""

from __future__ import annotations

import math
import re

MAX_DIGITS = 12  # every number a client may give here has fewer (sample rates, bit rates, seconds, counts)
_WHOLE = re.compile(rf"[0-9]{{1,{MAX_DIGITS}}}(?:\.0{{1,{MAX_DIGITS}}})?")
_DECIMAL = re.compile(rf"[0-9]{{1,{MAX_DIGITS}}}(?:\.[0-9]{{1,{MAX_DIGITS}}})?")


def whole_number(text: object) -> int | None:
    """A query or handshake value as a whole number (ASCII digits, optionally followed by
    ``.0``), else None."""
    return int(text.partition(".")[0]) if isinstance(text, str) and _WHOLE.fullmatch(text) else None


def json_whole_number(value: object) -> int | None:
    """A JSON value as a whole number: an integer, or a float with an integral value; None for
    anything else (a string, a boolean, ``8000.5``; a 400-digit literal, which
    :func:`service.synthesis.schema.parse_json` makes a float, is out of every range anyway)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def decimal_number(value: str) -> float | None:
    """Text of a non-negative decimal number (``"1"``, ``"0.75"``: ASCII digits, at most one point), else None."""
    return float(value) if isinstance(value, str) and _DECIMAL.fullmatch(value) else None


def shown(value: object) -> str:
    """A client's value as an error message quotes it: repr, cut short."""
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


__all__ = ["MAX_DIGITS", "decimal_number", "json_whole_number", "shown", "whole_number"]
