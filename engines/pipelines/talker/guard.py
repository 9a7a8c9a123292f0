"""The runaway guard beside the frame budget: an utterance whose code-0 sequence has fallen
into a loop ends there, instead of babbling the same frames until its budget.

    guard = LoopGuard()
    for code0 in frames:            # the host value of each emitted frame's code 0
        if guard.add(code0):        # the last LOOP_WINDOW frames repeat one pattern
            ...                     # end the utterance (truncated: "loop")

A loop is the last ``window`` code-0 values being periodic with a period of at most
``max_period`` frames (c[t] == c[t - p] for every t of the window): a stuck syllable, a
repeated word, a frozen frame. The test is O(max_period) per frame on values the talker reads
back anyway (no device work, no extra sync).

The window is measured so that utterances that end by EOS never trip it
(``python benchmarks/measure_code0_loops.py``, 673 utterances that ended by EOS on the two talker
oracle checkpoints and the in-process test talker; runs count a pattern seen twice at least):

    the official code's greedy fixture cases         longest periodic run   2 and  14 frames
    this engine, sampled (the released default)      longest periodic run   2,  2 and 4 frames
    this engine, greedy                              longest periodic run  11, 103 and 38 frames

Greedy decoding of a random 64-code test talker can loop for 8 s and still end by EOS; the
window lies above that too, so greedy output that ends by EOS is unchanged: LOOP_WINDOW = 125
frames (10 s), 30x the longest repeat of sampled decoding and longer than any natural pause
(a long one is asked for with ``<break time=.../>``: silence the service inserts, not frames of
the model). A runaway that loops is then cut after 10 s instead of at its budget (minutes for a
long utterance).
"""

from __future__ import annotations

from collections import deque

LOOP_WINDOW = 125  # frames (10 s); see the module docstring for the measurement behind it
LOOP_MAX_PERIOD = 16  # frames (1.28 s): a repeated word or short phrase


class LoopGuard:
    """One utterance's code-0 loop test (see the module docstring)."""

    __slots__ = ("window", "max_period", "history", "runs")

    def __init__(self, window: int = LOOP_WINDOW, max_period: int = LOOP_MAX_PERIOD):
        if not 1 <= 2 * max_period <= window:
            raise ValueError(f"need 1 <= 2 x max_period <= window, got {max_period}, {window}")
        self.window = window
        self.max_period = max_period
        self.history: deque[int] = deque(maxlen=max_period)  # the last max_period values, oldest first
        self.runs = [0] * max_period  # runs[p - 1]: consecutive latest frames t with c[t] == c[t - p]

    def add(self, code0: int) -> bool:
        """Record the next frame's code 0; True once the last ``window`` frames are periodic."""
        history, runs = self.history, self.runs
        seen = len(history)
        looped = False
        for p in range(1, self.max_period + 1):
            if p <= seen and history[-p] == code0:
                runs[p - 1] += 1
                looped = looped or runs[p - 1] + p >= self.window  # p leading values, then the repeats
            else:
                runs[p - 1] = 0
        history.append(code0)
        return looped


def longest_periodic_run(codes: list[int], max_period: int = LOOP_MAX_PERIOD) -> int:
    """The longest stretch of ``codes`` that is periodic with a period of at most ``max_period``
    (what a :class:`LoopGuard` with that window would have seen): the measurement behind
    LOOP_WINDOW, and the check that it never fires on utterances that end by EOS."""
    best = min(len(codes), 1)
    for p in range(1, max_period + 1):
        run = 0
        for t in range(p, len(codes)):
            run = run + 1 if codes[t] == codes[t - p] else 0
            if run >= p:  # the pattern seen twice at least (any window the guard uses is >= 2 periods)
                best = max(best, run + p)
    return best


__all__ = ["LOOP_MAX_PERIOD", "LOOP_WINDOW", "LoopGuard", "longest_periodic_run"]
