"""Models named by Hugging Face id, fetched from a real hub on 127.0.0.1 (testsupport/hub.py)
by the real `streamvox` commands, in subprocesses with their own HF_HOME and HF_ENDPOINT.

The repo is the tiny talker oracle checkpoint ``cv_proj`` in the official layout, plus what a
release carries beside the loaded files (a README, a preprocessor config, a 16 MiB unrelated
file) and, inside ``model.safetensors``, a 16 MiB tensor outside every loaded prefix (so the
weights file is big enough for huggingface_hub to resume it with a Range request: it writes
10 MiB chunks). The hub records every request: what was fetched is checked against it.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import REPO as ROOT
from conftest import ServerProcess
from testsupport.hub import LocalHub, read_dir

from engines.checkpoints.hub import ALLOW_PATTERNS, DEFAULT_MODEL, DEFAULT_PROBE_SECONDS
from tests.oracle import talker_fixtures as fx

REPO_ID = "streamvox-test/Qwen3-TTS-12Hz-tiny-CustomVoice"
GATED_ID = "streamvox-test/Qwen3-TTS-12Hz-tiny-gated"
TOKEN = "hf_streamvox_test_token"
CHUNK = 10 << 20  # huggingface_hub's DOWNLOAD_CHUNK_SIZE: what it keeps of a dropped transfer
UNRELATED = ("README.md", ".gitattributes", "speech_tokenizer/preprocessor_config.json", "original/consolidated.pth")


@pytest.fixture(scope="module")
def release() -> dict[str, bytes]:
    """The repo's files: cv_proj + a release's extras (none of which streamvox reads)."""
    import torch
    from safetensors.torch import load_file, save

    source = fx.checkpoint_dir("cv_proj")  # missing fixtures: skip, or fail under CI=true
    files = read_dir(source)
    tensors = load_file(str(source / "model.safetensors"))
    tensors["unused.padding"] = torch.zeros(4 << 20)  # 16 MiB outside every prefix a loader reads
    files["model.safetensors"] = save(tensors, metadata={"format": "pt"})
    files["README.md"] = b"---\nlicense: apache-2.0\n---\n# a tiny random Qwen3-TTS CustomVoice\n"
    files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    files["original/consolidated.pth"] = np.random.default_rng(0).bytes(16 << 20)
    assert "speech_tokenizer/preprocessor_config.json" in files
    return files


def loaded_files(files: dict[str, bytes]) -> set[str]:
    import fnmatch

    return {p for p in files if any(fnmatch.fnmatchcase(p, pattern) for pattern in ALLOW_PATTERNS)}


def hub_env(home: Path, endpoint: str, **extra: str) -> dict[str, str]:
    """A subprocess environment that reaches ``endpoint`` (conftest keeps the suite offline)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "STREAMVOX_"))}
    return {**env, "HF_HOME": str(home), "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1,localhost", "PYTHONUNBUFFERED": "1", **extra}


