"""Server settings: one frozen pydantic-settings model, each setting declared once.

A setting declared with ``option(...)`` carries its default, type, bounds and help text; its
command-line flag (``--field-name``) and environment variable (``STREAMVOX_FIELD_NAME``) are
derived from that one declaration (``OPTIONS``, ``add_arguments``, ``from_args``). A flag given
on the command line wins over the environment, which wins over the default. Fields declared
without ``option`` are limits with neither flag nor variable (tests override them by keyword).
This is the only place that knows the names.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Union

from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars
from yarl import URL

from engines.config import (
    EngineConfig,
    LimitsConfig,
    ModelSpec,
    RuntimeConfig,
    RuntimeSwitches,
    SchedulerConfig,
    VirtualDeviceConfig,
)

ENV_PREFIX = "STREAMVOX_"
ENV_API_KEYS = "STREAMVOX_API_KEYS"


def option(default: Any, help: str, *, flag: str | None = None, env: str | None = None,
           aliases: tuple[str, ...] = (), env_aliases: tuple[str, ...] = (), metavar: str | None = None,
           repeatable: bool = False, **constraints: Any) -> Any:
    """A setting with a flag and an environment variable.

    ``help``: its --help text. ``flag``: when not ``--field-name``; ``env``: when not derived from
    the flag (``--ws-idle-seconds`` -> ``STREAMVOX_WS_IDLE_SECONDS``). ``aliases`` /
    ``env_aliases``: older names still accepted. ``repeatable``: the flag may be given several
    times (its variable is comma separated). ``constraints``: pydantic's (ge, gt, le, repr, ...).
    """
    names = {"flag": flag, "env": env, "aliases": list(aliases), "env_aliases": list(env_aliases),
             "metavar": metavar, "repeatable": repeatable}
    return Field(default, description=help, json_schema_extra={k: v for k, v in names.items() if v}, **constraints)


def _split_list(value: Any) -> Any:
    """A comma separated string (a variable, a flag) or a sequence (repeated flags, keywords):
    its items stripped, empty ones dropped."""
    if isinstance(value, str):
        value = value.split(",")
    if isinstance(value, (list, tuple)):  # anything but strings is left for pydantic to refuse
        return tuple(item.strip() if isinstance(item, str) else item for item in value
                     if not isinstance(item, str) or item.strip())
    return value


CommaList = Annotated[tuple[str, ...], BeforeValidator(_split_list)]


def check_prefix(prefix: str) -> str:
    """A ``--ref-audio-url-prefixes`` entry, or ValueError saying what is wrong with it."""
    url = URL(prefix)
    if url.scheme not in ("http", "https", "file") or (url.scheme != "file" and not url.host):
        raise ValueError(f"{prefix!r}: expected https://host/path/ or file:///dir/")
    normalised = str(url)
    if not prefix.endswith("/") or not normalised.endswith("/"):
        raise ValueError(f"{prefix!r}: must end with '/' (a directory, so that no longer name matches)")
    return normalised


def _read_key_file(path: str) -> tuple[str, ...]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))


def read_voice_aliases(path: str) -> dict[str, str | None]:
    """A ``--voice-aliases`` file: one JSON object of alias name -> voice name (or null); ValueError
    saying what is wrong with it."""
    try:
        table = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(table, dict) or not all(isinstance(name, str) and name.strip() and (
            voice is None or isinstance(voice, str) and voice.strip()) for name, voice in table.items()):
        raise ValueError(f'{path}: expected one JSON object of "alias": "voice" (or null) entries')
    names: dict[str, str] = {}
    for name in table:  # requests name voices in any case: two such names would be one alias
        if (other := names.setdefault(name.strip().lower(), name)) != name:
            raise ValueError(f"{path}: {other!r} and {name!r} differ only in case (voices match in any case)")
    return table


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",  # a misspelt keyword override fails loudly
        allow_inf_nan=False,  # nan compares False with everything: it would pass any bound
        case_sensitive=True,  # STREAMVOX_PORT, not streamvox_port
        env_ignore_empty=True,  # an empty variable (an image's unset STREAMVOX_MODEL) is no value
        enable_decoding=False,  # list variables are comma separated, not JSON
    )

    host: str = option("127.0.0.1", "interface to bind")
    port: int = option(8000, "TCP port (0 = ephemeral)", ge=0, le=65535)
    # None: "small" on CPU, "base" on CUDA (decided when the device is known)
    preset: Literal["tiny", "small", "base"] | None = option(None, "model size (default: small on CPU, base on CUDA)")
    device: str = option("auto", "auto|cpu|cuda")
    data_dir: Path = option(Path("./data"), "where the job database and audio live")
    # --model as named: a local directory / weights file, a Hugging Face id ORG/NAME[@REVISION],
    # "random", or None (the default model, else random weights; engines/checkpoints/hub.py)
    checkpoint: str | None = option(
        None, "Qwen3-TTS model: a Hugging Face id ORG/NAME[@REVISION] (fetched into the HF_HOME cache), a local "
        "directory, or `random` (default: Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice, else random weights when the "
        "hub cannot be reached)",
        flag="--model", aliases=("--checkpoint",), env_aliases=("STREAMVOX_CHECKPOINT",), metavar="MODEL")
    checkpoint_dir: Path | None = None  # where --model resolved to (set by the server, not a flag)
    # None: talker when the checkpoint has trained talker weights, else dit. Any name registered in
    # engines/pipelines/registry.py: the server checks it before a model loads (engines.build.check_source)
    source: str | None = option(
        None, "the pipeline to serve: dit, talker or another name registered in engines/pipelines/registry.py "
        "(default: talker if the checkpoint has one, else dit)", metavar="PIPELINE")
    backend: Literal["torch", "onnxruntime", "tensorrt"] = option("torch", "DiT/decoder runtime")
    artifacts_dir: str | None = option(None, "ONNX files / TensorRT engines for --backend")
    max_queue: int = option(64, "engine admission queue size", ge=1)
    max_slots: int | None = option(  # None: the preset's
        None, "concurrent streams of the pipeline: DiT slots (default: the preset's) or talker rows (default 8)",
        ge=1)
    # --- talker at scale
    kv_cache_gb: float | None = option(  # None: 1 GiB on CPU, 40 % of free memory on CUDA
        None, "talker KV cache pool in GiB (default: 1 on CPU, 40% of free device memory on CUDA); requests "
        "wait when it is full", gt=0)
    prefill_token_budget: int | None = option(  # None: the engine's, by device
        None, "talker prompt positions prefilled per step, interleaved with decoding (default: 512 on CPU, 4096 on "
        "CUDA and on a virtual device)", ge=1)
    prefix_cache_fraction: float | None = option(
        None, "share of the talker's KV pool that shared prompt prefixes (speaker prompts, saved voices) may "
        "keep for reuse (default: the engine's; 0 = no prefix cache)", ge=0, le=1)
    quantize: Literal["auto", "none", "int8", "int4", "int8-int4p"] = option(
        "auto", "talker and code predictor weights on CPU: auto (the CPU default of docs/QUANTIZATION.md; fp32 on "
        "CUDA), none (fp32: the official greedy codes), int8, int4, or int8-int4p (talker int8, code predictor int4)")
    codec_precision: Literal["auto", "float32", "bfloat16"] = option(
        "auto", "codec decoder (codes to audio): auto (bfloat16 on a CPU with native bf16, as the official code "
        "decodes a bf16 model; else the engine's dtype), float32 or bfloat16 (docs/QUANTIZATION.md)")
    virtual_device: str | None = option(
        None, "scheduling work without a GPU: serve the talker on a virtual device, whose talker and codec-decoder "
        "work are waits of this GPU cost table's times (benchmarks/costs/*.json) on the CPU; --model then names a "
        "Qwen3-TTS directory whose config and tokenizer shape the prompts (no weights are read; "
        "docs/VIRTUAL_DEVICE.md)", metavar="COSTS_JSON")
    virtual_eos_frames: int | None = option(
        None, "with --virtual-device: every utterance samples EOS after this many frames (default: none does; "
        "utterances run to their frame budget, as on the random benchmark checkpoint)", ge=1)
    # --- end talker at scale
    dtype: Literal["auto", "float32", "bfloat16"] = option(
        "auto", "weights and activations (auto: bfloat16 on CUDA, float32 on CPU)")
    drain_seconds: float = option(20.0, "grace period for in-flight streams on SIGTERM", ge=0)
    # the keys of --api-key (else STREAMVOX_API_KEYS), then those of --api-key-file
    api_keys: CommaList = option((), "accepted API key", flag="--api-key", env=ENV_API_KEYS, repeatable=True)
    api_key_file: str | None = option(None, "file with one API key per line")
    metrics_auth: bool = option(False, "require an API key for /metrics")
    cors_origins: CommaList = option((), "comma separated allowed origins (empty = CORS off)")
    max_input_chars: int = option(4096, "longest accepted input text", ge=1)
    max_job_chars: int = option(200_000, "longest input text of a REST job (spoken as utterances, kept as they "
                                "finish: an interrupted job resumes)", ge=1)
    log_level: Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(str.lower)] = option(
        "info", "log verbosity")
    event_loop: Literal["uvloop", "asyncio"] = option(
        "uvloop", "the event loop: uvloop (libuv: a socket call keeps the GIL, so the loop never waits to win it "
                  "back from the engine's threads) or Python's own asyncio loop")
    rate_limit: float = option(0.0, "requests/s per API key that start work (0 = off)", ge=0)
    rate_burst: int = option(20, "token-bucket size for --rate-limit", ge=1)
    max_sessions_per_key: int = option(
        0, "concurrent WebSocket sessions per API key, and their work: per session one utterance started at a time "
           "and two engine requests, counted over every socket and context of the key (0 = unlimited)", ge=0)
    job_ttl_hours: float = option(168.0, "delete finished jobs after this (0 = keep)", ge=0)
    job_workers: int = option(
        2, "REST jobs this replica runs at once, after real-time streams (0 = none: it only serves the job API)",
        ge=0)
    jobs_disk_quota_mb: float = option(  # new jobs get 507 beyond it
        0.0, "disk space for job audio (0 = unlimited)", ge=0)
    seed: int = 0
    # slowloris: a connection must send a whole request head within http_idle_seconds of
    # opening (or of its last response), and a body within http_body_seconds
    http_idle_seconds: float = option(
        15.0, "close a connection that has not sent a complete request head for this long (keep-alive limit)",
        ge=0.1)
    http_body_seconds: float = option(30.0, "408 when a request body takes longer than this to arrive", ge=0.1)
    max_connections_per_address: int = option(
        256, "concurrent connections per client IP; more get 503 too_many_connections (0 = unlimited)", ge=0)
    # Voice cloning: reference audio limits, inline ref_audio and uploads alike
    max_ref_audio_seconds: float = option(
        30.0, "longest reference audio for voice cloning (inline ref_audio and POST /v1/audio/voices)", ge=1)
    max_ref_audio_mb: float = option(
        10.0, "largest reference audio file in MiB: POST /v1/audio/voices uploads and fetched ref_audio URLs "
        "(inline base64 ref_audio must also fit the 1 MiB JSON body)",
        ge=0.01)
    ref_audio_url_prefixes: CommaList = option(  # fetched only under these (service/voices/fetch.py)
        (), "comma separated https://host/path/ or file:///dir/ prefixes whose ref_audio URLs are fetched "
        "(empty: none)")
    # Limits without a flag of their own; tests may override them.
    max_body_bytes: int = 1 << 20
    max_ws_message_bytes: int = 128 * 1024
    ws_config_timeout_s: float = 10.0
    # no client message (pings/pongs do not count)
    ws_idle_timeout_s: float = option(
        60.0, "close a WebSocket session after this long with no client message and no audio in progress",
        flag="--ws-idle-seconds", gt=0)
    # live text: a live utterance ends at the first sentence end past this many characters
    ws_live_utterance_chars: int = option(
        200, "talker WebSocket sessions: a live utterance ends at the first sentence end past this many characters "
        "(with none, at its first space past 4x this)",
        ge=1)
    ws_max_pending_rounds: int = 64  # input.done / response.cancel not yet answered; beyond it the session closes
    ws_buffer_chunks: int = 8  # per-utterance chunk buffer before the engine is paused
    # --- work limits: what one request (one WebSocket text before a sentence end or flush) may cost
    # as a whole, its text and its pauses, counted by the engine before any of it runs
    # (engines Engine.planned_work; service.synthesis.plan.check_work); over one: 413 too_much_work. 0 = off.
    # 12.5 per second: ~65 min. A 4,096-character request in any language the talker speaks fits (its
    # utterances' frame budgets: ~14,000 in English, ~19,000 in German, ~30,000 in Chinese or Japanese);
    # pauses count too, so no request gets more audio, silent or spoken, than such a text may plan.
    max_work_audio_frames: int = option(
        49_152, "most codec frames (12.5 per second of audio: speech after speed, and pauses) one request may plan "
        "in all; more get 413 too_much_work (0 = no limit)", ge=0)
    max_job_audio_frames: int = option(  # ~22 h; a WAV of it (3.8 GB) still fits a RIFF file's 4 GiB
        1_000_000, "most codec frames one REST job may plan in all (its text, spoken as utterances that each keep to "
        "the per-request limits, and its pauses); more get 413 too_much_work (0 = no limit)", ge=0)
    max_work_frame_steps: int = option(
        60_000, "DiT: most planned frames x denoising steps one request may cost in all (0 = no limit)", ge=0)
    max_job_frame_steps: int = option(  # --max-job-audio-frames at the default 8 steps
        8_000_000, "DiT: most planned frames x denoising steps one REST job may cost in all (0 = no limit)", ge=0)
    max_work_talker_steps: int = option(  # an utterance's frame budget from its text (talker/budget.py)
        2_048, "talker: most decode steps one utterance may run (its text's frame budget, at most max_new_tokens "
        "- 1) (0 = no limit)", ge=0)
    # --- end work limits
    # Long text: the talker speaks it as utterances cut at sentence ends (service/synthesis/plan.py)
    utterance_max_frames: int = option(
        1_024, "talker: long text is spoken as utterances cut at sentence ends, each with a frame budget (from its "
        "text: 15 frames per token + 50; 12.5 frames per second) of at most this", ge=100)
    max_queued_jobs: int = 1000  # unfinished (queued + running) jobs in total; 429 beyond (0 = unlimited)
    max_queued_jobs_per_key: int = 100  # unfinished jobs per API key (per address with auth off); 429 beyond (0 = unlimited)
    # Fairness: concurrent streamed /v1/audio/speech responses per key (per address with auth
    # off) while another key has speech in flight; more get 429 too_many_streams. A lone
    # client is never capped. 0 = no cap; None: an eighth of the engine's slots, at least 2
    # (see stream_cap)
    max_streams_per_key: int | None = option(
        None, "concurrent streamed speech responses per API key (per client address with auth off) while other "
        "keys/addresses have speech in flight; more get 429 too_many_streams. A lone client is never capped "
        "(default: an eighth of the slots, at least 2; 0 = no cap)", ge=0)
    # Whole-file audio (non-streamed speech, jobs) is encoded as it arrives into a temporary
    # file kept in memory up to this size and spilled to disk beyond it (service/synthesis/spool.py)
    whole_file_memory_bytes: int = 8 << 20
    # --- shared jobs: None = the embedded store (SQLite + files under data_dir)
    jobs_db: str | None = option(  # never in a repr: a password may be in it
        None, "PostgreSQL URL (postgresql://user@host:port/db) shared by every replica; unset: SQLite under "
        "--data-dir", repr=False)
    jobs_db_password_file: str | None = option(
        None, "file holding the job database password (else the URL's or PGPASSWORD)")
    jobs_db_pool_size: int = option(8, "job database connections per replica", ge=1)
    job_lease_seconds: float = option(
        30.0, "lease of a running job: another replica takes it over this long after its runner stopped renewing",
        ge=1)
    # --- end shared jobs
    # the environment's device switches (runtime_switches)
    runtime: RuntimeSwitches = Field(default_factory=RuntimeSwitches)
    # --- saved voices: caps (uploads also take a --rate-limit token, as other writes)
    max_voices_per_key: int = option(
        100, "saved voices one API key may hold, with keys on; more uploads get 429 too_many_voices "
        "(0 = unlimited)", ge=0)
    max_voices: int = option(
        10_000, "saved voices in the store, every key's together; more uploads get 429 too_many_voices "
        "(0 = unlimited)", ge=0)
    max_voice_page: int = option(500, "most saved voices one GET /v1/audio/voices page lists (the largest ?limit)",
                                 ge=1)
    # --- end saved voices
    aligner: str | None = option(
        None, "word timestamps: a Qwen3-ForcedAligner (an official-layout directory or a Hugging Face id such as "
        "Qwen/Qwen3-ForcedAligner-0.6B); unset: no timestamps")
    voice_aliases: str | None = option(
        None, "a JSON file {\"name\": \"voice\"} of voice aliases added to the built-in table of other services' "
        "voice names (a null voice drops one); unset: the built-in table alone", metavar="FILE")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   **_: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        """``Settings(...)`` is its keywords over the defaults, never the process environment
        (tests stay hermetic); from_args reads the environment it is given."""
        return (init_settings,)

    @model_validator(mode="before")
    @classmethod
    def _add_key_file(cls, data: Any) -> Any:
        """--api-key-file's keys join those of --api-key / STREAMVOX_API_KEYS."""
        if isinstance(data, dict) and data.get("api_key_file"):
            keys = _split_list(data.get("api_keys", ()))
            data = {**data, "api_keys": keys + _read_key_file(data["api_key_file"])}
        return data

    @field_validator("api_keys")
    @classmethod
    def _unique(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(keys))

    @field_validator("checkpoint", "aligner", mode="before")
    @classmethod
    def _named_model(cls, value: Any) -> Any:
        """Empty (an image built without a model) names none."""
        return (value.strip() or None) if isinstance(value, str) else value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value not in ("auto", "cpu", "cuda") and not value.startswith("cuda:"):
            raise ValueError("choose auto, cpu or cuda")
        return value

    @field_validator("ref_audio_url_prefixes")
    @classmethod
    def _prefixes(cls, prefixes: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_prefix(prefix) for prefix in prefixes)

    @field_validator("jobs_db")
    @classmethod
    def _postgres_url(cls, url: str | None) -> str | None:
        if url and not url.startswith(("postgresql://", "postgres://")):
            raise ValueError("expected a postgresql:// URL")
        return url or None

    @field_validator("voice_aliases")
    @classmethod
    def _alias_file(cls, path: str | None) -> str | None:
        if path:
            read_voice_aliases(path)  # a bad file is a one-line error at start, before any model loads
        return path or None

    def voice_alias_table(self) -> dict[str, str | None]:
        """The ``--voice-aliases`` file's entries (empty when unset)."""
        return read_voice_aliases(self.voice_aliases) if self.voice_aliases else {}

    def engine_config(self) -> EngineConfig:
        """The engine these settings ask for (engines/config.py; engines.build.build_engine builds it):
        the model ``--model`` resolved to (``checkpoint_dir``, else as named), its device, precision,
        batching, limits and virtual device, and the environment's runtime switches."""
        checkpoint = self.checkpoint_dir or self.checkpoint
        virtual = (VirtualDeviceConfig(self.virtual_device, self.virtual_eos_frames) if self.virtual_device
                   else None)
        return EngineConfig(
            model=ModelSpec(checkpoint=str(checkpoint) if checkpoint else None, preset=self.preset,
                            pipeline=self.source, seed=self.seed, aligner=self.aligner,
                            voice_aliases=self.voice_alias_table()),
            runtime=RuntimeConfig(device=self.device, dtype=self.dtype, codec_precision=self.codec_precision,
                                  quantize=self.quantize, backend=self.backend, artifacts_dir=self.artifacts_dir,
                                  switches=self.runtime),
            scheduler=SchedulerConfig(max_slots=self.max_slots, prefill_token_budget=self.prefill_token_budget),
            limits=LimitsConfig(max_queue=self.max_queue, kv_cache_gb=self.kv_cache_gb,
                                prefix_cache_fraction=self.prefix_cache_fraction),
            virtual=virtual)

    @field_validator("jobs_db_password_file")
    @classmethod
    def _password_file(cls, path: str | None) -> str | None:
        if path and not Path(path).is_file():
            raise ValueError(f"no such file: {path}")
        return path or None

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


