"""Shared fixtures: a real server on 127.0.0.1 with an ephemeral port.

* ``engine`` (module scope): the real tiny engine on CPU, started once per test module.
* ``start_server(engine, data_dir, **settings)``: the aiohttp app on a real TCP socket
  (testsupport/server.py, which benchmarks use too; importable from here as before).
* ``ServerProcess``: ``python -m clients.cli serve`` as a subprocess, for restart,
  drain and signal tests; ``serving(...)``: one listening for a block, which fails the test if
  the server died meanwhile.
* The tiny DiT's modules (``tiny_dit_models``), the oracle checkpoints' engines (``base_engine``,
  ``talker_engine``, ``unwarmed_talker_engine``, ``aligned_talker``, ``aligned_engine``), a job
  store of each kind (``job_store``, ``store_settings``, on the session's PostgreSQL) and a TLS
  certificate (``tls_files``): one definition each, for every test module that needs one.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest

from testsupport.server import LiveServer, start_server  # noqa: F401  (tests import them from here)

REPO = Path(__file__).resolve().parents[1]


# On a 2-core box, torch's intra-op thread pool spins against the server threads and
# subprocesses of the same test and multiplies CPU time several times over; the tiny
# models are fastest on one thread. One place sets it for the whole session (and for
# the subprocesses tests start, through OMP_NUM_THREADS).
TEST_TORCH_THREADS = 1
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_TORCH_THREADS))

# Hermetic: no test ever asks huggingface.co. With no model named, `serve` and `synthesize` look
# for the default Qwen3-TTS release; offline and with an empty cache (not the developer's
# ~/.cache/huggingface, which may hold the real model) they start on random weights at once, as
# every server test expects. Tests of the hub (tests/engines/checkpoints/test_model_hub.py) give their subprocesses
# their own HF_ENDPOINT / HF_HOME and clear HF_HUB_OFFLINE. Set before anything imports
# huggingface_hub, which reads these once.
HF_TEST_HOME = tempfile.mkdtemp(prefix="streamvox-test-hf-")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = HF_TEST_HOME
os.environ.pop("HF_HUB_CACHE", None)
os.environ.pop("HF_ENDPOINT", None)
os.environ.pop("HF_TOKEN", None)
for _name in ("STREAMVOX_MODEL", "STREAMVOX_CHECKPOINT"):  # a developer's own default must not leak in
    os.environ.pop(_name, None)
atexit.register(shutil.rmtree, HF_TEST_HOME, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    import torch

    torch.set_num_threads(TEST_TORCH_THREADS)


def make_engine(max_queue: int = 64):
    """The real tiny engine on CPU."""
    from engines.build import build_engine
    from engines.config import EngineConfig

    return build_engine(EngineConfig.for_tests(max_queue=max_queue))


@pytest.fixture(scope="module")
def engine():
    engine = make_engine()
    engine.start()
    yield engine
    engine.stop()


def same_pcm16(a: bytes, b: bytes, lsb: int = 1) -> bool:
    """Two served PCM16 bodies are the same audio: the same length and within ``lsb`` steps (the
    promise: the same request and seed give the same audio within 1 LSB whatever else streams;
    the codec decodes on fixed windows, so its chunking cannot move a sample further)."""
    import numpy as np

    x, y = (np.frombuffer(v, dtype="<i2").astype(np.int32) for v in (a, b))
    return x.shape == y.shape and int(np.abs(x - y).max(initial=0)) <= lsb


@pytest.fixture
async def server(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data")
    yield live
    await live.stop()


async def metric_value(url: str, name: str, labels: str = "", headers: dict | None = None) -> float:
    """One sample from a live /metrics scrape (0.0 when absent)."""
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics", headers=headers) as response:
            text = await response.text()
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.eE+-]+|NaN)$", re.M)
    match = pattern.search(text)
    return float(match.group(1)) if match else 0.0


async def wait_until(predicate, timeout_s: float = 60.0, every_s: float = 0.05):
    """Poll a predicate (a function, or a coroutine function); fail the test (not hang it) when
    it never holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = predicate()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        await asyncio.sleep(every_s)
    raise AssertionError(f"condition not reached within {timeout_s} s")


async def finished_job(http: aiohttp.ClientSession, job_url: str, headers: dict | None = None,
                       timeout_s: float = 120.0) -> dict:
    """GET ``job_url`` until the job has ended (succeeded, failed or cancelled) -> its record."""
    seen: list[dict] = []

    async def ended() -> bool:
        async with http.get(job_url, headers=headers) as response:
            seen.append(await response.json())
        return seen[-1]["status"] in ("succeeded", "failed", "cancelled")

    await wait_until(ended, timeout_s=timeout_s)
    return seen[-1]


