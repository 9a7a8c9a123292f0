"""`streamvox say "text" --out x.wav`: stream over WebSocket, report TTFA and real-time factor."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from .errors import CommandError, fail

DEFAULT_URL = "http://127.0.0.1:8000"


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """--url / --api-key, shared by every command that talks to a server."""
    parser.add_argument("--url", default=os.environ.get("STREAMVOX_URL", DEFAULT_URL),
                        help=f"the server: http(s)://HOST:PORT, ws(s)://HOST:PORT or HOST:PORT, with or without a "
                             f"path [env STREAMVOX_URL; default {DEFAULT_URL}]")
    parser.add_argument("--api-key", default=os.environ.get("STREAMVOX_API_KEY"),
                        help="API key sent as a Bearer token [env STREAMVOX_API_KEY]")


def register(subparsers) -> None:
    parser = subparsers.add_parser("say", help="speak text through a running server (WebSocket)")
    parser.add_argument("text", nargs="?", default=None, help="text to speak ('-' reads stdin)")
    parser.add_argument("--stdin", action="store_true",
                        help="stream stdin as it arrives (`llm ... | streamvox say --stdin`): on a talker "
                             "server speech starts while the text is still being written")
    parser.add_argument("--out", default="say.wav",
                        help="output audio file, its format from the extension: .wav, .flac, .mp3, .ogg or .opus "
                             "(Ogg Opus), .aac, .pcm (raw 16-bit, 24 kHz mono) (default say.wav)")
    parser.add_argument("--voice", default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--guidance-scale", type=float, default=None)
    parser.add_argument("--speed", type=float, default=None)
    parser.add_argument("--temperature", type=float, default=None,
                        help="talker sampling temperature (0 = greedy; default: the checkpoint's)")
    add_connection_arguments(parser)
    parser.set_defaults(func=run)


def call_server(args: argparse.Namespace, action):
    """``await action(client)`` against ``args.url``: (0, its result), or (exit code, None)
    after printing one line saying why: a malformed address (2, before any I/O), a server
    error, the server cannot be reached, or an action's own ``CommandError`` (1)."""
    import aiohttp
    import websockets

    from clients.address import AddressError, parse_address
    from clients.client import StreamvoxClient, StreamvoxError

    try:
        address = parse_address(args.url)
    except AddressError as exc:
        return fail(args.command, f"--url {exc}"), None

    async def go():
        async with StreamvoxClient(address.http, api_key=args.api_key) as client:
            return await action(client)

    where = address.http
    try:
        return 0, asyncio.run(go())
    except CommandError as exc:
        return fail(args.command, exc, exc.code), None
    except StreamvoxError as exc:
        return fail(args.command, key_refused(args) if exc.code == "unauthorized" else exc, 1), None
    except BrokenPipeError:  # our stdout's reader went away (`| head`): not the server's fault
        raise
    except OSError as exc:
        return fail(args.command, f"cannot reach {where}: {connection_problem(exc)}", 1), None
    except websockets.InvalidStatus as exc:  # e.g. 404: a path prefix the server is not mounted at
        if exc.response.status_code == 401:
            return fail(args.command, key_refused(args), 1), None
        return fail(args.command, f"{where} refused the WebSocket: HTTP {exc.response.status_code} "
                                  f"(is it a streamvox server, at that path?)", 1), None
    except (websockets.WebSocketException, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return fail(args.command, f"talking to {where} failed: {exc or type(exc).__name__}", 1), None


def key_refused(args: argparse.Namespace) -> str:
    """A 401 in words that name where the key comes from."""
    if not args.api_key:
        return "the server needs an API key: pass --api-key KEY or set STREAMVOX_API_KEY"
    return "the server refused the API key (unauthorized): check --api-key or STREAMVOX_API_KEY"


def connection_problem(exc: OSError) -> str:
    """Why a connection failed, in words: the OS error's text (``Connection refused``), not
    aiohttp's wrapper with its ``ssl:default [Connect call failed (...)]`` internals."""
    import ssl

    root = getattr(exc, "os_error", None) or exc  # aiohttp.ClientConnectorError keeps the OSError
    if isinstance(root, ConnectionRefusedError) or root.errno == 111:
        return "connection refused (is `streamvox serve` running there?)"
    if isinstance(root, TimeoutError):  # an OSError too, mostly without an errno or text
        return "no answer in time"
    if isinstance(root, ssl.SSLCertVerificationError):
        return f"its TLS certificate is not trusted: {root.verify_message or root.reason}"
    if isinstance(root, ssl.SSLError):  # most often https:// or wss:// to a plain-HTTP server
        return f"TLS failed: {root.reason or root} (does the server speak https, or plain http://?)"
    return root.strerror or str(root)


def synthesis_config(args: argparse.Namespace) -> dict:
    return {key: value for key, value in {"voice": args.voice, "seed": args.seed, "steps": args.steps,
                                          "guidance_scale": args.guidance_scale, "speed": args.speed,
                                          "temperature": args.temperature}.items()
            if value is not None}


async def random_weights_note(client) -> str | None:
    """One line for stderr when the server runs untrained components (``GET /v1/models`` ->
    ``random_components``): without it a user hears noise and blames the audio path."""
    models = (await client.models()).get("data") or [{}]
    random_components = models[0].get("random_components") or []
    if not random_components:
        return None
    return (f"note: the server runs random weights ({', '.join(random_components)}): "
            "the audio is noise, not speech")


NO_TEXT = "no text to speak (the input is empty or only whitespace)"


def run(args: argparse.Namespace) -> int:
    if args.stdin:
        return run_stdin(args)
    if args.text is None:
        return fail(args.command, "give the text, '-' (all of stdin) or --stdin (stream stdin)")

    text = sys.stdin.read() if args.text == "-" else args.text
    if not text.strip():
        return fail(args.command, NO_TEXT)
    out = checked_output(args)
    if out is None:
        return 2
    config = synthesis_config(args)

    async def action(client):
        note = await random_weights_note(client)
        if note:
            print(note, file=sys.stderr)
        return await client.say(text, **config)

    code, result = call_server(args, action)
    if code:
        return code
    if not write_output(args, out, result.pcm):
        return 1
    ttfa = f"{result.time_to_first_audio_s * 1000:.0f} ms" if result.time_to_first_audio_s is not None else "n/a"
    print(f"wrote {args.out}: {result.audio_seconds:.2f} s audio in {len(result.utterances)} utterance(s); "
          f"time to first audio {ttfa}; {rtf_words(result.wall_s, result.audio_seconds)}")
    return 0


def checked_output(args: argparse.Namespace):
    """``--out`` ready to be written in the format its extension names (its folder made), else
    None after one line on stderr."""
    from clients.commands.output_file import OutputError, audio_file

    try:
        return audio_file(args.out)
    except OutputError as exc:
        fail(args.command, exc)
        return None


def write_output(args: argparse.Namespace, out, pcm) -> bool:
    """The audio file; False after one line on stderr when it cannot be written (disk full...)."""
    from clients.commands.output_file import OutputError, write_audio

    try:
        write_audio(out, pcm)
        return True
    except OutputError as exc:
        fail(args.command, exc)
        return False


def rtf_words(wall_s: float, audio_s: float) -> str:
    """The real-time factor as the speech literature means it (wall seconds per audio second,
    lower is better, below 1 keeps up), with how much faster or slower than real time beside it."""
    from service.speed import real_time_words

    return real_time_words(wall_s / audio_s if audio_s > 0 else 0.0)


async def stdin_text(chunk_bytes: int = 256):
    """stdin as it arrives (a pipe from an LLM), decoded incrementally (UTF-8 split safely)."""
    import codecs

    loop = asyncio.get_running_loop()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd = sys.stdin.fileno()
    while True:
        data = await loop.run_in_executor(None, os.read, fd, chunk_bytes)
        text = decoder.decode(data, final=not data)
        if text:
            yield text
        if not data:
            return


def run_stdin(args: argparse.Namespace) -> int:
    """``--stdin``: text streamed from the pipe, audio written to ``--out`` when the pipe ends."""
    import time

    import numpy as np

    out = checked_output(args)
    if out is None:
        return 2
    config = synthesis_config(args)
    first_text: list[float] = []
    first_audio: list[float] = []

    async def action(client):
        note = await random_weights_note(client)  # asked first: an unreachable server fails before stdin is read

        async def timed_text():
            async for piece in stdin_text():
                if not first_text and piece.strip():
                    first_text.append(time.monotonic())
                    if note:  # said once there is something to speak (an empty pipe gets one error line)
                        print(note, file=sys.stderr)
                yield piece

        pieces = []
        async for pcm in client.stream_speech(timed_text(), **config):
            if not first_audio:
                first_audio.append(time.monotonic())
            pieces.append(pcm)
        if not first_text:  # the pipe closed with nothing to say: no file, not a silent WAV
            raise CommandError(NO_TEXT, code=2)
        return b"".join(pieces)

    code, pcm = call_server(args, action)
    if code:
        return code
    samples = np.frombuffer(pcm, dtype="<i2")
    if not write_output(args, out, samples):
        return 1
    lag = f"{(first_audio[0] - first_text[0]) * 1000:.0f} ms" if first_text and first_audio else "n/a"
    print(f"wrote {args.out}: {samples.size / 24000:.2f} s audio; first audio {lag} after the first text")
    return 0
