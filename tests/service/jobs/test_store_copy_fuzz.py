"""Property-based fuzzing (hypothesis) of what `streamvox migrate-store` and the job runner read
from a data dir: random job rows (any JSON or text in params, any value in any column) and
random voice files. The readers never raise on them; what they let through is a job the server
could have written (a 32-hex id, a known status, params a JSON object with a known
response_format) or a well-formed voice; the stores' row parser never raises either."""

from __future__ import annotations

import json
import sqlite3
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.jobs.store.base import STATUSES, job_from_record
from service.jobs.store.untrusted import read_jobs, read_voices
from service.synthesis.audio import CONTENT_TYPES

text = st.text(max_size=20)
any_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | text,
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                        max_leaves=8)
params = st.one_of(any_json.map(json.dumps), text,
                   st.fixed_dictionaries({"input": st.one_of(text, any_json)},
                                         optional={"response_format": st.one_of(st.sampled_from(
                                             [*CONTENT_TYPES, "wav/../x", "../../etc/passwd", "WAV"]), any_json)}
                                         ).map(json.dumps))
cell = st.one_of(st.none(), st.integers(min_value=-2**63, max_value=2**63 - 1), st.floats(), text, st.binary(max_size=8))
rows = st.lists(st.fixed_dictionaries({
    "id": st.one_of(st.text(alphabet="0123456789abcdef", min_size=32, max_size=32), text, cell),
    "status": st.one_of(st.sampled_from(STATUSES), cell),
    "params": st.one_of(params, cell),
    "created_at": st.one_of(st.floats(), cell),
    "frames_done": cell, "audio_size": cell, "owner": cell, "error": cell,
}), max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=rows, voice_meta=st.one_of(any_json.map(json.dumps), text), voice_tensors=st.binary(max_size=64))
def test_readers_never_raise_and_let_through_only_what_a_server_writes(rows, voice_meta, voice_tensors):
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        db = sqlite3.connect(data / "jobs.sqlite3")
        db.execute("CREATE TABLE jobs (id, status, params, created_at, started_at, finished_at, error, frames_done, "
                   "frames_total, owner, audio_size, attempts, lease_owner, lease_token)")
        for row in rows:
            db.execute(f"INSERT INTO jobs ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})", tuple(row.values()))
        db.commit()
        db.row_factory = sqlite3.Row
        for stored in db.execute("SELECT * FROM jobs").fetchall():  # what the runner and the API parse
            job = job_from_record(stored)
            assert job.corrupt or (isinstance(job.params, dict) and job.response_format in CONTENT_TYPES)
            job.to_json()
        db.close()
        (data / "voices").mkdir()
        (data / "voices" / "v.json").write_text(voice_meta)
        (data / "voices" / "v.safetensors").write_bytes(voice_tensors)
        jobs = list(read_jobs(data))
        assert len(jobs) == len(rows)
        for job, skipped in jobs:
            assert (job is None) != (skipped is None)
            if job is not None:
                assert len(job.id) == 32 and job.status in STATUSES and isinstance(job.params, dict)
                assert job.response_format in CONTENT_TYPES and isinstance(job.params["input"], str)
            else:
                assert skipped.reason
        voices = list(read_voices(data))
        assert len(voices) == 1 and voices[0][0] is None and voices[0][1].reason  # random tensors never load
