"""Settings: flags win over environment variables, which win over defaults; bad values are named."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import get_args

import pytest
import torch

from engines.build import default_preset
from service.settings import OPTIONS, Settings, add_arguments, from_args


def parse(argv: list[str], env: dict[str, str]) -> Settings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(argv), env)


def test_defaults():
    settings = parse([], {})
    assert (settings.host, settings.port, settings.device, settings.data_dir) == ("127.0.0.1", 8000, "auto", Path("data"))
    assert (settings.max_queue, settings.drain_seconds, settings.max_input_chars) == (64, 20.0, 4096)
    assert settings.api_keys == () and settings.metrics_auth is False and settings.cors_origins == ()
    assert settings.preset is None  # the engine picks
    assert default_preset(torch.device("cpu")) == "small" and default_preset(torch.device("cuda")) == "base"


def test_environment_then_flags(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\nfile-key\n\n")
    env = {"STREAMVOX_HOST": "0.0.0.0", "STREAMVOX_PORT": "9000", "STREAMVOX_PRESET": "tiny",
           "STREAMVOX_DEVICE": "cpu", "STREAMVOX_DATA_DIR": str(tmp_path), "STREAMVOX_MAX_QUEUE": "8",
           "STREAMVOX_DRAIN_SECONDS": "3.5", "STREAMVOX_API_KEYS": "a, b", "STREAMVOX_API_KEY_FILE": str(key_file),
           "STREAMVOX_METRICS_AUTH": "on", "STREAMVOX_CORS_ORIGINS": "https://x.example,https://y.example",
           "STREAMVOX_MAX_INPUT_CHARS": "100", "STREAMVOX_LOG_LEVEL": "DEBUG", "STREAMVOX_CHECKPOINT": "/ckpt",
           "STREAMVOX_RATE_LIMIT": "2.5", "STREAMVOX_RATE_BURST": "5", "STREAMVOX_MAX_SESSIONS_PER_KEY": "3",
           "STREAMVOX_JOB_TTL_HOURS": "24", "STREAMVOX_JOBS_DISK_QUOTA_MB": "512"}
    settings = parse([], env)
    assert (settings.host, settings.port, settings.preset, settings.device) == ("0.0.0.0", 9000, "tiny", "cpu")
    assert (settings.max_queue, settings.drain_seconds, settings.max_input_chars) == (8, 3.5, 100)
    assert settings.api_keys == ("a", "b", "file-key") and settings.metrics_auth is True
    assert settings.cors_origins == ("https://x.example", "https://y.example")
    assert (settings.log_level, settings.checkpoint, settings.data_dir) == ("debug", "/ckpt", tmp_path)
    assert (settings.rate_limit, settings.rate_burst, settings.max_sessions_per_key) == (2.5, 5, 3)
    assert (settings.job_ttl_hours, settings.jobs_disk_quota_mb) == (24.0, 512.0)
    flagged = parse(["--port", "0", "--api-key", "c", "--api-key", "d", "--metrics-auth", "off"], env)
    assert flagged.port == 0 and flagged.api_keys == ("c", "d", "file-key") and flagged.metrics_auth is False


@pytest.mark.parametrize("argv, fragment", [
    (["--port", "http"], "--port"),
    (["--port", "-1"], "--port"),
    (["--max-queue", "0"], "--max-queue"),
    (["--drain-seconds", "soon"], "--drain-seconds"),
    (["--metrics-auth", "maybe"], "--metrics-auth"),
    (["--log-level", "loud"], "--log-level"),
    (["--device", "tpu"], "--device"),
    (["--rate-burst", "0"], "--rate-burst"),
])
def test_bad_values_name_the_flag(argv, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse(argv, {})


def test_every_quantize_mode_the_engine_builds_is_a_setting():
    from engines.models.quantize import QUANTIZE_MODES

    assert parse(["--quantize", "int8-int4p"], {}).quantize == "int8-int4p"
    assert get_args(Settings.model_fields["quantize"].annotation) == ("auto", "none", *QUANTIZE_MODES)
    with pytest.raises(ValueError, match="--quantize"):
        parse(["--quantize", "int4-int8p"], {})


def test_the_codec_precision_is_a_setting():
    assert parse([], {}).codec_precision == "auto"
    assert parse(["--codec-precision", "float32"], {}).codec_precision == "float32"
    assert parse([], {"STREAMVOX_CODEC_PRECISION": "bfloat16"}).codec_precision == "bfloat16"
    with pytest.raises(ValueError, match="--codec-precision"):
        parse(["--codec-precision", "int8"], {})


@pytest.mark.parametrize("env, flag", [
    ({"STREAMVOX_HTTP_IDLE_SECONDS": "nan"}, "--http-idle-seconds"),
    ({"STREAMVOX_HTTP_BODY_SECONDS": "inf"}, "--http-body-seconds"),
    ({"STREAMVOX_RATE_LIMIT": "nan"}, "--rate-limit"),
    ({"STREAMVOX_DRAIN_SECONDS": "1e400"}, "--drain-seconds"),
    ({"STREAMVOX_MAX_CONNECTIONS_PER_ADDRESS": "9" * 5000}, "--max-connections-per-address"),
    ({"STREAMVOX_WS_IDLE_SECONDS": "inf"}, "--ws-idle-seconds"),
    ({"STREAMVOX_MAX_SLOTS": "\udcff"}, "--max-slots"),
])
def test_non_finite_and_huge_numbers_name_the_flag(env, flag):
    # nan compares False with every bound, so it would slip past a plain minimum check
    with pytest.raises(ValueError, match=flag):
        from_args(None, env=env)


def test_jobs_db_settings_keep_the_password_off_the_command_line(tmp_path):
    url = "postgresql://streamvox@db.example:5432/streamvox"
    settings = parse(["--jobs-db", url, "--jobs-db-pool-size", "3", "--job-lease-seconds", "12"],
                     env={"STREAMVOX_JOB_WORKERS": "0"})
    assert (settings.jobs_db, settings.jobs_db_pool_size, settings.job_lease_seconds) == (url, 3, 12.0)
    assert settings.job_workers == 0  # an API-only replica
    with pytest.raises(ValueError, match="--job-workers"):
        parse(["--job-workers", "-1"], env={})
    assert "db.example" not in repr(settings)  # the URL is never in a repr (logs)
    with pytest.raises(ValueError, match="no password on the command line"):
        parse(["--jobs-db", "postgresql://streamvox:hunter2@db.example/streamvox"], env={})
    with_password = "postgresql://streamvox:hunter2@db.example/streamvox"
    assert parse([], env={"STREAMVOX_JOBS_DB": with_password}).jobs_db == with_password  # the environment is fine
    with pytest.raises(ValueError, match="expected a postgresql:// URL"):
        parse(["--jobs-db", "mysql://x/y"], env={})
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    assert parse(["--jobs-db", url, "--jobs-db-password-file", str(secret)], env={}).jobs_db_password() == "s3cret"
    with pytest.raises(ValueError, match="no such file"):
        parse(["--jobs-db-password-file", str(tmp_path / "missing")], env={})


def test_ref_audio_url_prefixes_must_be_directories():
    settings = parse(["--ref-audio-url-prefixes", "https://media.example.com/voices/, file:///srv/refs/"], env={})
    assert settings.ref_audio_url_prefixes == ("https://media.example.com/voices/", "file:///srv/refs/")
    for bad in ("https://media.example.com", "https://media.example.com/voices", "ftp://x/y/", "/srv/refs/"):
        with pytest.raises(ValueError, match="--ref-audio-url-prefixes"):
            parse(["--ref-audio-url-prefixes", bad], env={})
    assert parse([], env={}).ref_audio_url_prefixes == ()  # the default: nothing is fetched


def test_model_flag_env_and_their_older_names():
    """--model / STREAMVOX_MODEL, with --checkpoint / STREAMVOX_CHECKPOINT still accepted; a flag
    wins over both variables, the new variable over the old one, and an empty value (an image built
    without a model) names none."""
    model_id = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice@main"
    assert parse([], {}).checkpoint is None
    assert parse(["--model", model_id], {}).checkpoint == model_id
    assert parse(["--checkpoint", "/ckpt"], {}).checkpoint == "/ckpt"
    assert parse([], {"STREAMVOX_MODEL": model_id}).checkpoint == model_id
    assert parse([], {"STREAMVOX_CHECKPOINT": "/ckpt"}).checkpoint == "/ckpt"
    assert parse([], {"STREAMVOX_MODEL": model_id, "STREAMVOX_CHECKPOINT": "/ckpt"}).checkpoint == model_id
    assert parse([], {"STREAMVOX_MODEL": "", "STREAMVOX_CHECKPOINT": "/ckpt"}).checkpoint == "/ckpt"
    assert parse([], {"STREAMVOX_MODEL": " "}).checkpoint is None
    assert parse(["--model", "random"], {"STREAMVOX_MODEL": model_id}).checkpoint == "random"
    assert parse([], {}).checkpoint_dir is None  # filled in by the server once resolved


def numeric_options():
    """(option, a value other than its default) for every int / float setting with a flag."""
    for option in OPTIONS:
        info = Settings.model_fields[option.field]
        kind = next((k for k in (int, float) if info.annotation in (k, k | None)), None)
        if kind is not None:
            yield option, kind((info.default or 0) + 1)


@pytest.mark.parametrize("option, value", list(numeric_options()), ids=lambda o: getattr(o, "flag", ""))
def test_every_numeric_setting_has_a_working_flag_and_variable(option, value):
    """Each is derived from the field's declaration: the flag sets it, the variable sets it, the
    flag wins over the variable, and a value below its bound is refused naming the flag."""
    assert getattr(parse([option.flag, str(value)], {}), option.field) == value
    assert getattr(parse([], {option.env: str(value)}), option.field) == value
    assert getattr(parse([option.flag, str(value)], {option.env: str(value + 1)}), option.field) == value
    with pytest.raises(ValueError, match=option.flag):
        parse([option.flag, "-1000000"], {})


def test_settings_without_a_flag_have_no_variable_and_no_flag():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    assert "--max-body-bytes" not in flags and "--seed" not in flags and "--ws-idle-seconds" in flags
    settings = from_args(None, {"STREAMVOX_MAX_BODY_BYTES": "5", "STREAMVOX_SEED": "3"})
    assert (settings.max_body_bytes, settings.seed) == (1 << 20, 0)
    assert Settings(max_body_bytes=5).model_copy(update={"seed": 3}).seed == 3  # tests override them by keyword


def test_keywords_never_read_the_process_environment(monkeypatch):
    monkeypatch.setenv("STREAMVOX_PORT", "9001")
    assert Settings().port == 8000  # tests stay hermetic
    assert from_args(None).port == 9001  # the server reads it
    with pytest.raises(ValueError):
        Settings(no_such_setting=1)  # a misspelt override fails loudly


def test_help_names_every_variable_and_default():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for option in OPTIONS:
        for env in option.envs:
            assert env in text
    assert "[env STREAMVOX_PORT; default 8000]" in text and "{tiny,small,base}" in text


def test_the_settings_build_the_engine_config_each_setting_in_its_sub_config(tmp_path):
    """Every engine setting, from its flag and the environment, lands in the one EngineConfig the
    engine is built from (engines/config.py): nothing is copied one by one on the way."""
    aliases = tmp_path / "aliases.json"
    aliases.write_text('{"narrator": "aria", "nova": null}')
    settings = parse(["--preset", "tiny", "--device", "cpu", "--model", "/ckpt", "--source", "dit",
                      "--backend", "onnxruntime", "--artifacts-dir", "/art", "--max-queue", "7", "--max-slots", "3",
                      "--kv-cache-gb", "0.5", "--prefill-token-budget", "99", "--prefix-cache-fraction", "0.1",
                      "--quantize", "int8", "--codec-precision", "float32", "--dtype", "bfloat16",
                      "--aligner", "/aligner", "--voice-aliases", str(aliases), "--virtual-device", "/costs.json",
                      "--virtual-eos-frames", "9"], {"STREAMVOX_PAGED_ATTENTION": "0"})
    config = settings.model_copy(update={"checkpoint_dir": Path("/resolved")}).engine_config()
    model, runtime, scheduler, limits = config.model, config.runtime, config.scheduler, config.limits
    assert (model.checkpoint, model.preset, model.pipeline, model.seed, model.aligner) == (
        "/resolved", "tiny", "dit", 0, "/aligner")  # --model as it resolved (server.resolve_model)
    assert model.voice_aliases == {"narrator": "aria", "nova": None}
    assert (runtime.device, runtime.dtype, runtime.codec_precision, runtime.quantize, runtime.backend,
            runtime.artifacts_dir) == ("cpu", "bfloat16", "float32", "int8", "onnxruntime", "/art")
    assert runtime.switches == settings.runtime and runtime.switches.paged_attention is False
    assert (scheduler.max_slots, scheduler.prefill_token_budget) == (3, 99)
    assert (limits.max_queue, limits.kv_cache_gb, limits.prefix_cache_fraction) == (7, 0.5, 0.1)
    assert (config.virtual.table, config.virtual.eos_frames) == ("/costs.json", 9)
    assert config.warmup is True
    assert parse([], {}).engine_config().model.checkpoint is None and parse([], {}).engine_config().virtual is None
