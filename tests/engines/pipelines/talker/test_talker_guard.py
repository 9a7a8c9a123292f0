"""The runaway guard's loop test (engines/pipelines/talker/guard.py): it never fires on what the
official code generates for the talker fixtures, and it cuts a forced loop of any period up to
LOOP_MAX_PERIOD as soon as its window is full of it."""

from __future__ import annotations

import random

import pytest

from engines.pipelines.talker.guard import LOOP_MAX_PERIOD, LOOP_WINDOW, LoopGuard, longest_periodic_run
from tests.oracle import clone_fixtures, talker_fixtures


def first_firing(codes: list[int], guard: LoopGuard | None = None) -> int | None:
    guard = guard or LoopGuard()
    for t, code in enumerate(codes):
        if guard.add(code):
            return t
    return None


def official_code0_sequences() -> list[list[int]]:
    out = []
    for fixtures, names in ((talker_fixtures, talker_fixtures.CHECKPOINTS), (clone_fixtures, ("base", "design"))):
        for name in names:
            out += [v[:, 0].tolist() for k, v in fixtures.references(name).items() if k.endswith("/codes")]
    return out


def test_the_official_outputs_never_trip_it():
    sequences = official_code0_sequences()
    assert len(sequences) >= 24
    for codes in sequences:
        assert first_firing(codes) is None
        assert longest_periodic_run(codes) < LOOP_WINDOW


def test_random_codes_never_trip_it():
    rng = random.Random(0)
    assert first_firing([rng.randrange(2048) for _ in range(20_000)]) is None


@pytest.mark.parametrize("period", [1, 2, 3, 7, LOOP_MAX_PERIOD])
def test_a_forced_loop_is_cut_when_the_window_is_full(period):
    rng = random.Random(period)
    prefix = [rng.randrange(1000, 2048) for _ in range(37)]
    pattern = [rng.randrange(0, 1000) for _ in range(period)]
    if period > 1:
        pattern[0] = pattern[1] + 1  # not a shorter period
    loop = (pattern * (4 * LOOP_WINDOW // period + 1))[: 4 * LOOP_WINDOW]
    assert first_firing(prefix + loop) == len(prefix) + LOOP_WINDOW - 1  # the window's last frame
    assert longest_periodic_run(prefix + loop) == len(loop)


def test_a_longer_period_is_not_a_loop_to_it():
    rng = random.Random(5)
    pattern = [rng.randrange(2048) for _ in range(LOOP_MAX_PERIOD + 1)]
    assert first_firing(pattern * 20) is None


def test_the_window_must_hold_two_periods():
    with pytest.raises(ValueError):
        LoopGuard(window=10, max_period=6)