class ServerProcess:
    """``streamvox serve`` in a subprocess; stderr is collected by a thread (``reader=False``:
    only until it listens, then nobody reads it until :meth:`read_stderr`)."""

    def __init__(self, data_dir: Path, *extra_args: str, env: dict | None = None, reader: bool = True):
        cmd = [sys.executable, "-m", "clients.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--preset", "tiny",
               "--device", "cpu", "--data-dir", str(data_dir), *extra_args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(TEST_TORCH_THREADS), **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        self._listening = threading.Event()
        threading.Thread(target=self._read_stderr, args=(reader,), daemon=True).start()

    def _read_stderr(self, to_the_end: bool = True) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                self.url = match.group(1)
                self._listening.set()
                if not to_the_end:
                    return

    def read_stderr(self) -> None:
        """Read stderr again from where a ``reader=False`` server's reading stopped."""
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def wait_listening(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not self._listening.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("server did not start:\n" + "".join(self.lines[-40:]))
        return self.url

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM and wait for the exit; killed when it takes longer than ``timeout_s``."""
        self.terminate()
        try:
            self.wait_exit(timeout_s)
        finally:
            self.kill()

    @property
    def log(self) -> str:
        return "".join(self.lines)


@contextmanager
def serving(data_dir: Path, *extra_args: str, env: dict | None = None):
    """A ServerProcess, listening; on leaving, the test fails if the server died meanwhile (the
    tail of its log in the message), and it is stopped."""
    server = ServerProcess(data_dir, *extra_args, env=env)
    try:
        server.wait_listening()
        yield server
        assert server.proc.poll() is None, "the server died:\n" + server.log[-4000:]
    finally:
        server.stop()


# -- PostgreSQL: one real server per test session, a fresh database per test --------

@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server started from the installed binaries (testsupport/postgres.py)."""
    from testsupport.postgres import start_postgres

    server = start_postgres()
    yield server
    server.cleanup()


@pytest.fixture
def pg_url(postgres) -> str:
    """The URL of a new, empty database on the session's server."""
    return postgres.create_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_settings(request) -> dict:
    """A server's job-store settings, once per store: SQLite under its data dir, or a fresh
    PostgreSQL database."""
    return {"jobs_db": request.getfixturevalue("pg_url")} if request.param == "postgresql" else {}


class FakeClock:
    """The stores' lease clock, moved by the test: leases expire when it says, not after a sleep."""

    def __init__(self):
        self.now = time.time()  # PostgreSQL keeps lease times as timestamps: start at a real one

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(params=["sqlite", "postgresql"])
async def job_store(request, tmp_path):
    """An open job store of each kind on a FakeClock (``job_store.clock``), the events it
    announced kept in ``job_store.events``."""
    from service.jobs.store.postgres import PostgresJobStore
    from service.jobs.store.sqlite import SqliteJobStore

    clock = FakeClock()
    if request.param == "sqlite":
        opened = SqliteJobStore(tmp_path / "data", clock=clock)
    else:
        opened = PostgresJobStore(request.getfixturevalue("pg_url"), pool_size=4, clock=clock)
    events: list[tuple[str, str | None]] = []
    opened.set_listener(lambda event, job_id: events.append((event, job_id)))
    await opened.open()
    opened.events, opened.clock = events, clock
    yield opened
    await opened.close()


@pytest.fixture(scope="module")
def base_engine():
    """A Base (voice-cloning) release on the oracle fixture checkpoint, shared by a module."""
    from engines.build import build_engine
    from engines.config import EngineConfig
    from tests.oracle import clone_fixtures

    engine = build_engine(EngineConfig.for_tests(checkpoint=str(clone_fixtures.checkpoint_dir("base")), max_slots=4))
    engine.start()  # warm-up included: a Base release warms up with a neutral x-vector
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def talker_engine():
    """A CustomVoice talker on the oracle fixture checkpoint (cv_proj), shared by a module."""
    from engines.build import build_engine
    from engines.config import EngineConfig
    from tests.oracle import talker_fixtures

    engine = build_engine(EngineConfig.for_tests(checkpoint=str(talker_fixtures.checkpoint_dir("cv_proj"))))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def unwarmed_talker_engine():
    """``talker_engine`` without the warm-up request: started at once, its first request the test's."""
    from engines.build import build_engine
    from engines.config import EngineConfig
    from tests.oracle import talker_fixtures

    engine = build_engine(EngineConfig.for_tests(checkpoint=str(talker_fixtures.checkpoint_dir("cv_proj")),
                                                 warmup=False))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def tiny_dit_models():
    """The DiT pipeline's modules of the tiny preset on random weights (seed 0), on the CPU."""
    from engines.config import get_preset
    from engines.pipelines.dit.weights import build_models

    return build_models(get_preset("tiny"), seed=0)


ALIGNER = REPO / "tests" / "fixtures" / "aligner" / "tiny"  # the random aligner scripts/aligner-oracle-env.sh makes


@pytest.fixture(scope="module")
def aligned_talker():
    """The talker oracle fixture (cv_proj) with the random forced aligner: word times of talker
    utterances (long text planned as several, long jobs)."""
    if not (ALIGNER / "config.json").exists():
        pytest.fail("no aligner fixture: run `bash scripts/aligner-oracle-env.sh` (builds tests/fixtures/aligner)")
    from engines.build import build_engine
    from engines.config import EngineConfig
    from tests.oracle import talker_fixtures

    engine = build_engine(EngineConfig.for_tests(checkpoint=str(talker_fixtures.checkpoint_dir("cv_proj")),
                                                 aligner=str(ALIGNER), warmup=False))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def aligned_engine():
    """The tiny DiT engine with the random forced aligner: word timestamps on every surface."""
    if not (ALIGNER / "config.json").exists():
        pytest.fail("no aligner fixture: run `bash scripts/aligner-oracle-env.sh` (builds tests/fixtures/aligner)")
    from engines.build import build_engine
    from engines.config import EngineConfig

    engine = build_engine(EngineConfig.for_tests(aligner=str(ALIGNER)))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key (clients trust it through
    SSL_CERT_FILE, as a user trusts a private CA)."""
    if shutil.which("openssl") is None:
        if os.environ.get("CI"):
            pytest.fail("openssl is needed to make the TLS test certificate")
        pytest.skip("openssl is not installed (needed to make a TLS test certificate)")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return cert, key
