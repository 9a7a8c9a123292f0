"""Timestamp classes -> monotonic millisecond times, as ``qwen_asr``'s ``fix_timestamp`` does.

The classifier predicts one class per ``<timestamp>`` token (two per word: start, end);
class ``c`` is ``c * segment_ms``. Predictions that break the order are repaired: the
longest non-decreasing subsequence is kept (the first one found, as the official O(n^2)
search finds it), a run of at most two outliers takes its nearer kept neighbour (the left
one on a tie), a longer run is interpolated linearly between its neighbours, and every
value is truncated to an integer.
"""

from __future__ import annotations

import torch


def class_times(classes: torch.Tensor, segment_ms: float) -> list[float]:
    """The official ``masked_output_id * timestamp_segment_time`` (a float32 tensor) as floats."""
    return (classes.long().cpu() * segment_ms).tolist()


def fix_timestamps(data: list[float]) -> list[int]:
    n = len(data)
    if n == 0:
        return []
    best = [1] * n
    parent = [-1] * n
    for i in range(1, n):
        for j in range(i):
            if data[j] <= data[i] and best[j] + 1 > best[i]:
                best[i], parent[i] = best[j] + 1, j
    kept = [False] * n
    idx = best.index(max(best))
    while idx != -1:
        kept[idx] = True
        idx = parent[idx]

    result = list(data)
    i = 0
    while i < n:
        if kept[i]:
            i += 1
            continue
        j = i
        while j < n and not kept[j]:
            j += 1
        left = next((result[k] for k in range(i - 1, -1, -1) if kept[k]), None)
        right = next((result[k] for k in range(j, n) if kept[k]), None)
        if j - i <= 2:
            for k in range(i, j):
                if left is None:
                    result[k] = right
                elif right is None:
                    result[k] = left
                else:
                    result[k] = left if (k - (i - 1)) <= (j - k) else right
        elif left is not None and right is not None:
            step = (right - left) / (j - i + 1)
            for k in range(i, j):
                result[k] = left + step * (k - i + 1)
        else:
            for k in range(i, j):
                result[k] = left if left is not None else right
        i = j
    return [int(v) for v in result]


__all__ = ["class_times", "fix_timestamps"]