@dataclass(frozen=True)
class Option:
    """A setting's command-line and environment names, derived from its declaration."""

    field: str
    flag: str
    env: str
    help: str
    flag_aliases: tuple[str, ...] = ()
    env_aliases: tuple[str, ...] = ()
    metavar: str | None = None
    repeatable: bool = False

    @property
    def envs(self) -> tuple[str, ...]:
        return (self.env, *self.env_aliases)


def _choices(annotation: Any) -> tuple[str, ...] | None:
    """The values a Literal (or bool) field takes, shown in --help."""
    if annotation is bool:
        return ("on", "off")
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return tuple(str(arg) for arg in typing.get_args(annotation))
    if origin in (Union, types.UnionType, Annotated):
        for arg in typing.get_args(annotation):
            if (found := _choices(arg)) is not None:
                return found
    return None


def _option(name: str, info: FieldInfo) -> Option:
    extra: dict[str, Any] = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    flag = extra.get("flag") or "--" + name.replace("_", "-")
    choices = _choices(info.annotation)
    return Option(field=name, flag=flag, env=extra.get("env") or ENV_PREFIX + flag[2:].replace("-", "_").upper(),
                  help=info.description or "", flag_aliases=tuple(extra.get("aliases", ())),
                  env_aliases=tuple(extra.get("env_aliases", ())), repeatable=bool(extra.get("repeatable")),
                  metavar="{" + ",".join(choices) + "}" if choices else extra.get("metavar"))


