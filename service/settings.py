"""Server settings: one frozen dataclass, parsed from CLI flags and environment variables.

Every flag has an environment variable; a flag given on the command line wins over the
environment, which wins over the default. This is the only place that knows the names.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from yarl import URL

from engines.config import RuntimeSwitches

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    preset: str | None = None  # None: "small" on CPU, "base" on CUDA (decided when the device is known)
    device: str = "auto"
    data_dir: Path = Path("./data")
    # --model as named: a local directory / weights file, a Hugging Face id ORG/NAME[@REVISION],
    # "random", or None (the default model, else random weights; engines/checkpoints/hub.py)
    checkpoint: str | None = None
    checkpoint_dir: Path | None = None  # where --model resolved to (set by the server, not a flag)
    source: str | None = None  # None: talker when the checkpoint has trained talker weights, else dit
    backend: str = "torch"
    artifacts_dir: str | None = None
    max_queue: int = 64
    max_slots: int | None = None  # None: the preset's
    # --- talker at scale
    kv_cache_gb: float | None = None  # talker KV pool; None: 1 GiB on CPU, 40 % of free memory on CUDA
    prefill_token_budget: int = 512  # talker prompt positions prefilled per step, beside the decode step
    # --- end talker at scale
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    drain_seconds: float = 20.0
    api_keys: tuple[str, ...] = ()
    metrics_auth: bool = False
    cors_origins: tuple[str, ...] = ()
    max_input_chars: int = 4096
    log_level: str = "info"
    rate_limit: float = 0.0  # work-starting requests per second per key (0 = off)
    rate_burst: int = 20
    max_sessions_per_key: int = 0  # concurrent WebSocket sessions per key (0 = unlimited)
    job_ttl_hours: float = 168.0  # finished jobs and their audio are deleted after this (0 = keep)
    jobs_disk_quota_mb: float = 0.0  # job audio on disk; new jobs get 507 beyond it (0 = unlimited)
    seed: int = 0
    # slowloris: a connection must send a whole request head within http_idle_seconds of
    # opening (or of its last response), and a body within http_body_seconds
    http_idle_seconds: float = 15.0
    http_body_seconds: float = 30.0
    max_connections_per_address: int = 256  # concurrent TCP connections per client IP (0 = unlimited)
    # Voice cloning: reference audio limits, inline ref_audio and uploads alike
    max_ref_audio_seconds: float = 30.0
    max_ref_audio_mb: float = 10.0
    ref_audio_url_prefixes: tuple[str, ...] = ()  # ref_audio URLs fetched only under these (service/voices/fetch.py)
    # Limits without a flag of their own; tests may override them.
    max_body_bytes: int = 1 << 20
    max_ws_message_bytes: int = 128 * 1024
    ws_config_timeout_s: float = 10.0
    ws_idle_timeout_s: float = 60.0  # --ws-idle-seconds: no client message (pings/pongs do not count)
    # live text: a live utterance ends at the first sentence end past this many characters
    ws_live_utterance_chars: int = 200  # --ws-live-utterance-chars
    ws_max_pending_rounds: int = 64  # input.done / response.cancel not yet answered; beyond it the session closes
    ws_buffer_chunks: int = 8  # per-utterance chunk buffer before the engine is paused
    job_workers: int = 2
    # --- work limits: what one request (one WebSocket utterance) may cost, counted by the engine
    # before any of it runs (engines Engine.planned_work; service.synthesis.params.check_work);
    # over one: 413 too_much_work. 0 = off.
    max_work_audio_frames: int = 16_384  # codec frames the vocoder decodes (12.5 per second: ~22 min)
    max_work_frame_steps: int = 60_000  # DiT: planned frames x denoising steps
    max_work_talker_steps: int = 2_048  # talker: decode steps it may run (max_new_tokens; the official default passes)
    # --- end work limits
    max_queued_jobs: int = 1000  # unfinished (queued + running) jobs in total; 429 beyond (0 = unlimited)
    max_queued_jobs_per_key: int = 100  # unfinished jobs per API key (per address with auth off); 429 beyond (0 = unlimited)
    # Fairness: concurrent streamed /v1/audio/speech responses per key (per address with auth
    # off) while another key has speech in flight; more get 429 too_many_streams. A lone
    # client is never capped. 0 = no cap; None: an eighth of the engine's slots, at least 2
    # (see stream_cap)
    max_streams_per_key: int | None = None
    # Whole-file audio (non-streamed speech, jobs) is encoded as it arrives into a temporary
    # file kept in memory up to this size and spilled to disk beyond it (service/synthesis/spool.py)
    whole_file_memory_bytes: int = 8 << 20
    # --- shared jobs: None = the embedded store (SQLite + files under data_dir)
    jobs_db: str | None = field(default=None, repr=False)  # never in a repr (a password may be in it); postgresql://user@host:5432/db (password: URL, PGPASSWORD or the file below)
    jobs_db_password_file: str | None = None
    jobs_db_pool_size: int = 8  # connections per replica
    job_lease_seconds: float = 30.0  # a running job's lease; another replica takes it this long after its runner died
    # --- end shared jobs
    runtime: RuntimeSwitches = field(default_factory=RuntimeSwitches)  # the environment's device switches (runtime_switches)
    # --- saved voices: caps (uploads also take a --rate-limit token, as other writes)
    max_voices_per_key: int = 100  # saved voices one API key may hold (with keys on; 0 = unlimited)
    max_voices: int = 10_000  # saved voices in the store, every key's together (0 = unlimited)
    max_voice_page: int = 500  # most voices one GET /v1/audio/voices page lists (its ?limit)
    # --- end saved voices
    # --- word timestamps: a Qwen3-ForcedAligner directory or Hugging Face id (None: no timestamps)
    aligner: str | None = None

    def jobs_db_password(self) -> str | None:
        """The database password from --jobs-db-password-file (None: the URL or PGPASSWORD)."""
        if not self.jobs_db_password_file:
            return None
        return Path(self.jobs_db_password_file).read_text(encoding="utf-8").strip()

    def stream_cap(self, engine_slots: int | None) -> int:
        """``max_streams_per_key``, or by default an eighth of the engine's slots (at least 2).
        It binds only while another key has speech in flight (service/access/limits.py): then one
        key's realtime streams add few rows to the ticks another key's first chunk shares (4
        left a light key's time to first audio at 2.4-3.6x idle on a busy 2-core box, 2 at
        1.1-2.1x: tests/service/access/test_service_hardening_fair.py)."""
        if self.max_streams_per_key is not None:
            return self.max_streams_per_key
        return max(2, (engine_slots or 0) // 8)


# (flag, env var, Settings field, help)
_OPTIONS: tuple[tuple[str, str, str, str], ...] = (
    ("--host", "STREAMVOX_HOST", "host", "interface to bind"),
    ("--port", "STREAMVOX_PORT", "port", "TCP port (0 = ephemeral)"),
    ("--preset", "STREAMVOX_PRESET", "preset", "model size (default: small on CPU, base on CUDA)"),
    ("--device", "STREAMVOX_DEVICE", "device", "auto|cpu|cuda"),
    ("--data-dir", "STREAMVOX_DATA_DIR", "data_dir", "where the job database and audio live"),
    ("--model", "STREAMVOX_MODEL", "checkpoint",
     "Qwen3-TTS model: a Hugging Face id ORG/NAME[@REVISION] (fetched into the HF_HOME cache), a local "
     "directory, or `random` (default: Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice, else random weights when the "
     "hub cannot be reached)"),
    ("--source", "STREAMVOX_SOURCE", "source", "latent source (default: talker if the checkpoint has one)"),
    ("--backend", "STREAMVOX_BACKEND", "backend", "DiT/decoder runtime"),
    ("--artifacts-dir", "STREAMVOX_ARTIFACTS_DIR", "artifacts_dir", "ONNX files / TensorRT engines for --backend"),
    ("--max-queue", "STREAMVOX_MAX_QUEUE", "max_queue", "engine admission queue size"),
    ("--max-slots", "STREAMVOX_MAX_SLOTS", "max_slots", "concurrent streams of the pipeline: DiT slots (default: the preset's) or talker rows (default 8)"),
    ("--kv-cache-gb", "STREAMVOX_KV_CACHE_GB", "kv_cache_gb", "talker KV cache pool in GiB (default: 1 on CPU, 40%% of free device memory on CUDA); requests wait when it is full"),
    ("--prefill-token-budget", "STREAMVOX_PREFILL_TOKEN_BUDGET", "prefill_token_budget", "talker prompt positions prefilled per step, interleaved with decoding (default 512)"),
    ("--dtype", "STREAMVOX_DTYPE", "dtype", "weights and activations (auto: bfloat16 on CUDA, float32 on CPU)"),
    ("--drain-seconds", "STREAMVOX_DRAIN_SECONDS", "drain_seconds", "grace period for in-flight streams on SIGTERM"),
    ("--api-key-file", "STREAMVOX_API_KEY_FILE", "api_key_file", "file with one API key per line"),
    ("--metrics-auth", "STREAMVOX_METRICS_AUTH", "metrics_auth", "require an API key for /metrics"),
    ("--cors-origins", "STREAMVOX_CORS_ORIGINS", "cors_origins", "comma separated allowed origins (empty = CORS off)"),
    ("--max-input-chars", "STREAMVOX_MAX_INPUT_CHARS", "max_input_chars", "longest accepted input text"),
    ("--log-level", "STREAMVOX_LOG_LEVEL", "log_level", "log verbosity"),
    ("--rate-limit", "STREAMVOX_RATE_LIMIT", "rate_limit", "requests/s per API key that start work (0 = off)"),
    ("--rate-burst", "STREAMVOX_RATE_BURST", "rate_burst", "token-bucket size for --rate-limit"),
    ("--max-sessions-per-key", "STREAMVOX_MAX_SESSIONS_PER_KEY", "max_sessions_per_key",
     "concurrent WebSocket sessions per API key (0 = unlimited)"),
    ("--job-ttl-hours", "STREAMVOX_JOB_TTL_HOURS", "job_ttl_hours", "delete finished jobs after this (0 = keep)"),
    ("--job-workers", "STREAMVOX_JOB_WORKERS", "job_workers",
     "REST jobs this replica runs at once, after real-time streams (0 = none: it only serves the job API)"),
    ("--jobs-disk-quota-mb", "STREAMVOX_JOBS_DISK_QUOTA_MB", "jobs_disk_quota_mb",
     "disk space for job audio (0 = unlimited)"),
    ("--http-idle-seconds", "STREAMVOX_HTTP_IDLE_SECONDS", "http_idle_seconds",
     "close a connection that has not sent a complete request head for this long (keep-alive limit)"),
    ("--http-body-seconds", "STREAMVOX_HTTP_BODY_SECONDS", "http_body_seconds",
     "408 when a request body takes longer than this to arrive"),
    ("--max-connections-per-address", "STREAMVOX_MAX_CONNECTIONS_PER_ADDRESS", "max_connections_per_address",
     "concurrent connections per client IP; more get 503 too_many_connections (0 = unlimited)"),
    ("--max-ref-audio-seconds", "STREAMVOX_MAX_REF_AUDIO_SECONDS", "max_ref_audio_seconds",
     "longest reference audio for voice cloning (inline ref_audio and POST /v1/audio/voices)"),
    ("--max-ref-audio-mb", "STREAMVOX_MAX_REF_AUDIO_MB", "max_ref_audio_mb",
     "largest reference audio file in MiB (a speech body with ref_audio may be this big, base64 encoded)"),
    ("--ref-audio-url-prefixes", "STREAMVOX_REF_AUDIO_URL_PREFIXES", "ref_audio_url_prefixes",
     "comma separated https://host/path/ or file:///dir/ prefixes whose ref_audio URLs are fetched (empty: none)"),
    ("--max-streams-per-key", "STREAMVOX_MAX_STREAMS_PER_KEY", "max_streams_per_key",
     "concurrent streamed speech responses per API key (per client address with auth off) while other "
     "keys/addresses have speech in flight; more get 429 too_many_streams. A lone client is never capped "
     "(default: an eighth of the slots, at least 2; 0 = no cap)"),
    ("--ws-idle-seconds", "STREAMVOX_WS_IDLE_SECONDS", "ws_idle_timeout_s",
     "close a WebSocket session after this long with no client message and no audio in progress"),
    # shared jobs
    ("--jobs-db", "STREAMVOX_JOBS_DB", "jobs_db",
     "PostgreSQL URL (postgresql://user@host:port/db) shared by every replica; unset: SQLite under --data-dir"),
    ("--jobs-db-password-file", "STREAMVOX_JOBS_DB_PASSWORD_FILE", "jobs_db_password_file",
     "file holding the job database password (else the URL's or PGPASSWORD)"),
    ("--jobs-db-pool-size", "STREAMVOX_JOBS_DB_POOL_SIZE", "jobs_db_pool_size",
     "job database connections per replica"),
    ("--job-lease-seconds", "STREAMVOX_JOB_LEASE_SECONDS", "job_lease_seconds",
     "lease of a running job: another replica takes it over this long after its runner stopped renewing"),
    # work limits
    ("--max-work-audio-frames", "STREAMVOX_MAX_WORK_AUDIO_FRAMES", "max_work_audio_frames",
     "most codec frames (12.5 per second of audio, after speed) one request or utterance may plan; more get "
     "413 too_much_work (0 = no limit)"),
    ("--max-work-frame-steps", "STREAMVOX_MAX_WORK_FRAME_STEPS", "max_work_frame_steps",
     "DiT: most planned frames x denoising steps one request or utterance may cost (0 = no limit)"),
    ("--max-work-talker-steps", "STREAMVOX_MAX_WORK_TALKER_STEPS", "max_work_talker_steps",
     "talker: most decode steps (max_new_tokens, else the checkpoint's default) one request or utterance "
     "may run (0 = no limit)"),
    # saved voices
    ("--max-voices-per-key", "STREAMVOX_MAX_VOICES_PER_KEY", "max_voices_per_key",
     "saved voices one API key may hold, with keys on; more uploads get 429 too_many_voices (0 = unlimited)"),
    ("--max-voices", "STREAMVOX_MAX_VOICES", "max_voices",
     "saved voices in the store, every key's together; more uploads get 429 too_many_voices (0 = unlimited)"),
    ("--max-voice-page", "STREAMVOX_MAX_VOICE_PAGE", "max_voice_page",
     "most saved voices one GET /v1/audio/voices page lists (the largest ?limit)"),
    ("--aligner", "STREAMVOX_ALIGNER", "aligner",
     "word timestamps: a Qwen3-ForcedAligner (an official-layout directory or a Hugging Face id such as "
     "Qwen/Qwen3-ForcedAligner-0.6B); unset: no timestamps"),
    # live text
    ("--ws-live-utterance-chars", "STREAMVOX_WS_LIVE_UTTERANCE_CHARS", "ws_live_utterance_chars",
     "talker WebSocket sessions: a live utterance ends at the first sentence end past this many characters"),
)

ENV_API_KEYS = "STREAMVOX_API_KEYS"
# Older names that keep working: the flag is an argparse alias, the env var is read when the
# primary one is unset.
FLAG_ALIASES = {"checkpoint": ("--checkpoint",)}
ENV_ALIASES = {"checkpoint": ("STREAMVOX_CHECKPOINT",)}
METAVARS = {"checkpoint": "MODEL"}
# The values a flag takes, shown in --help (from_args checks them, for flags and env vars alike).
CHOICES = {"preset": ("tiny", "small", "base"), "source": ("dit", "talker"),
           "backend": ("torch", "onnxruntime", "tensorrt"), "dtype": ("auto", "float32", "bfloat16"),
           "metrics_auth": ("on", "off"), "log_level": ("debug", "info", "warning", "error")}


def check_prefix(prefix: str) -> str:
    """A ``--ref-audio-url-prefixes`` entry, or ValueError saying what is wrong with it."""
    url = URL(prefix)
    if url.scheme not in ("http", "https", "file") or (url.scheme != "file" and not url.host):
        raise ValueError(f"{prefix!r}: expected https://host/path/ or file:///dir/")
    normalised = str(url)
    if not prefix.endswith("/") or not normalised.endswith("/"):
        raise ValueError(f"{prefix!r}: must end with '/' (a directory, so that no longer name matches)")
    return normalised


def _shown_default(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every server flag; defaults are None so the environment can fill them in."""
    for flag, env, dest, help_text in _OPTIONS:
        default = getattr(Settings, dest, None)
        shown = f" [env {env}; default {_shown_default(default)}]" if default not in (None, ()) else f" [env {env}]"
        choices = CHOICES.get(dest)
        parser.add_argument(flag, *FLAG_ALIASES.get(dest, ()), dest=dest, default=None, help=help_text + shown,
                            metavar="{" + ",".join(choices) + "}" if choices else METAVARS.get(dest))
    parser.add_argument("--api-key", dest="api_key", action="append", default=None,
                        help=f"accepted API key, repeatable [env {ENV_API_KEYS}, comma separated]")


