"""The talker's and the codec decoder's threads come from a probe of the memory bandwidth at start,
not from the core count; the service names them (and where the decoder runs) when it starts."""

from __future__ import annotations

import logging

import pytest
import torch

from engines import build
from engines.build import build_engine
from engines.config import EngineConfig, RuntimeSwitches
from engines.hardware.cpu_features import ThreadPlan, plan_threads, read_bandwidth
from tests.oracle import talker_fixtures as fx


def table(rates: dict[int, float]):
    asked: list[int] = []

    def bandwidth(threads: int) -> float:
        asked.append(threads)
        return rates[threads]

    return bandwidth, asked


def test_the_talker_gets_the_fewest_threads_near_the_best_bandwidth():
    flat, asked = table({1: 40.8, 2: 40.5, 3: 41.2})  # a VM whose second core adds no bandwidth
    plan = plan_threads(4, bandwidth=flat)
    assert asked == [1, 2, 3]  # one thread always left for the decoder
    assert (plan.talker, plan.codec) == (1, 3)
    assert "1 thread 40.8 GB/s" in plan.reason and "of 4 available" in plan.reason
    scaling, _ = table({1: 20.0, 2: 30.0, 3: 38.0, 4: 39.0, 5: 39.5})  # a laptop: bandwidth grows to 3
    plan = plan_threads(6, bandwidth=scaling)
    assert (plan.talker, plan.codec) == (3, 3)
    fixed = plan_threads(6, codec_fixed=1, bandwidth=scaling)
    assert (fixed.talker, fixed.codec) == (3, 1) and "fixed" in fixed.reason


def test_one_thread_leaves_the_decoder_on_the_worker_thread():
    never, asked = table({})
    assert (plan_threads(1, bandwidth=never).talker, plan_threads(1, bandwidth=never).codec) == (1, 0)
    assert asked == []


def test_the_probe_reads_memory():
    assert read_bandwidth(1, repeats=1, nbytes=64 << 20) > 0.5  # GB/s: any machine reads faster than this
    assert torch.get_num_threads() == 1  # the caller's count is restored (conftest: one thread)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_engine_runs_the_probes_plan_and_names_it(two_threads, monkeypatch, caplog):
    monkeypatch.setattr(build, "plan_threads", lambda available, codec_fixed=None: ThreadPlan(
        1, codec_fixed or 1, f"probed {available}"))
    with caplog.at_level(logging.INFO, logger="streamvox"):
        engine = build_engine(EngineConfig.for_tests(checkpoint=str(fx.checkpoint_dir("cv_proj")), warmup=False,
                                                     codec_precision="bfloat16"))
    assert "threads: talker 1, codec decoder 1 (probed 2)" in caplog.text
    assert engine.info.threads == "talker 1, codec 1 (a process)"
    engine.start()
    try:
        assert engine.codec_process.pid is not None and engine.codec_process.threads == 1
        assert engine.worker.executor.vocoder_threads == 1
    finally:
        engine.stop()
    assert engine.codec_process.pid is None  # stopped with the engine
    inline = build_engine(EngineConfig.for_tests(checkpoint=str(fx.checkpoint_dir("cv_proj")), warmup=False,
                                                 switches=RuntimeSwitches(vocoder_thread=False)))
    assert inline.codec_process is None and inline.info.threads == "talker 2, codec 2 (after each tick)"
    threaded = build_engine(EngineConfig.for_tests(checkpoint=str(fx.checkpoint_dir("cv_proj")), warmup=False,
                                                   switches=RuntimeSwitches(codec_process=False)))
    assert threaded.codec_process is None and threaded.info.threads == "talker 1, codec 1 (a thread)"
