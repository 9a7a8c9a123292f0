"""The CLI as a new user first meets it (real subprocesses, a real server where one is needed):
a bare `streamvox` shows the help, `--version` answers, a mistyped flag is one line that names
the flag meant, every failure is `streamvox COMMAND: ...` (one style), a refused or missing API
key names `--api-key` and `STREAMVOX_API_KEY`, and a closed stdout (`| head`) ends quietly."""

from __future__ import annotations

import asyncio
import os
import sys
import tomllib

from conftest import REPO, TEST_TORCH_THREADS, start_server
from test_cli_say import assert_one_line_error, run_cli

COMMANDS = ("serve", "synthesize", "download", "say", "submit", "jobs", "fetch", "migrate-store", "export",
            "build-engines")


async def test_a_bare_call_shows_the_help_and_version_answers():
    rc, stdout, stderr = await run_cli()
    assert rc == 0 and stderr == "", stderr
    assert stdout.startswith("usage: streamvox ")
    assert all(command in stdout for command in COMMANDS) and "--version" in stdout
    rc, stdout, stderr = await run_cli("--version")
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert (rc, stdout, stderr) == (0, f"streamvox {version}\n", "")


async def test_a_mistyped_flag_is_one_line_naming_the_flag_meant(tmp_path):
    rc, stdout, stderr = await run_cli("say", "Hello.", "--otu", str(tmp_path / "x.wav"))
    line = assert_one_line_error(rc, stderr, "streamvox say: unrecognized arguments: --otu", 2)
    assert "did you mean --out?" in line and "`streamvox say --help`" in line and stdout == ""
    rc, _, stderr = await run_cli("serve", "--max-imput-chars", "10")  # serve's usage alone is 47 lines
    line = assert_one_line_error(rc, stderr, "streamvox serve: unrecognized arguments: --max-imput-chars", 2)
    assert "--max-input-chars?" in line
    rc, _, stderr = await run_cli("synthesize", "--text", "Hi.")  # argparse's own errors: the same one line
    assert_one_line_error(rc, stderr, "streamvox synthesize: the following arguments are required: --out", 2)
    rc, _, stderr = await run_cli("sya", "Hello.")
    assert_one_line_error(rc, stderr, "streamvox: argument COMMAND: invalid choice: 'sya'", 2)


async def test_every_failure_has_one_style(tmp_path):
    """`synthesize`, which runs in-process, says `streamvox synthesize:` as `say` says `streamvox say:`."""
    rc, _, stderr = await run_cli("synthesize", "--preset", "tiny", "--device", "cpu", "--text", "Hi.",
                                  "--out", str(tmp_path / "x.wav"), "--voice", "nobody")
    assert rc == 2 and "Traceback" not in stderr  # after the model's lines, the failure's
    assert stderr.splitlines()[-1].startswith("streamvox synthesize: voice: unknown voice"), stderr
    rc, _, stderr = await run_cli("synthesize", "--preset", "tiny", "--device", "cpu", "--text", " ",
                                  "--out", str(tmp_path / "x.wav"))
    assert_one_line_error(rc, stderr, "streamvox synthesize: text: ", 2)
    rc, _, stderr = await run_cli("migrate-store", "--data-dir", str(tmp_path / "nothing"))
    assert_one_line_error(rc, stderr, "streamvox migrate-store: ", 2)


async def test_an_unauthorized_call_names_the_key_flag_and_variable(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", api_keys=("right-key",))
    out = tmp_path / "x.wav"
    try:
        for command in (["say", "Hello."], ["say", "--stdin"], ["jobs"], ["submit", "A job."]):
            rc, _, stderr = await run_cli(*command, "--url", live.url, "--out", str(out), stdin=b"Hello.") \
                if command[0] == "say" else await run_cli(*command, "--url", live.url)
            line = assert_one_line_error(rc, stderr, f"streamvox {command[0]}: the server needs an API key", 1)
            assert "--api-key" in line and "STREAMVOX_API_KEY" in line, line
            rc, _, stderr = await run_cli(*command, "--url", live.url, "--api-key", "wrong-key",
                                          *(["--out", str(out)] if command[0] == "say" else []), stdin=b"Hello.")
            line = assert_one_line_error(rc, stderr, f"streamvox {command[0]}: the server refused the API key", 1)
            assert "--api-key" in line and "STREAMVOX_API_KEY" in line, line
        assert not out.exists()
        rc, _, stderr = await run_cli("say", "Hello.", "--url", live.url, "--out", str(out),
                                      env={"STREAMVOX_API_KEY": "right-key"})
        assert rc == 0 and out.exists(), stderr
    finally:
        await live.stop()


async def run_into_closed_pipe(*args: str, env: dict | None = None) -> tuple[int, str]:
    """The CLI with a stdout whose reader has gone (`streamvox jobs | head -1` once head exits)
    -> (exit code, stderr)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    full_env = {**os.environ, "OMP_NUM_THREADS": str(TEST_TORCH_THREADS), "PYTHONPATH": str(REPO), **(env or {})}
    try:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "clients.cli", *args, cwd=REPO, env=full_env,
                                                    stdout=write_end, stderr=asyncio.subprocess.PIPE)
    finally:
        os.close(write_end)
    _, stderr = await asyncio.wait_for(proc.communicate(), timeout=120)
    return proc.returncode, stderr.decode()


async def test_a_closed_stdout_ends_quietly(server, tmp_path):
    rc, stdout, stderr = await run_cli("submit", "A job.", "--wait", "--quiet", "--url", server.url)
    assert rc == 0, stderr
    cases = [(["jobs", "--url", server.url], {}),  # printed at exit (stdout is block-buffered on a pipe) ...
             (["jobs", "--url", server.url], {"PYTHONUNBUFFERED": "1"}),  # ... or while the server is talked to
             (["say", "Hello.", "--url", server.url, "--out", str(tmp_path / "x.wav")], {})]
    for args, env in cases:
        rc, stderr = await run_into_closed_pipe(*args, env=env)
        said = [line for line in stderr.splitlines() if not line.startswith("note: ")]  # say's random-weights note
        assert (rc, said) == (141, []), (args, env, rc, stderr)  # 128 + SIGPIPE, as `ls | head` in a shell
    for args in (["--help"], ["--version"]):  # argparse itself ignores a failed write of its own: 0 or 141
        rc, stderr = await run_into_closed_pipe(*args)
        assert rc in (0, 141) and stderr == "", (args, rc, stderr)
