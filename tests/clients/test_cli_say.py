"""The CLI against a real server on 127.0.0.1, run as a user runs it (``python -m clients.cli``
subprocesses): every address form reaches the server from `say` (WebSocket) and the REST
commands, plain and over TLS; a malformed address is one line and exit 2 in every command
that talks to a server; an empty `say` is an error, not a silent WAV; `say` says when the
server runs random weights; the real-time factor printed is wall seconds per audio second."""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import soundfile as sf
from conftest import REPO, TEST_TORCH_THREADS, start_server

from clients.address import AddressError, parse_address
from clients.client import StreamvoxClient

# Every command that talks to a server, with arguments that are valid but for --url.
SERVER_COMMANDS = {
    "say": ["say", "Hello."],
    "say --stdin": ["say", "--stdin"],
    "submit": ["submit", "Hello."],
    "jobs": ["jobs"],
    "fetch": ["fetch", "0" * 32],
}


async def run_cli(*args: str, stdin: bytes = b"", env: dict | None = None, cwd: Path = REPO):
    """``python -m clients.cli ARGS`` -> (exit code, stdout, stderr); asynchronous, so the server
    in this test's event loop keeps serving while it runs."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("STREAMVOX_URL", "STREAMVOX_API_KEY")}
    full_env = {**inherited, "OMP_NUM_THREADS": str(TEST_TORCH_THREADS), "PYTHONPATH": str(REPO), **(env or {})}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "clients.cli", *args, cwd=cwd, env=full_env, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(stdin), timeout=120)
    return proc.returncode, stdout.decode(), stderr.decode()


def assert_one_line_error(rc: int, stderr: str, prefix: str, code: int) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert rc == code and len(lines) == 1 and lines[0].startswith(prefix), (rc, stderr)
    return lines[0]


# -- the address forms, parsed (no network) ------------------------------------------------------

@pytest.mark.parametrize("address, http, ws", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000", "ws://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000", "ws://127.0.0.1:8000"),
    ("https://tts.example.com", "https://tts.example.com", "wss://tts.example.com"),
    ("ws://127.0.0.1:8000", "http://127.0.0.1:8000", "ws://127.0.0.1:8000"),
    ("wss://tts.example.com:8443/", "https://tts.example.com:8443", "wss://tts.example.com:8443"),
    ("127.0.0.1:8000", "http://127.0.0.1:8000", "ws://127.0.0.1:8000"),
    ("localhost:8000/", "http://localhost:8000", "ws://localhost:8000"),
    ("  localhost:8000  ", "http://localhost:8000", "ws://localhost:8000"),
    ("ws://127.0.0.1:8000/v1/stream", "http://127.0.0.1:8000", "ws://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000", "ws://127.0.0.1:8000"),  # an OpenAI base_url
    ("https://proxy.example/tts/", "https://proxy.example/tts", "wss://proxy.example/tts"),  # a mount prefix
    ("wss://proxy.example/tts/v1/stream", "https://proxy.example/tts", "wss://proxy.example/tts"),
    ("HTTP://Host:80", "http://Host:80", "ws://Host:80"),
    ("[::1]:8000", "http://[::1]:8000", "ws://[::1]:8000"),
    ("http://[::1]:8000/", "http://[::1]:8000", "ws://[::1]:8000"),
    ("tts_service:8000", "http://tts_service:8000", "ws://tts_service:8000"),  # a compose service name
])
def test_address_forms_give_the_http_and_websocket_bases(address, http, ws):
    parsed = parse_address(address)
    assert (parsed.http, parsed.ws) == (http, ws)
    assert parsed.stream_url == ws + "/v1/stream"


@pytest.mark.parametrize("address, reason", [
    ("", "empty"),
    ("   ", "empty"),
    ("ftp://127.0.0.1:8000", "unsupported scheme 'ftp'"),
    ("file:///tmp/x", "unsupported scheme 'file'"),
    ("127.0.0.1", "give the port"),
    ("localhost", "give the port"),
    ("http//localhost", "give the port"),  # a typo'd scheme is not a host named `http`
    ("http:/localhost:8000", "is not a server address"),
    ("http:127.0.0.1:8000", "is not a server address"),
    ("127.0.0.1:http", "is not a server address"),
    ("http://:8000", "is not a server address"),
    ("http://", "is not a server address"),
    ("::1", "is not a server address"),
    ("http://h:8000/a b", "is not a server address"),
    ("-h:8000", "is not a server address"),
    ("127.0.0.1:99999", "out of range"),
    ("127.0.0.1:0", "out of range"),
    ("http://user:secret@h:8000", "credentials in the server address"),
    ("http://h:8000/?token=x", "no query or fragment"),
    ("h:8000#x", "no query or fragment"),
])
def test_anything_else_is_refused_with_the_reason(address, reason):
    with pytest.raises(AddressError) as caught:
        parse_address(address)
    message = str(caught.value)
    assert reason in message and "\n" not in message
    assert "secret" not in message  # a password is never printed back


def test_the_clients_real_time_factor_is_wall_seconds_per_audio_second():
    from clients.client import StreamResult, Utterance

    two_seconds = Utterance(0, "x", bytearray(2 * 48000))  # 48,000 int16 samples at 24 kHz
    result = StreamResult(24000, [two_seconds], [], 0.1, wall_s=0.5)
    assert result.audio_seconds == 2.0
    assert result.real_time_factor == 0.25 and result.times_real_time == 4.0


def test_the_client_uses_the_same_parser():
    client = StreamvoxClient("127.0.0.1:8000/")
    assert (client.url, client.ws_url) == ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/v1/stream")
    with pytest.raises(AddressError):
        StreamvoxClient("ftp://127.0.0.1:8000")


# -- every form against real servers ----------------------------------------------------------------

def plain_forms(host: str, port: int) -> list[str]:
    return [f"http://{host}:{port}", f"http://{host}:{port}/", f"ws://{host}:{port}", f"ws://{host}:{port}/v1/stream",
            f"{host}:{port}", f"{host}:{port}/", f"http://{host}:{port}/v1"]


def tls_forms(host: str, port: int) -> list[str]:
    return [f"https://{host}:{port}", f"wss://{host}:{port}/"]


async def test_every_address_form_works_in_say_and_the_rest_commands(engine, tmp_path, tls_files):
    cert, key = tls_files
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    plain = await start_server(engine, tmp_path / "plain")
    tls = await start_server(engine, tmp_path / "tls", ssl_context=context)
    env = {"SSL_CERT_FILE": str(cert)}
    try:
        forms = [(form, plain) for form in plain_forms(plain.host, plain.port)]
        forms += [(form, tls) for form in tls_forms(tls.host, tls.port)]
        job_ids = {}
        for form, server in forms:
            out = tmp_path / f"say-{len(job_ids)}.wav"
            rc, stdout, stderr = await run_cli("say", "Hello there.", "--url", form, "--out", str(out), env=env)
            assert rc == 0 and "Traceback" not in stderr, (form, stderr)
            audio, rate = sf.read(out, dtype="int16")
            assert rate == 24000 and len(audio) > 0 and len(audio) % 1920 == 0, form
            assert stdout.startswith(f"wrote {out}"), stdout

            rc, stdout, stderr = await run_cli("submit", "A job.", "--wait", "--quiet", "--url", form, env=env)
            assert rc == 0 and "Traceback" not in stderr, (form, stderr)
            job_id = stdout.strip()
            assert re.fullmatch(r"[0-9a-f]{32}", job_id), stdout
            job_ids[form] = job_id

            rc, stdout, stderr = await run_cli("jobs", "--url", form, env=env)
            assert rc == 0 and job_id in stdout and "succeeded" in stdout, (form, stdout, stderr)
            rc, stdout, stderr = await run_cli("jobs", job_id, "--url", form, env=env)
            assert rc == 0 and json.loads(stdout)["status"] == "succeeded", (form, stderr)

            out = tmp_path / f"job-{len(job_ids)}.wav"
            rc, stdout, stderr = await run_cli("fetch", job_id, "--url", form, "--out", str(out), env=env)
            assert rc == 0, (form, stderr)
            audio, rate = sf.read(out, dtype="int16")
            assert rate == 24000 and len(audio) > 0, form
        # each form reached its own server: the TLS server ran the TLS forms' jobs, the plain one the rest
        async with StreamvoxClient(plain.url) as client:
            on_plain = {job["id"] for job in await client.list_jobs()}
        assert on_plain == {job_ids[form] for form, server in forms if server is plain}
    finally:
        await plain.stop()
        await tls.stop()


async def test_https_to_an_untrusted_certificate_is_one_line(engine, tmp_path, tls_files):
    cert, key = tls_files
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    tls = await start_server(engine, tmp_path / "tls", ssl_context=context)
    try:  # no SSL_CERT_FILE: the self-signed certificate is not trusted
        for args in (["say", "Hello."], ["jobs"]):
            rc, _, stderr = await run_cli(*args, "--url", tls.url, env={"SSL_CERT_FILE": os.devnull})
            line = assert_one_line_error(rc, stderr, f"streamvox {args[0]}: cannot reach {tls.url}", 1)
            assert "certificate" in line
        # a plain-HTTP client speaking to TLS and TLS to plain HTTP: one line each, no traceback
        rc, _, stderr = await run_cli("jobs", "--url", f"http://{tls.host}:{tls.port}")
        assert rc == 1 and "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr
    finally:
        await tls.stop()


@pytest.mark.parametrize("address", ["ftp://127.0.0.1:8000", "127.0.0.1", "127.0.0.1:99999", "http//x", ""])
async def test_a_malformed_address_is_one_line_and_exit_2_in_every_server_command(address, tmp_path):
    for name, args in SERVER_COMMANDS.items():
        rc, stdout, stderr = await run_cli(*args, "--url", address, stdin=b"Hello.", cwd=tmp_path)
        assert_one_line_error(rc, stderr, f"streamvox {args[0]}: --url ", 2)
        assert stdout == "" and not list(tmp_path.iterdir()), name  # nothing written


async def test_the_address_can_come_from_the_environment(server, tmp_path):
    bare = f"{server.host}:{server.port}/"
    out = tmp_path / "env.wav"
    rc, _, stderr = await run_cli("say", "Hello.", "--out", str(out), env={"STREAMVOX_URL": bare})
    assert rc == 0, stderr
    assert sf.info(str(out)).frames > 0


async def test_a_server_that_is_not_there_is_one_line(tmp_path):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for args in (["say", "Hi."], ["jobs"]):
        rc, _, stderr = await run_cli(*args, "--url", f"ws://127.0.0.1:{port}", cwd=tmp_path)
        line = assert_one_line_error(rc, stderr, f"streamvox {args[0]}: cannot reach http://127.0.0.1:{port}", 1)
        assert "connection refused" in line


# -- empty input --------------------------------------------------------------------------------------

async def test_say_with_nothing_to_say_is_an_error_not_an_empty_wav(server, tmp_path):
    out = tmp_path / "empty.wav"
    cases = [(["say", "--stdin"], b""), (["say", "--stdin"], b"  \n\t \n"), (["say", "   "], b""),
             (["say", "-"], b" \n\n")]
    for args, stdin in cases:
        rc, stdout, stderr = await run_cli(*args, "--url", server.url, "--out", str(out), stdin=stdin)
        line = assert_one_line_error(rc, stderr, "streamvox say: ", 2)
        assert "no text" in line and stdout == "", (args, stdin)
        assert not out.exists(), (args, stdin)
    # and text after leading whitespace is still spoken
    rc, _, stderr = await run_cli("say", "--stdin", "--url", server.url, "--out", str(out), stdin=b"\n  Hello there.\n")
    assert rc == 0, stderr
    assert sf.info(str(out)).frames > 0


# -- random weights, real-time factor ---------------------------------------------------------------

async def test_say_says_when_the_server_runs_random_weights(engine, server, tmp_path, monkeypatch):
    out = tmp_path / "random.wav"
    for args, stdin in ((["say", "Hello there."], b""), (["say", "--stdin"], b"Hello there.")):
        rc, _, stderr = await run_cli(*args, "--url", server.url, "--out", str(out), stdin=stdin)
        assert rc == 0, stderr
        notes = [line for line in stderr.splitlines() if "random weights" in line]
        assert len(notes) == 1 and "noise, not speech" in notes[0], stderr
        for component in engine.info.random_components:
            assert component in notes[0]
    # a server whose components are all trained: no such line
    monkeypatch.setattr(engine, "info", replace(engine.info, random_components=()))
    rc, _, stderr = await run_cli("say", "Hello there.", "--url", server.url, "--out", str(out))
    assert rc == 0 and "random" not in stderr, stderr


async def test_say_prints_the_real_time_factor_as_wall_per_audio_seconds(server, tmp_path):
    out = tmp_path / "rtf.wav"
    rc, stdout, stderr = await run_cli("say", "Hello there. How are you today?", "--url", server.url, "--out", str(out))
    assert rc == 0, stderr
    match = re.search(r"(\d+\.\d+) s audio .* real-time factor (\d+\.\d+) \((\d+\.\d)x faster than real time\)", stdout)
    assert match, stdout
    audio_s, rtf, times = (float(group) for group in match.groups())
    assert audio_s == pytest.approx(sf.info(str(out)).duration, abs=0.01)
    assert abs(1 / times - rtf) <= 0.006  # the two are inverses (rtf printed to 2 decimals) ...
    assert rtf < 1.0  # ... and the tiny model on CPU is faster than real time: RTF below 1, not above