def streamvox(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clients.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def wait_ready(server: ServerProcess, timeout_s: float = 120) -> str:
    url = server.wait_listening(timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=10) as response:
                if response.status == 200:
                    return url
        except (urllib.error.URLError, ConnectionError):
            pass  # 503 while warming up
        assert server.proc.poll() is None, server.log
        time.sleep(0.2)
    raise AssertionError("/readyz never 200:\n" + server.log)


def speak(url: str, model: str) -> np.ndarray:
    """One real OpenAI-style speech request; the WAV read back with soundfile."""
    body = json.dumps({"model": model, "input": "Hello from the hub.", "voice": "default",
                       "response_format": "wav", "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/audio/speech", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        audio, rate = sf.read(io.BytesIO(response.read()), dtype="float32")
    assert rate == 24000
    assert len(audio) > 0 and len(audio) % 1920 == 0 and np.isfinite(audio).all()
    return audio


def stop(server: ServerProcess) -> None:
    server.terminate()
    try:
        assert server.wait_exit(60) == 0, server.log
    finally:
        server.kill()


def serve(tmp_path: Path, env: dict[str, str], *args: str) -> ServerProcess:
    return ServerProcess(tmp_path / "data", "--drain-seconds", "1", *args, env=env)


# --------------------------------------------------------------------------- named models

def test_serve_fetches_only_what_it_loads_resumes_a_dropped_file_and_speaks(release, tmp_path):
    home = tmp_path / "hf"
    with LocalHub() as hub:
        hub.add_repo(REPO_ID, release)
        hub.drop_once[(REPO_ID, "model.safetensors")] = CHUNK + (2 << 20)  # the first GET dies at 12 MiB
        server = serve(tmp_path, hub_env(home, hub.url), "--model", f"{REPO_ID}@main")
        try:
            url = wait_ready(server)
            speak(url, REPO_ID)  # the id is one of the served model names
            models = get_json(url + "/v1/models")["data"][0]
        finally:
            stop(server)
        log = hub.log(REPO_ID)
    assert models["source"] == "talker" and models["random_components"] == [] and REPO_ID in models["names"]

    # Only the files the loaders read, each fetched once (plus the resumed rest of the dropped one).
    expected = loaded_files(release)
    assert hub.files_fetched(REPO_ID) == expected
    assert expected >= {"config.json", "model.safetensors", "speech_tokenizer/model.safetensors", "vocab.json"}
    touched = {r["path"] for r in log if r["kind"] == "file"}
    assert not touched & set(UNRELATED), touched  # not even a HEAD for the extras
    weights = [r for r in log if r["method"] == "GET" and r["path"] == "model.safetensors"]
    assert [r["status"] for r in weights] == [200, 206], weights
    assert weights[0]["dropped_after"] == CHUNK + (2 << 20)
    assert weights[1]["range"] == f"bytes={CHUNK}-"  # resumed after the last whole chunk, not restarted
    # Progress as log lines (stderr is not a terminal here), then the cached snapshot is loaded.
    assert re.search(rf"{re.escape(REPO_ID)}@main: fetching from {re.escape(hub.url)}", server.log)
    assert re.search(rf"{re.escape(REPO_ID)}@main: downloaded [\d.]+MB of [\d.]+MB \(100%\)", server.log)
    snapshot = next(home.glob("hub/models--streamvox-test--Qwen3-TTS-12Hz-tiny-CustomVoice/snapshots/*"))
    assert {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()} == expected

    # A second start with the hub gone: the cached copy, one warning, the same voice.
    again = serve(tmp_path, hub_env(home, hub.url), "--model", f"{REPO_ID}@main")
    try:
        url = wait_ready(again)
        speak(url, REPO_ID)
    finally:
        stop(again)
    assert re.search(r"did not answer \(ConnectError.*\); using the cached copy", again.log), again.log
    assert "fetching" not in again.log


def test_download_then_offline_serve(release, tmp_path):
    home = tmp_path / "hf"
    with LocalHub() as hub:
        hub.add_repo(REPO_ID, release)
        done = streamvox("download", f"{REPO_ID}@main", env=hub_env(home, hub.url))
        fetched = hub.files_fetched(REPO_ID)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())  # stdout is only the directory: `$(streamvox download ...)` works
    assert path.is_dir() and path.is_relative_to(home / "hub") and (path / "config.json").is_file()
    assert fetched == loaded_files(release)
    # Hub stopped and HF_HUB_OFFLINE=1: served from the cache without trying the network.
    server = serve(tmp_path, hub_env(home, "http://127.0.0.1:9", HF_HUB_OFFLINE="1"), "--model", REPO_ID)
    try:
        url = wait_ready(server)
        models = get_json(url + "/v1/models")["data"][0]
    finally:
        stop(server)
    assert models["random_components"] == [] and REPO_ID in models["names"]
    assert f"{REPO_ID}: from the cache (HF_HUB_OFFLINE)" in server.log


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(release, tmp_path):
    script = shutil.which("script")  # util-linux: runs the command on a pseudo-terminal
    if script is None:
        pytest.skip("no `script` command to give the download a terminal")
    with LocalHub() as hub:
        hub.add_repo(REPO_ID, release)
        command = f"stty cols 120 rows 40; {sys.executable} -m clients.cli download {REPO_ID}"
        on_tty = subprocess.run([script, "-qec", command, "/dev/null"], cwd=ROOT, env=hub_env(tmp_path / "tty", hub.url),
                                capture_output=True, text=True, timeout=120)
        in_log = streamvox("download", REPO_ID, env=hub_env(tmp_path / "log", hub.url))
    assert on_tty.returncode == 0 and in_log.returncode == 0, on_tty.stdout + in_log.stderr
    assert re.search(r"Fetching \d+ files: 100%\|", on_tty.stdout), on_tty.stdout  # huggingface_hub's bars
    assert "downloaded" not in on_tty.stdout
    assert "%|" not in in_log.stderr and re.search(r": downloaded [\d.]+MB of [\d.]+MB \(100%\)", in_log.stderr)


def test_a_revision_pins_a_commit(release, tmp_path):
    """``@REVISION``: a tag, a branch or a commit sha; an unknown one is one line."""
    home = tmp_path / "hf"
    with LocalHub() as hub:
        repo = hub.add_repo(REPO_ID, release)
        old = repo.commits[repo.refs["main"]]
        newer = {**old, "generation_config.json": b'{"temperature": 0.5}'}
        tagged = repo.refs["main"]
        repo.refs["v1"] = tagged
        head = repo.add_commit(newer, "main")
        env = hub_env(home, hub.url)
        results = {rev: streamvox("download", f"{REPO_ID}@{rev}", env=env) for rev in ("v1", "main", tagged, "v9")}
        gets = len([r for r in hub.log(REPO_ID) if r["kind"] == "file" and r["method"] == "GET"])
        again = streamvox("download", f"{REPO_ID}@v1", env=env)  # all there: asks, fetches nothing
        assert len([r for r in hub.log(REPO_ID) if r["kind"] == "file" and r["method"] == "GET"]) == gets
    assert again.returncode == 0 and f"{REPO_ID}@v1: up to date in the cache" in again.stderr, again.stderr
    assert "fetching" not in again.stderr
    for rev, sha in (("v1", tagged), ("main", head), (tagged, tagged)):
        assert results[rev].returncode == 0, results[rev].stderr
        assert Path(results[rev].stdout.strip()).name == sha
    assert results["v9"].returncode == 2
    assert results["v9"].stderr.strip().splitlines()[-1] == (
        f"streamvox download: {REPO_ID}@v9: revision 'v9' not found on {hub.url} (404)")


@pytest.mark.parametrize("case", ["unknown", "gated", "refused"])
def test_a_named_model_that_cannot_be_had_is_one_line_and_a_failure(case, tmp_path, release):
    with LocalHub() as hub:
        hub.add_repo(GATED_ID, release, gated_token=TOKEN)
        model, endpoint = {"unknown": ("streamvox-test/no-such-model", hub.url), "gated": (GATED_ID, hub.url),
                           "refused": (REPO_ID, closed_port_url())}[case]
        started = time.monotonic()
        result = streamvox("serve", "--port", "0", "--data-dir", str(tmp_path / "data"), "--model", model,
                           env=hub_env(tmp_path / "hf", endpoint))
        took = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "listening on" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("streamvox serve:")]
    assert len(errors) == 1, result.stderr
    expected = {
        "unknown": f"streamvox serve: {model}: no such model on {endpoint} (404): check the id (ORG/NAME[@REVISION])",
        "gated": f"streamvox serve: {model} is gated on {endpoint} (401): it needs an access token; accept its "
                 f"terms at {endpoint}/{model} and set HF_TOKEN to a token of that account",
        "refused": f"streamvox serve: {model}: cannot reach the hub at {endpoint} (ConnectError: ",
    }[case]
    assert errors[0].startswith(expected), errors[0]
    assert took < 30


def test_a_gated_model_downloads_with_hf_token(release, tmp_path):
    with LocalHub() as hub:
        hub.add_repo(GATED_ID, release, gated_token=TOKEN)
        good = streamvox("download", GATED_ID, env=hub_env(tmp_path / "a", hub.url, HF_TOKEN=TOKEN))
        wrong = streamvox("download", GATED_ID, env=hub_env(tmp_path / "b", hub.url, HF_TOKEN="hf_wrong"))
    assert good.returncode == 0 and Path(good.stdout.strip(), "model.safetensors").is_file(), good.stderr
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines()[-1].startswith(
        f"streamvox download: {GATED_ID} is gated on {hub.url} (403): HF_TOKEN's account has no access")


# --------------------------------------------------------------------------- the default model

def test_no_model_named_fetches_the_default(release, tmp_path):
    home = tmp_path / "hf"
    with LocalHub() as hub:
        hub.add_repo(DEFAULT_MODEL, release)  # a mirror serving the tiny checkpoint under the default's id
        server = serve(tmp_path, hub_env(home, hub.url))
        try:
            url = wait_ready(server)
            speak(url, DEFAULT_MODEL)
            models = get_json(url + "/v1/models")["data"][0]
        finally:
            stop(server)
    assert models["source"] == "talker" and models["random_components"] == []
    assert DEFAULT_MODEL in models["names"]
    assert hub.files_fetched(DEFAULT_MODEL) == loaded_files(release)
    assert "RANDOM" not in server.log


def log_time(line: str) -> float:
    """The time of a server log line ("2026-01-01 12:00:00,123 INFO ...") in seconds."""
    from datetime import datetime

    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


class Blackhole:
    """A listener that takes connections and never answers (a hub behind a dropping firewall)."""

    def __enter__(self) -> str:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=16)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.sock.close()


