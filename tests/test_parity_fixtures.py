"""The oracle-fixture policy itself: CI=true turns missing fixtures into failures."""

from __future__ import annotations

import pytest

from tests.oracle import fixtures

pytestmark = pytest.mark.parity


def test_missing_fixtures_fail_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="never a skip"):
        fixtures._unavailable("are missing")


def test_missing_fixtures_skip_with_build_hint_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"bash scripts/oracle-env\.sh"):
        fixtures._unavailable("are missing")


def test_stale_fixtures_are_detected(monkeypatch, tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "STAMP").write_text("not-the-hash-of-the-scripts\n")
    monkeypatch.setattr(fixtures, "FIXTURES", tmp_path)
    fixtures._state.cache_clear()
    try:
        problem, _ = fixtures._state()
        assert problem and "stale" in problem
        (tmp_path / "STAMP").write_text(fixtures._expected_stamp() + "\n")
        fixtures._state.cache_clear()
        assert fixtures._state()[0] is None
    finally:
        fixtures._state.cache_clear()
