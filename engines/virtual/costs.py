"""The device cost table a virtual device reads (``benchmarks/costs/<gpu>-<size>.json``) and its lookups.

Written on a GPU by ``benchmarks/measure_costs.py``: DEVICE milliseconds of one call as the served
engine makes it (the talker's decode step by rows and KV blocks, a chunked prefill by prompts and
width, a codec-decoder call by rows and frames, one graph capture). The schema is fixed
(docs/VIRTUAL_DEVICE.md); lookups follow its rules:

* decode step: rows round UP to the next listed bucket (the graphs run at the bucket); KV blocks too,
  or, where the step read the pool in place (``kv_in_place``), interpolate linearly;
* prefill: prompts round up, width interpolates linearly (prefill is eager, not bucketed);
* codec decode: rows round up, frames interpolate linearly;
* admission (optional: tables measured before it have none): rows started together interpolate linearly;
* beyond the last listed point of any axis the cost scales linearly from its last two points.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_grid(rows: list[int], cols: list[int], ms: list[list[float]], what: str) -> None:
    for name, axis in (("rows", rows), ("columns", cols)):
        if not axis or any(b <= a for a, b in zip(axis, axis[1:])) or axis[0] < 1:
            raise ValueError(f"{what}: {name} must be positive and strictly increasing, got {axis}")
    if len(ms) != len(rows) or any(len(row) != len(cols) for row in ms):
        raise ValueError(f"{what}: ms must be {len(rows)} lists of {len(cols)} values")
    if any(v < 0 for row in ms for v in row):
        raise ValueError(f"{what}: ms must be >= 0")


class _Grid(_Frozen):
    """Costs over two axes: the first two fields, then ``ms[first][second]``."""

    @model_validator(mode="after")
    def _grid(self) -> "_Grid":
        rows, cols = (getattr(self, name) for name in list(type(self).model_fields)[:2])
        _check_grid(rows, cols, self.ms, type(self).__name__)
        return self


class DecodeStepCosts(_Grid):
    rows: list[int]
    kv_blocks: list[int]
    ms: list[list[float]]


class PrefillCosts(_Grid):
    prompts: list[int]
    width: list[int]
    ms: list[list[float]]


class CodecDecodeCosts(_Grid):
    rows: list[int]
    frames: list[int]
    ms: list[list[float]]


class AdmitCosts(_Frozen):
    """Starting ``rows`` admitted rows together (their prompts' inputs and row state)."""

    rows: list[int]
    ms: list[float]

    @model_validator(mode="after")
    def _axis(self) -> "AdmitCosts":
        _check_grid(self.rows, [1], [[v] for v in self.ms], "AdmitCosts")
        return self


class CaptureCosts(_Frozen):
    decode_step: float = Field(ge=0)
    codec_decode: float = Field(ge=0)


class CostTable(_Frozen):
    """One GPU's measured costs (schema 1)."""

    schema_: Literal[1] = Field(alias="schema")
    device: str
    torch: str
    date: str
    commit: str
    size: str
    dtype: str
    command: str
    decode_step: DecodeStepCosts
    prefill: PrefillCosts
    codec_decode: CodecDecodeCosts
    capture_ms: CaptureCosts
    start_s: float = Field(ge=0)
    # the measured decode step read each row's KV length on the device (the paged-attention kernel):
    # one graph per rows bucket, its cost linear in the blocks read; else KV-block buckets (gather)
    kv_in_place: bool = False
    # the prefill measured through CUDA graphs for calls of at most this many padded positions
    # (engines/runtime/graphed_prefill.py: prompts all starting at 0, in its buckets); 0: all eager
    prefill_graph_positions: int = Field(0, ge=0)
    admit: AdmitCosts | None = None  # None: the table predates the admission measurement
    notes: str = ""

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        """The table in ``path``; ValueError naming the file when it is not a valid table."""
        try:
            return cls.model_validate(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a device cost table: {exc}") from None

    def decode_step_ms(self, rows: int, kv_blocks: int) -> float:
        c = self.decode_step
        blocks = _linear(c.kv_blocks, kv_blocks) if self.kv_in_place else _round_up(c.kv_blocks, kv_blocks)
        return _lookup(c.ms, _round_up(c.rows, rows), blocks)

    def prefill_ms(self, prompts: int, width: int) -> float:
        c = self.prefill
        return _lookup(c.ms, _round_up(c.prompts, prompts), _linear(c.width, width))

    def admit_ms(self, rows: int) -> float | None:
        """Starting ``rows`` admitted rows together; None where the table did not measure it."""
        if self.admit is None:
            return None
        return _lookup([[v] for v in self.admit.ms], _linear(self.admit.rows, rows), [(0, 1.0)])

    def codec_decode_ms(self, rows: int, frames: int) -> float:
        c = self.codec_decode
        return _lookup(c.ms, _round_up(c.rows, rows), _linear(c.frames, frames))


Weights = list[tuple[int, float]]  # (index on an axis, weight)


def _beyond(axis: list[int], value: float) -> Weights:
    """Past the last point: linear from the last two (a one-point axis: that point)."""
    if len(axis) == 1:
        return [(0, 1.0)]
    a, b = axis[-2], axis[-1]
    w = (value - a) / (b - a)
    return [(len(axis) - 2, 1.0 - w), (len(axis) - 1, w)]


def _round_up(axis: list[int], value: float) -> Weights:
    """The smallest listed bucket >= value (the first below the axis)."""
    if value > axis[-1]:
        return _beyond(axis, value)
    return [(bisect.bisect_left(axis, value), 1.0)]


def _linear(axis: list[int], value: float) -> Weights:
    """Linear between the listed points (the first point below the axis)."""
    if value > axis[-1]:
        return _beyond(axis, value)
    if value <= axis[0]:
        return [(0, 1.0)]
    i = bisect.bisect_left(axis, value)  # axis[i - 1] < value <= axis[i]
    w = (value - axis[i - 1]) / (axis[i] - axis[i - 1])
    return [(i - 1, 1.0 - w), (i, w)]


def _lookup(ms: list[list[float]], rows: Weights, cols: Weights) -> float:
    return max(0.0, sum(wr * wc * ms[r][c] for r, wr in rows for c, wc in cols))


__all__ = ["CostTable"]
