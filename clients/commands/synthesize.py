"""`streamvox synthesize`: text -> audio file, in-process (no server needed)."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import uuid


def register(subparsers: argparse._SubParsersAction) -> None:
    from clients.commands.model_option import add_model_option

    p = subparsers.add_parser("synthesize", help="synthesize text to an audio file in-process (no server)")
    p.add_argument("--text", required=True, help="text to speak ('-' reads standard input)")
    p.add_argument("--out", required=True,
                   help="output audio file, its format from the extension: .wav, .flac, .mp3, .ogg or .opus "
                        "(Ogg Opus), .aac, .pcm (raw 16-bit, 24 kHz mono)")
    p.add_argument("--preset", choices=("tiny", "small", "base"), default=None,
                   help="model size (default: small on CPU, base on CUDA)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    add_model_option(p, "default: Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice from the cache or the hub, else random "
                        "weights; `random` skips the look-up")
    p.add_argument("--source", choices=("dit", "talker"), default=None,
                   help="latent source (default: talker when the checkpoint has trained talker weights)")
    p.add_argument("--language", default="Auto", help="talker source: language name or Auto")
    p.add_argument("--backend", choices=("torch", "onnxruntime", "tensorrt"), default="torch")
    p.add_argument("--artifacts-dir", default=None, help="ONNX / TensorRT artifacts for --backend")
    p.add_argument("--voice", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--guidance-scale", type=float, default=2.0)
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=None,
                   help="talker sampling temperature (0 = greedy; default: the checkpoint's generation_config.json)")
    # Qwen3-TTS releases: Base clones a reference voice, VoiceDesign / 1.7B CustomVoice follow instructions
    p.add_argument("--ref-audio", default=None, help="Base checkpoints: reference voice audio file (1-30 s)")
    p.add_argument("--ref-text", default=None, help="transcript of --ref-audio (in-context cloning)")
    p.add_argument("--x-vector-only", action="store_true", help="clone from the speaker embedding only (no --ref-text)")
    p.add_argument("--instructions", default=None, help="VoiceDesign: the voice described in words; "
                                                        "1.7B CustomVoice: how to speak")
    p.add_argument("--format", choices=("wav", "flac", "mp3", "opus", "aac", "pcm"), default=None,
                   help="file format, for an --out name without an audio extension (default: from the extension)")
    p.add_argument("--max-input-chars", type=int, default=4096,
                   help="longest text accepted, as the server's --max-input-chars (default 4096; 0 = no limit)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _progress(done: int, total: int, started: float, stream) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    elapsed = time.monotonic() - started
    stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} frames {elapsed:5.1f}s")
    stream.flush()


def _clone(engine, args: argparse.Namespace):
    """--ref-audio -> the request's clone (the server's checks and decoding: service/voices/clones.py)."""
    if args.ref_audio is None:
        return None
    from engines.contract import VoiceClone
    from service.errors import ApiError
    from service.voices.decoder_pool import reference_audio

    if not args.x_vector_only and not (args.ref_text or "").strip():
        raise ValueError("--ref-text: in-context cloning needs the transcript of --ref-audio (or --x-vector-only)")
    with open(args.ref_audio, "rb") as f:
        data = f.read()
    try:
        audio = reference_audio(data, max_seconds=30.0, field="--ref-audio")
    except ApiError as exc:
        raise ValueError(exc.message) from None
    features = engine.voice_features(audio)
    if args.x_vector_only:
        return VoiceClone(features.xvector)
    return VoiceClone(features.xvector, features.codes, args.ref_text)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from engines.build import build_engine
    from engines.config import EngineConfig
    from engines.contract import (
        SAMPLES_PER_FRAME,
        AudioChunk,
        EngineError,
        SynthesisRequest,
    )
    from engines.export.base import BackendError
    from service.synthesis.schema import FieldError, SynthesisParams, too_long, validate

    from .errors import fail
    from .output_file import OutputError, audio_file, write_audio
    from .say import rtf_words

    text = sys.stdin.read() if args.text == "-" else args.text
    try:  # the field ranges the server checks, checked the same way (service/synthesis/schema.py)
        params = validate(SynthesisParams, {"voice": args.voice, "seed": args.seed, "steps": args.steps,
                                            "guidance_scale": args.guidance_scale, "speed": args.speed,
                                            "language": args.language, "instructions": args.instructions,
                                            "temperature": args.temperature})
        if not text.strip():
            raise FieldError("text", "must be a non-empty string")
    except FieldError as exc:
        return fail(args.command, exc)
    if args.max_input_chars and len(text) > args.max_input_chars:  # the server's limit and message
        return fail(args.command, f"{too_long('text', len(text), args.max_input_chars)} (--max-input-chars)")
    try:  # every file path (and --out's format) checked before any model loads
        out = audio_file(args.out, fmt=args.format)
        if args.ref_audio is not None and not os.path.isfile(args.ref_audio):
            raise OutputError(f"--ref-audio {args.ref_audio}: no such file")
    except OutputError as exc:
        return fail(args.command, exc)
    from clients.commands.model_option import show_hub_logs
    from engines.checkpoints.hub import ModelUnavailable, resolve
    from service.settings import runtime_switches

    show_hub_logs()
    try:
        served = resolve(args.model)  # may download; unnamed: the default model, else random weights
    except ModelUnavailable as exc:
        return fail(args.command, exc)
    try:
        engine = build_engine(EngineConfig().updated(
            preset=args.preset, device=args.device, checkpoint=str(served.path) if served.path else None, warmup=False,
            pipeline=args.source, backend=args.backend, artifacts_dir=args.artifacts_dir, switches=runtime_switches()))
    except (ValueError, FileNotFoundError, EngineError, BackendError) as exc:
        return fail(args.command, exc)
    info = engine.info
    random_note = ", ".join(info.random_components) if info.random_components else "none"
    print(f"streamvox {info.preset} on {info.device}; components with RANDOM weights: {random_note}",
          file=sys.stderr)
    engine.start()
    try:
        clone = _clone(engine, args)
    except (OSError, ValueError) as exc:
        engine.stop()
        return fail(args.command, exc)
    from service.synthesis.tempo import tempo_for

    tempo = tempo_for(engine, params.speed)  # the talker's speed: its audio is time-stretched (pitch kept)
    if tempo is not None:
        params = params.model_copy(update={"speed": 1.0})
    pieces: list[np.ndarray] = []
    done = threading.Event()
    state: dict[str, object] = {}
    started = time.monotonic()
    show = not args.quiet and (sys.stderr.isatty() or len(text) > 200)

    def deliver(chunk: AudioChunk) -> None:
        pieces.append(chunk.pcm if tempo is None else tempo.apply(chunk).pcm)
        if show:
            _progress(chunk.frames_done, chunk.frames_total, started, sys.stderr)
        if chunk.is_final:
            state["error"] = chunk.error
            done.set()

    try:
        request = SynthesisRequest(id=f"cli-{uuid.uuid4().hex[:12]}", text=text, clone=clone, **params.model_dump())
        engine.submit(request, deliver)
        done.wait()
    except EngineError as exc:
        return fail(args.command, exc)
    finally:
        engine.stop()
    if show:
        sys.stderr.write("\n")
    if state.get("error"):
        return fail(args.command, f"synthesis failed: {state['error']}", 1)
    audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    try:
        write_audio(out, audio)
    except OutputError as exc:
        return fail(args.command, exc, 1)
    seconds = len(audio) / info.sample_rate
    wall = time.monotonic() - started
    frames = len(audio) // SAMPLES_PER_FRAME
    print(f"wrote {args.out}: {frames} frames, {seconds:.2f} s of audio at {info.sample_rate} Hz in {wall:.2f} s; "
          f"{rtf_words(wall, seconds)}", file=sys.stderr)
    return 0
