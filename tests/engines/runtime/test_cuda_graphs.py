"""BucketedGraphs, the graph cache every graphed wrapper uses. The CUDA capture itself is
replaced by a recorder (``cuda_graphs.capture``; this machine may have no GPU): what is
checked is the bookkeeping around it - bucket choice, one capture per key, replays, the
drop on a version change, the capture count, capture_all and its compile fallback - and
the CPU path, which runs the step eagerly into static outputs."""

from __future__ import annotations

import logging

import pytest
import torch

from engines.runtime import cuda_graphs
from engines.runtime.cuda_graphs import BucketedGraphs, smallest_bucket


class FakeGraph:
    def __init__(self, key, log):
        self.key, self.log = key, log

    def replay(self):
        self.log.append(("replay", self.key))


class Recorder:
    """Stands in for ``cuda_graphs.capture``: runs ``fn`` once (as the capture would) and
    returns a fake graph whose replays are logged."""

    def __init__(self, log):
        self.log = log
        self.fail_while = lambda: False

    def __call__(self, fn, device, stream, pool, warmup_iters):
        if self.fail_while():
            raise RuntimeError("inductor failed")
        out = fn()
        self.log.append(("capture", out.key))
        return FakeGraph(out.key, self.log), out


def make(log, use_graphs=True, version=None, **kw):
    def step(key):
        log.append(("step", key))
        out = torch.full((2,), float(sum(key)))
        out.key = key  # what the recorder logs
        return out

    g = BucketedGraphs(step, torch.device("cpu"), use_graphs=False, warmup_iters=3, version=version, **kw)
    g.use_graphs = use_graphs  # without a GPU: pool and stream stay None, the recorder ignores them
    return g


@pytest.fixture
def log(monkeypatch):
    entries: list = []
    monkeypatch.setattr(cuda_graphs, "capture", Recorder(entries))
    return entries


def test_smallest_bucket():
    assert [smallest_bucket((1, 2, 4, 6), n) for n in (1, 2, 3, 5, 6, 7)] == [1, 2, 4, 6, 6, None]


def test_each_key_is_captured_once_then_replayed(log):
    hooks = []
    g = make(log, before_capture=lambda k: hooks.append(("before", k)), after_capture=lambda k: hooks.append(("after", k)))
    out = g.run((2, 1))
    assert log == [("step", (2, 1)), ("capture", (2, 1)), ("replay", (2, 1))]
    assert hooks == [("before", (2, 1)), ("after", (2, 1))] and g.captures == 1
    assert out is g.outputs[(2, 1)] and out.tolist() == [3.0, 3.0], "the capture's own output is what a replay rewrites"
    log.clear()
    assert g.run((2, 1)) is out and log == [("replay", (2, 1))], "no second capture of a key"
    g.run((1, 0))
    assert g.captures == 2 and g.captured == ((1, 0), (2, 1))


def test_a_failing_after_capture_check_keeps_no_graph(log):
    def after(key):
        raise RuntimeError("buffer moved during capture")

    g = make(log, after_capture=after)
    with pytest.raises(RuntimeError, match="moved during capture"):
        g.run((1,))
    assert g.graphs == {} and g.outputs == {} and g.captures == 0


def test_a_version_change_drops_every_graph_and_recaptures(log):
    version = [0]
    g = make(log, version=lambda: version[0])
    g.run((1,))
    g.run((2,))
    log.clear()
    g.run((1,))
    assert log == [("replay", (1,))] and g.captures == 2, "same version: replays only"
    version[0] += 1
    log.clear()
    g.run((1,))
    assert log == [("step", (1,)), ("capture", (1,)), ("replay", (1,))]
    assert g.captured == ((1,),) and g.captures == 3, "the (2,) graph was dropped with the rest"
    g.run((1,))
    assert g.captures == 3


def test_cpu_runs_the_step_eagerly_into_static_outputs(log):
    g = make(log, use_graphs=False)
    first = g.run((1, 1))
    assert log == [("step", (1, 1))] and g.captures == 0 and g.captured == ()
    kept = first.clone()
    assert g.run((1, 1)) is first and torch.equal(first, kept), "one static output per key, rewritten in place"
    value = [3.0]
    pair = BucketedGraphs(lambda key: (torch.ones(2) * value[0], torch.zeros(1)), torch.device("cpu"), False, 1)
    a = pair.run("k")
    value[0] = 4.0
    b = pair.run("k")
    assert a is b and a[0].tolist() == [4.0, 4.0] and a[1].tolist() == [0.0], "tuple outputs: static per key too"
    assert pair.run("other") is not a
    g.capture_all([(1,), (2,)])
    assert g.graphs == {}, "capture_all is a no-op without graphs"


def test_capture_all_captures_only_missing_keys_in_order(log):
    g = make(log)
    g.run((2,))
    log.clear()
    g.capture_all([(1,), (2,), (3,)])
    assert [e for e in log if e[0] == "capture"] == [("capture", (1,)), ("capture", (3,))]
    assert g.captures == 3 and g.captured == ((1,), (2,), (3,))


def test_capture_all_falls_back_to_the_plain_step_when_the_compiled_one_fails(log, caplog, monkeypatch):
    compiled = [True]
    recorder = cuda_graphs.capture
    calls = []
    recorder.fail_while = lambda: compiled[0] and len(calls) >= 2  # the second compiled capture fails

    def counting(*args):
        calls.append(compiled[0])
        return recorder(*args)

    monkeypatch.setattr(cuda_graphs, "capture", counting)

    def uncompile():
        compiled[0] = False

    g = make(log)
    with caplog.at_level(logging.WARNING):
        g.capture_all([(1,), (2,), (3,)], compiled=True, uncompile=uncompile, what="test layers")
    assert "capturing the plain layers" in caplog.text and not compiled[0]
    assert calls == [True, True, False, False, False], "after the failure every key is captured again, plain"
    assert g.captured == ((1,), (2,), (3,)) and g.captures == 4

    # Not compiled: a capture failure propagates.
    recorder.fail_while = lambda: True
    with pytest.raises(RuntimeError, match="inductor failed"):
        make(log).capture_all([(1,)], compiled=False, uncompile=uncompile)


def test_a_capture_after_start_is_logged_with_its_name_and_counted(log, caplog):
    """capture_all happens before /readyz; a capture after it stalls every stream: logged, counted."""
    g = make(log, name="talker step")
    with caplog.at_level(logging.INFO, logger="streamvox.cuda_graphs"):
        g.capture_all([(1, 1)])
        assert not caplog.records and g.late_captures == 0  # captured at start: nothing to report
        g.run((1, 1))
        g.run((2, 1))
        g.run((2, 1))
    assert [r.getMessage().split(", on first use")[0] for r in caplog.records] == [
        "captured the talker step graph (2, 1) after start"]
    assert g.late_captures == 1 and g.captures == 2


def test_without_graphs_the_keys_a_gpu_would_capture_late_are_counted(log):
    """On CPU nothing is captured, but the same bookkeeping says what a GPU would have captured
    after start: keys not noted by capture_all, and every key again once the buffers moved."""
    version = [0]
    g = make(log, use_graphs=False, version=lambda: version[0])
    g.run((5,))  # before start: not late
    g.capture_all([(1,), (2,)])
    g.run((1,))
    g.run((2,))
    assert g.late_captures == 0 and not any(kind == "capture" for kind, _ in log)
    g.run((3,))
    g.run((3,))
    assert g.late_captures == 1
    version[0] += 1  # a buffer the graphs read moved: a GPU would capture every key again
    g.run((1,))
    assert g.late_captures == 2