def closed_port_url() -> str:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens there once closed


@pytest.mark.parametrize("case", ["not-on-hub", "gated", "blackholed", "no-dns", "offline"])
def test_no_model_named_and_no_default_to_be_had_serves_random_weights(case, tmp_path, release):
    with LocalHub() as hub, Blackhole() as blackhole:
        if case == "gated":
            hub.add_repo(DEFAULT_MODEL, release, gated_token=TOKEN)
        endpoint = {"blackholed": blackhole, "no-dns": "http://hub.streamvox-test.invalid"}.get(case, hub.url)
        extra = {"HF_HUB_OFFLINE": "1"} if case == "offline" else {}
        started = time.monotonic()
        server = serve(tmp_path, hub_env(tmp_path / "hf", endpoint, **extra))
        try:
            url = server.wait_listening(60)
            took = time.monotonic() - started
            models = get_json(url + "/v1/models")["data"][0]
        finally:
            stop(server)
    assert models["random_weights"] and models["random_components"], models
    assert DEFAULT_MODEL not in models["names"]
    lines = [line for line in server.lines if "streamvox.hub" in line]
    warnings = [line for line in lines if " WARNING " in line]
    assert len(warnings) == 1, lines  # one line says why
    if case != "gated":  # (the gated repo's info is public: a fetch is tried, and logged, first)
        assert lines == warnings
    assert "RANDOM weights" in warnings[0] and "--model" in warnings[0]
    reasons = {"not-on-hub": [f"no such model on {endpoint} (404)"], "gated": ["is gated"],
               "blackholed": [f"no answer within {DEFAULT_PROBE_SECONDS:g} s"],
               # a resolver that says "no such host" at once, or one that never answers
               "no-dns": ["ConnectError", "no answer within"], "offline": ["HF_HUB_OFFLINE is set"]}[case]
    assert any(reason in warnings[0] for reason in reasons), warnings[0]
    # bounded: from the server's first log line to the warning, the probe's few seconds at most
    # (log timestamps: the interpreter's start-up on a busy machine does not count)
    first = log_time(server.lines[0])
    assert log_time(warnings[0]) - first < DEFAULT_PROBE_SECONDS + 1.5, (first, warnings[0])
    assert took < DEFAULT_PROBE_SECONDS + 30, took
    assert not (tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-TTS-12Hz-0.6B-CustomVoice" / "snapshots").exists()


# --------------------------------------------------------------------------- what is fetched suffices

@pytest.mark.parametrize("kind", ["custom_voice", "base", "voice_design"])
def test_the_allowed_files_are_all_the_loaders_need(kind, tmp_path):
    """Every release kind loads from a copy holding only ALLOW_PATTERNS' files (and that copy
    lacks files the release has): what `download` skips is never read."""
    from engines.checkpoints.qwen3_tts import load_checkpoint, load_talker
    from engines.checkpoints.qwen3_voice import load_voice_encoders
    from tests.oracle import clone_fixtures as cfx

    source = {"custom_voice": lambda: fx.checkpoint_dir("cv_proj"), "base": lambda: cfx.checkpoint_dir("base"),
              "voice_design": lambda: cfx.checkpoint_dir("design")}[kind]()
    files = read_dir(source)
    keep = loaded_files(files)
    assert keep < set(files), "the fixture has nothing the filter leaves out"
    copy = tmp_path / kind
    for rel in keep:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / rel, copy / rel)
    parts = load_checkpoint(copy)
    talker = load_talker(copy, predictor=parts.predictor)
    assert talker.tokenizer.encode("Hello") and parts.config.num_code_groups > 0
    if kind == "base":  # voice cloning: the speaker encoder and the speech tokenizer's encoder too
        features = load_voice_encoders(copy).features(np.zeros(24000, np.float32))
        assert features.xvector.size and features.codes.size


