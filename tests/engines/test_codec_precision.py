"""The codec decoder's precision: ``--codec-precision auto`` decodes in bf16 on a CPU with native
bf16 (as the official code decodes a bf16 model), in the engine's dtype elsewhere; a named
precision runs as named, and the engine reports what runs."""

from __future__ import annotations

import pytest
import torch

from engines import build
from engines.build import build_engine, resolve_codec_dtype
from engines.config import EngineConfig
from engines.hardware.cpu_features import cpu_flags, has_native_bf16


def test_auto_is_bf16_only_on_a_cpu_with_native_bf16(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(build, "has_native_bf16", lambda: True)
    assert resolve_codec_dtype("auto", cpu, torch.float32) == torch.bfloat16
    assert resolve_codec_dtype("auto", cuda, torch.float32) == torch.float32  # CUDA: the engine's dtype
    assert resolve_codec_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    monkeypatch.setattr(build, "has_native_bf16", lambda: False)  # emulated bf16 is slower than fp32
    assert resolve_codec_dtype("auto", cpu, torch.float32) == torch.float32
    assert resolve_codec_dtype("bfloat16", cpu, torch.float32) == torch.bfloat16  # named: as asked
    assert resolve_codec_dtype("float32", cuda, torch.bfloat16) == torch.float32
    assert resolve_codec_dtype(None, cpu, torch.float32) == torch.float32  # the library default
    with pytest.raises(ValueError, match="auto, float32 or bfloat16"):
        resolve_codec_dtype("int8", cpu, torch.float32)


def test_native_bf16_is_read_from_the_cpu_flags():
    assert has_native_bf16() == bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


@pytest.mark.parametrize("asked", ["auto", "float32", "bfloat16", None])
def test_the_engine_decodes_in_the_precision_it_reports(asked):
    engine = build_engine(EngineConfig.for_tests(warmup=False, codec_precision=asked))
    want = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: torch.float32,
            "auto": torch.bfloat16 if has_native_bf16() else torch.float32}[asked]
    assert next(engine.vocalizer.decoder.parameters()).dtype == want
    assert engine.info.codec_dtype == str(want).removeprefix("torch.")
