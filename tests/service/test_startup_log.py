"""What `streamvox serve` logs at start, read as a person starting it reads it (a real
subprocess): a fresh data folder is one line about the job store's schema, not one per
migration step, and an existing one none; a talker server does not speak of a preset (a preset
is the DiT's size: small, base, tiny), a DiT server does."""

from __future__ import annotations

from conftest import ServerProcess

from service.db.schema import SCHEMA_VERSION
from tests.oracle import talker_fixtures


def started_log(data_dir, *args: str) -> str:
    server = ServerProcess(data_dir, *args)
    try:
        server.wait_listening()
    finally:
        server.stop()
    return server.log


def test_the_start_up_log_says_the_schema_once_and_a_preset_only_for_the_dit(tmp_path):
    checkpoint = talker_fixtures.checkpoint_dir("cv_proj")  # missing fixtures: fail under CI=true, else skip
    talker = started_log(tmp_path / "data", "--model", str(checkpoint))
    schema = [line for line in talker.splitlines() if "schema" in line]
    assert len(schema) == 1 and schema[0].endswith(f"job store: created at schema v{SCHEMA_VERSION}"), talker
    assert "preset" not in talker.lower(), talker
    assert "engine ready: cv_proj;" in talker, talker  # the model it serves, by name

    dit = started_log(tmp_path / "data")  # the same folder again: nothing to migrate, nothing said
    assert "schema" not in dit, dit
    assert "engine ready: streamvox DiT, preset tiny;" in dit, dit