# --------------------------------------------------------------------------- names

def test_model_names_parse_and_serve_under_their_id(tmp_path):
    from engines.checkpoints.hub import ModelId, ModelUnavailable, parse_model_id, resolve_model, served_name
    from service.synthesis.params import served_model_names

    assert parse_model_id("Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign") == ModelId("Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign")
    assert parse_model_id("Qwen/Qwen3-TTS-12Hz-0.6B-Base@v1.0") == ModelId("Qwen/Qwen3-TTS-12Hz-0.6B-Base", "v1.0")
    for not_an_id in ("/models/x", "x", "a/b/c", "a/b@", "a/b@c@d", "", "a b/c"):
        assert parse_model_id(not_an_id) is None, not_an_id
    assert served_name("Org/Name@abc") == "Org/Name" and served_name(None) is None
    local = tmp_path / "Org" / "Name@v2"
    local.mkdir(parents=True)
    assert resolve_model(str(local)) == local  # an existing path always wins over the id reading
    names = served_model_names("Org/Qwen3-TTS-12Hz-0.6B-Base")
    assert {"Org/Qwen3-TTS-12Hz-0.6B-Base", "Qwen3-TTS-12Hz-0.6B-Base", "Qwen/Qwen3-TTS-12Hz-0.6B-Base"} <= set(names)
    assert "/ckpt/dir" not in served_model_names("/ckpt/dir") and "dir" in served_model_names("/ckpt/dir")
    with pytest.raises(ModelUnavailable, match=r"^/no/such/dir: no such file or directory$"):
        resolve_model("/no/such/dir")
    with pytest.raises(ModelUnavailable, match=r"not a valid Hugging Face model id"):
        resolve_model("a--b/c")  # the hub's own rule, checked before any request


