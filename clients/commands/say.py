"""`streamvox say "text" --out x.wav`: stream over WebSocket, report TTFA and real-time factor."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

DEFAULT_URL = "http://127.0.0.1:8000"


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """--url / --api-key, shared with the jobs commands."""
    parser.add_argument("--url", default=os.environ.get("STREAMVOX_URL", DEFAULT_URL),
                        help=f"server base URL [env STREAMVOX_URL; default {DEFAULT_URL}]")
    parser.add_argument("--api-key", default=os.environ.get("STREAMVOX_API_KEY"),
                        help="API key sent as a Bearer token [env STREAMVOX_API_KEY]")


def register(subparsers) -> None:
    parser = subparsers.add_parser("say", help="speak text through a running server (WebSocket)")
    parser.add_argument("text", nargs="?", default=None, help="text to speak ('-' reads stdin)")
    parser.add_argument("--stdin", action="store_true",
                        help="stream stdin as it arrives (`llm ... | streamvox say --stdin`): on a talker "
                             "server speech starts while the text is still being written")
    parser.add_argument("--out", default="say.wav", help="output WAV file (default say.wav)")
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
    """``await action(client)`` against ``args.url``: (0, its result), or (1, None) after
    printing why (a server error, or the server cannot be reached)."""
    from clients.client import StreamvoxClient, StreamvoxError

    async def go():
        async with StreamvoxClient(args.url, api_key=args.api_key) as client:
            return await action(client)

    try:
        return 0, asyncio.run(go())
    except StreamvoxError as exc:
        print(f"streamvox {args.command}: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"streamvox {args.command}: cannot reach {args.url}: {connection_problem(exc)}", file=sys.stderr)
    return 1, None


def connection_problem(exc: OSError) -> str:
    """Why a connection failed, in words: the OS error's text (``Connection refused``), not
    aiohttp's wrapper with its ``ssl:default [Connect call failed (...)]`` internals."""
    root = getattr(exc, "os_error", None) or exc  # aiohttp.ClientConnectorError keeps the OSError
    if isinstance(root, ConnectionRefusedError) or root.errno == 111:
        return "connection refused (is `streamvox serve` running there?)"
    return root.strerror or str(root)


def run(args: argparse.Namespace) -> int:
    import soundfile as sf

    if args.stdin:
        return run_stdin(args)
    if args.text is None:
        print("streamvox say: give the text, '-' (all of stdin) or --stdin (stream stdin)", file=sys.stderr)
        return 2

    text = sys.stdin.read() if args.text == "-" else args.text
    config = {key: value for key, value in {"voice": args.voice, "seed": args.seed, "steps": args.steps,
                                             "guidance_scale": args.guidance_scale, "speed": args.speed,
                                             "temperature": args.temperature}.items()
              if value is not None}

    code, result = call_server(args, lambda client: client.say(text, **config))
    if code:
        return code
    sf.write(args.out, result.pcm, result.sample_rate, subtype="PCM_16")
    ttfa = f"{result.time_to_first_audio_s * 1000:.0f} ms" if result.time_to_first_audio_s is not None else "n/a"
    print(f"wrote {args.out}: {result.audio_seconds:.2f} s audio in {len(result.utterances)} utterance(s); "
          f"time to first audio {ttfa}; real-time factor {1 / max(result.real_time_factor, 1e-9):.2f} "
          f"({result.real_time_factor:.2f}x faster than real time)")
    return 0


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
    import soundfile as sf

    config = {key: value for key, value in {"voice": args.voice, "seed": args.seed, "steps": args.steps,
                                             "guidance_scale": args.guidance_scale, "speed": args.speed,
                                             "temperature": args.temperature}.items()
              if value is not None}
    first_text: list[float] = []
    first_audio: list[float] = []

    async def timed_text():
        async for piece in stdin_text():
            if not first_text:
                first_text.append(time.monotonic())
            yield piece

    async def action(client):
        pieces = []
        async for pcm in client.stream_speech(timed_text(), **config):
            if not first_audio:
                first_audio.append(time.monotonic())
            pieces.append(pcm)
        return b"".join(pieces)

    code, pcm = call_server(args, action)
    if code:
        return code
    samples = np.frombuffer(pcm, dtype="<i2")
    sf.write(args.out, samples, 24000, subtype="PCM_16")
    lag = f"{(first_audio[0] - first_text[0]) * 1000:.0f} ms" if first_text and first_audio else "n/a"
    print(f"wrote {args.out}: {samples.size / 24000:.2f} s audio; first audio {lag} after the first text")
    return 0