# Every flag, in declaration order: the fields with a help text (declared with option()).
OPTIONS: tuple[Option, ...] = tuple(_option(name, info) for name, info in Settings.model_fields.items()
                                    if info.description)
_BY_FIELD = {option.field: option for option in OPTIONS}


def _shown_default(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every server flag; defaults are None so the environment can fill them in."""
    for option in OPTIONS:
        default = Settings.model_fields[option.field].default
        names = " or ".join(option.envs) + (", comma separated" if option.repeatable else "")
        shown = f" [env {names}; default {_shown_default(default)}]" if default not in (None, ()) else f" [env {names}]"
        help_text = (option.help + (", repeatable" if option.repeatable else "") + shown).replace("%", "%%")
        parser.add_argument(option.flag, *option.flag_aliases, dest=option.field, default=None, help=help_text,
                            action="append" if option.repeatable else "store",
                            metavar=option.metavar or option.flag[2:].replace("-", "_").upper())


class _Environment(EnvSettingsSource):
    """The options' variables, read from a given mapping (os.environ, or a test's dict): the
    first of an option's names that is set and not empty; fields without a flag have none."""

    def __init__(self, environ: Mapping[str, str]):
        super().__init__(Settings)
        self.env_vars = parse_env_vars(environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        option = _BY_FIELD.get(field_name)
        for name in option.envs if option else ():
            if (value := self.env_vars.get(name)) is not None:
                return value, field_name, False
        return None, field_name, False


def _explain(exc: ValidationError) -> str:
    """The first error of ``exc`` as ``--flag: what is wrong, got 'value'``."""
    error = exc.errors(include_url=False)[0]
    field = str(error["loc"][0]) if error["loc"] else ""
    option = _BY_FIELD.get(field)
    name = option.flag if option else field or "settings"
    if error["type"] == "value_error":  # ours: the message says what it needs
        return f"{name}: {error['msg'].removeprefix('Value error, ')}"
    message = error["msg"][:1].lower() + error["msg"][1:]
    shown = repr(error["input"])
    return f"{name}: {message}, got {shown if len(shown) <= 80 else shown[:60] + '...'}"


def from_args(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from parsed flags (may be None; any namespace whose attributes are field
    names) and the environment (default os.environ). An empty flag or variable is no value.

    Raises ValueError with the offending flag named when a value does not parse or is out of range.
    """
    env = os.environ if env is None else env
    flags = {option.field: getattr(args, option.field) for option in OPTIONS
             if getattr(args, option.field, None) not in (None, "", [])}
    if re.match(r"^[a-z]+://[^/@]*:[^/@]*@", flags.get("jobs_db", "")):
        # a flag is visible to every local user (ps, /proc); the environment and files are not
        raise ValueError("--jobs-db: no password on the command line; use STREAMVOX_JOBS_DB, PGPASSWORD "
                         "or --jobs-db-password-file")
    try:
        return Settings(**{**_Environment(env)(), **flags, "runtime": runtime_switches(env)})
    except ValidationError as exc:
        raise ValueError(_explain(exc)) from None


def runtime_switches(env: Mapping[str, str] | None = None) -> RuntimeSwitches:
    """How the engine runs on the device, from the environment only (no flags: debugging and
    benchmark switches). STREAMVOX_COMPILE=0 turns torch.compile off altogether;
    STREAMVOX_COMPILE_DIT=1 / STREAMVOX_COMPILE_TALKER=1 compile the DiT's blocks / the talker's
    layers; STREAMVOX_TALKER_STEP_GRAPHS=0 runs the talker step eager (its code predictor graphed);
    STREAMVOX_PREFILL_GRAPHS=0 prefills every prompt eagerly; STREAMVOX_PAGED_ATTENTION=0 gathers the
    KV blocks for decode attention instead of the kernel reading them in place;
    STREAMVOX_BATCHED_ADMISSION=0 starts admitted rows one by one; STREAMVOX_FUSED_PREDICTOR=persistent|phased
    and STREAMVOX_FUSED_TALKER=1 run the code predictor's frame / the talker's decode layers as fused Triton
    kernels (CUDA);
    STREAMVOX_STATIC_STEP_ON_CPU=1 runs the CPU talker step through the graphs' static buckets;
    STREAMVOX_STAGE_SYNC=1 charges asynchronous GPU work to the worker stage that issued it;
    STREAMVOX_VOCODER_THREAD=0 decodes on the worker thread, after each tick, on a CPU too;
    STREAMVOX_CODEC_PROCESS=0 decodes on the vocoder thread itself, not in a process of its own."""
    env = os.environ if env is None else env
    fused = env.get("STREAMVOX_FUSED_PREDICTOR", "off").lower()
    return RuntimeSwitches(compile=env.get("STREAMVOX_COMPILE", "1") != "0",
                           compile_dit=env.get("STREAMVOX_COMPILE_DIT", "0") == "1",
                           compile_talker=env.get("STREAMVOX_COMPILE_TALKER", "0") == "1",
                           talker_step_graphs=env.get("STREAMVOX_TALKER_STEP_GRAPHS", "1") != "0",
                           prefill_graphs=env.get("STREAMVOX_PREFILL_GRAPHS", "1") != "0",
                           paged_attention=env.get("STREAMVOX_PAGED_ATTENTION", "1") != "0",
                           batched_admission=env.get("STREAMVOX_BATCHED_ADMISSION", "1") != "0",
                           fused_predictor="off" if fused in ("", "0") else fused,
                           fused_talker=env.get("STREAMVOX_FUSED_TALKER", "0") == "1",
                           static_step_on_cpu=env.get("STREAMVOX_STATIC_STEP_ON_CPU") == "1",
                           stage_sync=env.get("STREAMVOX_STAGE_SYNC") == "1",
                           vocoder_thread=env.get("STREAMVOX_VOCODER_THREAD", "1") != "0",
                           codec_process=env.get("STREAMVOX_CODEC_PROCESS", "1") != "0")