@pytest.mark.parametrize("name", ["x" * 5000, "org/name@" + "x" * 5000, "bad\udcffname", "a/b/c/d", "org/@"])
def test_a_hostile_model_name_is_one_line_and_a_failure(name, tmp_path):
    """Names no file system could hold (too long for a path), undecodable bytes, ids of the
    wrong shape: one line naming the problem, exit 2, no traceback (offline: nothing is fetched)."""
    env = {**hub_env(tmp_path / "hf", closed_port_url()), "HF_HUB_OFFLINE": "1"}
    result = streamvox("download", name, env=env, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("streamvox download:")]) == 1


def test_a_small_file_done_first_is_not_logged_as_the_whole_download(caplog):
    """huggingface_hub's byte bar grows its total as each file's download starts, in parallel, and
    says "incomplete total" meanwhile: a small file finished before the weights start must not be
    logged as 100 % (it once was, and the real end then went unlogged); the real end is."""
    import logging

    from engines.checkpoints.hub import _log_progress

    caplog.set_level(logging.INFO, logger="streamvox.hub")
    bar = _log_progress()(total=0, unit="B", unit_scale=True, desc="Reconstructing (incomplete total...)",
                          mininterval=0)
    bar.total += 2_000  # config.json starts and ends before the weights start
    bar.update(2_000)
    bar.total += 20_000_000
    bar.update(20_000_000)
    bar.set_description("Reconstruction complete")
    done = [r.getMessage() for r in caplog.records if "(100%)" in r.getMessage()]
    assert len(done) == 1 and re.search(r"downloaded [\d.]+MB of [\d.]+MB \(100%\)", done[0]), done
