"""The autoscaler's metric must exist in the real server's /metrics, not just in YAML.

Starts the real server as a subprocess (the same `serve` command the images run, tiny
preset on CPU), waits for /readyz, scrapes /metrics, and checks that every series the
HorizontalPodAutoscaler depends on (through the prometheus-adapter rule) is exposed, and
as a gauge with `namespace`/`pod`-free labels the adapter can attach. Then SIGTERMs it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_deploy_kubernetes import (  # tests/ is on sys.path (rootdir-less tests, as engine_helpers)
    BASE,
    hpa_series,
    objects,
)

ROOT = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"listening on (http://\S+:\d+)")
STARTUP_TIMEOUT_S = 120.0


class Server:
    """`python -m clients.cli serve` on an ephemeral port; stderr is collected by a thread."""

    def __init__(self, data_dir: Path):
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMVOX_")}  # no leaked config
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clients.cli", "serve", "--preset", "tiny", "--device", "cpu",
             "--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir), "--drain-seconds", "2"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self.bound = threading.Event()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            match = LISTENING.search(line)
            if match and not self.bound.is_set():
                self.url = match.group(1)
                self.bound.set()
        self.bound.set()  # stderr closed: the process is gone; wake the waiter

    def log(self) -> str:
        return "".join(self.lines[-40:])

    def wait_ready(self, deadline: float) -> None:
        if not self.bound.wait(max(0.0, deadline - time.monotonic())) or self.url is None:
            pytest.fail(f"server never logged 'listening on http://HOST:PORT' (exit={self.proc.poll()}):\n{self.log()}")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} before /readyz:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # 503 while warming up, or not accepting yet
            time.sleep(0.5)
        pytest.fail(f"/readyz not 200 within {STARTUP_TIMEOUT_S:.0f} s:\n{self.log()}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the same signal Kubernetes and `docker stop` send
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def scrape(tmp_path_factory) -> str:
    server = Server(tmp_path_factory.mktemp("data"))
    try:
        server.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
            assert response.status == 200
            body = response.read().decode()
    finally:
        server.stop()
    return body


def test_hpa_series_appear_in_a_live_scrape(scrape):
    families = {family.name: family for family in text_string_to_metric_families(scrape)}
    series = hpa_series(objects(BASE))
    assert series == ["streamvox_queue_depth"]
    for name in series:
        assert name in families, f"{name} missing from /metrics; exposed: {sorted(families)}"
        family = families[name]
        # The adapter averages it per pod: it must be a gauge, one sample, a number.
        assert family.type == "gauge"
        assert len(family.samples) == 1
        sample = family.samples[0]
        assert sample.value >= 0
        # Prometheus adds namespace/pod at scrape time; a server-side label of the same
        # name would be renamed to exported_pod and break the adapter's resource mapping.
        assert not {"namespace", "pod"} & set(sample.labels)