def _parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "on", "yes"):
        return True
    if lowered in ("0", "false", "off", "no", ""):
        return False
    raise ValueError(f"{name}: expected on|off, got {value!r}")


def _split_list(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _read_key_file(path: str) -> tuple[str, ...]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))


def from_args(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from parsed flags (may be None) and the environment.

    Raises ValueError with the offending flag named when a value does not parse.
    """
    env = os.environ if env is None else env
    raw: dict[str, str] = {}
    for flag, env_name, dest, _ in _OPTIONS:
        value = getattr(args, dest, None) if args is not None else None
        if value is None:
            value = env.get(env_name)
            for alias in ENV_ALIASES.get(dest, ()):
                if not value:  # unset or empty: an image's empty STREAMVOX_MODEL must not hide the old name
                    value = env.get(alias) or value
        if value is not None:
            raw[dest] = value

    def number(dest: str, kind, minimum, flag: str | None = None, exclusive: bool = False):
        flag = flag or "--" + dest.replace("_", "-")
        try:
            value = kind(raw[dest])
        except (ValueError, OverflowError):
            raise ValueError(f"{flag}: expected a number, got {raw[dest]!r}") from None
        if not math.isfinite(value):  # nan compares False with everything: it would pass any bound
            raise ValueError(f"{flag}: expected a finite number, got {raw[dest]!r}")
        if value < minimum or (exclusive and value == minimum):
            raise ValueError(f"{flag}: must be {'>' if exclusive else '>='} {minimum}, got {value}")
        return value

    values: dict[str, object] = {}
    for dest in ("host", "device", "artifacts_dir"):
        if dest in raw:
            values[dest] = raw[dest]
    if raw.get("checkpoint", "").strip():  # empty (e.g. an image built without a model) = none named
        values["checkpoint"] = raw["checkpoint"].strip()
    if raw.get("aligner", "").strip():
        values["aligner"] = raw["aligner"].strip()
    if raw.get("source"):
        if raw["source"] not in ("dit", "talker"):
            raise ValueError("--source: choose dit or talker")
        values["source"] = raw["source"]
    if raw.get("backend"):
        if raw["backend"] not in ("torch", "onnxruntime", "tensorrt"):
            raise ValueError("--backend: choose torch, onnxruntime or tensorrt")
        values["backend"] = raw["backend"]
    if "preset" in raw and raw["preset"]:
        values["preset"] = raw["preset"]
    if "data_dir" in raw:
        values["data_dir"] = Path(raw["data_dir"])
    if "port" in raw:
        values["port"] = number("port", int, 0)
    if "max_queue" in raw:
        values["max_queue"] = number("max_queue", int, 1)
    if "max_slots" in raw:
        values["max_slots"] = number("max_slots", int, 1)
    if "kv_cache_gb" in raw:
        values["kv_cache_gb"] = number("kv_cache_gb", float, 0.0, exclusive=True)
    if "prefill_token_budget" in raw:
        values["prefill_token_budget"] = number("prefill_token_budget", int, 1)
    if raw.get("dtype"):
        if raw["dtype"] not in ("auto", "float32", "bfloat16"):
            raise ValueError("--dtype: choose auto, float32 or bfloat16")
        values["dtype"] = raw["dtype"]
    if "drain_seconds" in raw:
        values["drain_seconds"] = number("drain_seconds", float, 0.0)
    if "max_input_chars" in raw:
        values["max_input_chars"] = number("max_input_chars", int, 1)
    for dest, kind, minimum in (("rate_limit", float, 0.0), ("rate_burst", int, 1), ("max_sessions_per_key", int, 0),
                                ("job_ttl_hours", float, 0.0), ("jobs_disk_quota_mb", float, 0.0), ("job_workers", int, 0),
                                ("http_idle_seconds", float, 0.1), ("http_body_seconds", float, 0.1),
                                ("max_connections_per_address", int, 0), ("max_streams_per_key", int, 0),
                                ("max_ref_audio_seconds", float, 1.0), ("max_ref_audio_mb", float, 0.01),
                                ("ws_live_utterance_chars", int, 1),
                                ("max_work_audio_frames", int, 0), ("max_work_frame_steps", int, 0),
                                ("max_work_talker_steps", int, 0),
                                ("max_voices_per_key", int, 0), ("max_voices", int, 0), ("max_voice_page", int, 1)):
        if dest in raw:
            values[dest] = number(dest, kind, minimum)
    # shared jobs
    if raw.get("jobs_db"):
        if not raw["jobs_db"].startswith(("postgresql://", "postgres://")):
            raise ValueError("--jobs-db: expected a postgresql:// URL")
        if getattr(args, "jobs_db", None) and re.match(r"^[a-z]+://[^/@]*:[^/@]*@", raw["jobs_db"]):
            # a flag is visible to every local user (ps, /proc); the environment and files are not
            raise ValueError("--jobs-db: no password on the command line; use STREAMVOX_JOBS_DB, PGPASSWORD "
                             "or --jobs-db-password-file")
        values["jobs_db"] = raw["jobs_db"]
    if raw.get("jobs_db_password_file"):
        if not Path(raw["jobs_db_password_file"]).is_file():
            raise ValueError(f"--jobs-db-password-file: no such file: {raw['jobs_db_password_file']}")
        values["jobs_db_password_file"] = raw["jobs_db_password_file"]
    if "jobs_db_pool_size" in raw:
        values["jobs_db_pool_size"] = number("jobs_db_pool_size", int, 1)
    if "job_lease_seconds" in raw:
        values["job_lease_seconds"] = number("job_lease_seconds", float, 1.0)
    if "ws_idle_timeout_s" in raw:
        values["ws_idle_timeout_s"] = number("ws_idle_timeout_s", float, 0.0, flag="--ws-idle-seconds", exclusive=True)
    if "metrics_auth" in raw:
        values["metrics_auth"] = _parse_bool("--metrics-auth", raw["metrics_auth"])
    if raw.get("ref_audio_url_prefixes"):

        try:
            values["ref_audio_url_prefixes"] = tuple(check_prefix(p) for p in _split_list(raw["ref_audio_url_prefixes"]))
        except ValueError as exc:
            raise ValueError(f"--ref-audio-url-prefixes: {exc}") from None
    if "cors_origins" in raw:
        values["cors_origins"] = _split_list(raw["cors_origins"])
    if "log_level" in raw:
        level = raw["log_level"].lower()
        if level not in LOG_LEVELS:
            raise ValueError(f"--log-level: choose one of {', '.join(LOG_LEVELS)}")
        values["log_level"] = level
    if values.get("device", "auto") not in ("auto", "cpu", "cuda") and not str(values["device"]).startswith("cuda:"):
        raise ValueError("--device: choose auto, cpu or cuda")

    keys: list[str] = []
    flag_keys = getattr(args, "api_key", None) if args is not None else None
    if flag_keys:
        keys.extend(k.strip() for k in flag_keys if k.strip())
    elif env.get(ENV_API_KEYS):
        keys.extend(_split_list(env[ENV_API_KEYS]))
    if raw.get("api_key_file"):
        keys.extend(_read_key_file(raw["api_key_file"]))
    values["api_keys"] = tuple(dict.fromkeys(keys))
    values["runtime"] = runtime_switches(env)
    return Settings(**values)  # type: ignore[arg-type]


def runtime_switches(env: Mapping[str, str] | None = None) -> RuntimeSwitches:
    """How the engine runs on the device, from the environment only (no flags: debugging and
    benchmark switches). STREAMVOX_COMPILE=0 turns torch.compile off altogether;
    STREAMVOX_COMPILE_DIT=1 / STREAMVOX_COMPILE_TALKER=1 compile the DiT's blocks / the talker's
    layers; STREAMVOX_TALKER_STEP_GRAPHS=0 runs the talker step eager (its code predictor graphed);
    STREAMVOX_STAGE_SYNC=1 charges asynchronous GPU work to the worker stage that issued it."""
    env = os.environ if env is None else env
    return RuntimeSwitches(compile=env.get("STREAMVOX_COMPILE", "1") != "0",
                           compile_dit=env.get("STREAMVOX_COMPILE_DIT", "0") == "1",
                           compile_talker=env.get("STREAMVOX_COMPILE_TALKER", "0") == "1",
                           talker_step_graphs=env.get("STREAMVOX_TALKER_STEP_GRAPHS", "1") != "0",
                           stage_sync=env.get("STREAMVOX_STAGE_SYNC") == "1")
