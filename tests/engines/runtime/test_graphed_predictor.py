"""GraphedCodePredictor: bucketed static buffers (CPU: eager; CUDA: one graph per bucket and mode).

CPU checks: codes equal plain ``CodePredictor.predict`` exactly for batches that are not
buckets, for batches split beyond the largest bucket, with greedy, sampled and top-p
rows mixed; the static inputs never move; padding rows are reset; ``predict`` issues no
host read and creates no tensor from host data (a CPU proxy for "capturable": either
would sync or fail under CUDA graph capture). The CUDA twin captures the graphs and
checks graphed == eager and that a replay makes no host sync.
"""

from __future__ import annotations

import pytest
import torch
from host_read_helpers import HostReadOrUpload

from engines.config import EngineConfig, get_preset
from engines.models.code_predictor import CodePredictor
from engines.models.codec_head import CodecHead
from engines.models.init import init_module_
from engines.models.sampling import FrameSampling
from engines.runtime import cuda_graphs
from engines.runtime.graphed_predictor import (
    DEFAULT_BUCKETS,
    GraphedCodePredictor,
    sampling_mode,
)

TINY = get_preset("tiny")
SMALL_BUCKETS = (1, 2, 4, 8, 16)


def make(device="cpu"):
    head = init_module_(CodecHead(TINY.codec_head), 0).to(device).eval()
    predictor = init_module_(CodePredictor(TINY.code_predictor), 1).to(device).eval()
    return head, predictor


# (greedy, top_k, top_p) per stream; rows are dealt to the streams in contiguous runs.
KINDS = {
    "greedy": [(True, 50, 1.0)],
    "mixed": [(True, 50, 1.0), (False, 20, 1.0), (False, 0, 1.0)],
    "top_p": [(False, 10, 0.8), (True, 50, 1.0), (False, 0, 0.95), (False, 50, 1.0)],
}


@torch.no_grad()
def batch(head: CodecHead, n: int, kind: str, seed: int = 0, device="cpu"):
    """h, code0_emb [n, D] and a FrameSampling of several streams (greedy/sampled/top-p as ``kind``)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(n, TINY.codec_head.hidden_size, generator=g)
    u = (u / u.pow(2).mean(-1, keepdim=True).sqrt()).to(device, next(head.parameters()).dtype)
    streams = KINDS[kind]
    sizes = [n // len(streams) + (i < n % len(streams)) for i in range(len(streams))]
    parts = [FrameSampling.for_stream(size, seed=seed * 100 + i, frame_offset=7 * i, device=device, greedy=gr,
                                      temperature=0.9, top_k=k, top_p=p)
             for i, (size, (gr, k, p)) in enumerate(zip(sizes, streams)) if size > 0]
    s = FrameSampling.cat(parts)
    h = head.hidden(u)
    return h, head.embed(head.sample_code0(head.logits_from_hidden(h), s)), s


def greedy_twin(s: FrameSampling) -> FrameSampling:
    return FrameSampling(s.seed_lo, s.seed_hi, s.frame, torch.ones_like(s.greedy), s.temperature, s.top_k, s.top_p,
                         all_greedy=True, any_top_p=False)


# --------------------------------------------------------------------------- CPU


def test_modes_from_host_flags():
    head, _ = make()
    assert [sampling_mode(batch(head, 6, k)[2]) for k in ("greedy", "mixed", "top_p")] == ["greedy", "sampled", "top_p"]


@pytest.mark.parametrize("kind", ["greedy", "mixed", "top_p"])
@pytest.mark.parametrize("n", [3, 9, 70])
def test_bucketed_path_equals_predict(n, kind):
    head, predictor = make()
    graphed = GraphedCodePredictor(predictor)
    assert not graphed.use_graphs and graphed.buckets == DEFAULT_BUCKETS
    h, e, s = batch(head, n, kind, seed=n)
    want = predictor.predict(h, e, s)
    got = graphed.predict(h, e, s)
    assert got.shape == (n, TINY.num_code_groups - 1) and got.dtype == torch.int64
    assert torch.equal(got, want)
    if kind != "greedy":  # the sampled rows really sampled (else the comparison proves little)
        assert not torch.equal(want, predictor.predict(h, e, greedy_twin(s)))


@pytest.mark.parametrize("n", [17, 35, 48])
def test_batches_beyond_the_largest_bucket_are_split(n):
    head, predictor = make()
    graphed = GraphedCodePredictor(predictor, buckets=SMALL_BUCKETS)
    h, e, s = batch(head, n, "top_p", seed=n)
    assert torch.equal(graphed.predict(h, e, s), predictor.predict(h, e, s))
    for kind in ("greedy", "mixed"):
        h, e, s = batch(head, n, kind, seed=n + 1)
        assert torch.equal(graphed.predict(h, e, s), predictor.predict(h, e, s))


def test_static_buffers_never_move_and_padding_is_reset():
    head, predictor = make()
    graphed = GraphedCodePredictor(predictor, buckets=SMALL_BUCKETS)
    before = graphed.static_pointers()
    cache = predictor.kv_cache
    assert cache is not None and cache.rows == 16  # allocated once, for the largest bucket, up front
    cache_ptrs = [t.data_ptr() for t in cache.k + cache.v]
    outputs = {}
    for n, kind in [(16, "top_p"), (9, "mixed"), (1, "greedy"), (40, "top_p"), (9, "greedy"), (3, "mixed")]:
        h, e, s = batch(head, n, kind, seed=n)
        outputs[(n, kind)] = graphed.predict(h, e, s)
    assert graphed.static_pointers() == before
    assert predictor.kv_cache is cache and [t.data_ptr() for t in cache.k + cache.v] == cache_ptrs
    # After a 16-row call, a 9-row call in the same bucket left rows 9.. as padding: zeros, greedy.
    buf = graphed._buckets[16]
    h, e, s = batch(head, 16, "top_p", seed=5)
    graphed.predict(h, e, s)
    h, e, s = batch(head, 9, "mixed", seed=6)
    graphed.predict(h, e, s)
    assert torch.equal(buf.h[:9], h) and torch.equal(buf.top_k[:9], s.top_k)
    assert not buf.h[9:].any() and not buf.code0_emb[9:].any() and bool(buf.greedy[9:].all())
    assert not buf.frame[9:].any() and bool((buf.top_p[9:] == 1).all()) and not buf.top_k[9:].any()
    # Returned codes are copies: a later call into the same bucket does not change them.
    h, e, s = batch(head, 3, "mixed", seed=3)
    assert torch.equal(outputs[(3, "mixed")], predictor.predict(h, e, s))


def test_cache_reallocated_elsewhere_is_rebound():
    head, predictor = make()
    graphed = GraphedCodePredictor(predictor, buckets=(1, 2, 4))
    old = predictor.kv_cache
    h, e, s = batch(head, 10, "mixed", seed=2)
    want = predictor.predict(h, e, s)  # eager call with more rows: the predictor grows its cache
    assert predictor.kv_cache is not old
    assert torch.equal(graphed.predict(h, e, s), want)
    assert graphed._cache is predictor.kv_cache


def test_drop_in_attributes_and_argument_checks():
    head, predictor = make()
    graphed = GraphedCodePredictor(predictor, buckets=SMALL_BUCKETS)
    assert graphed.cfg is predictor.cfg and graphed.num_code_groups == predictor.num_code_groups
    assert next(graphed.parameters()) is next(predictor.parameters())
    h, e, s = batch(head, 4, "mixed")
    assert torch.equal(graphed.naive_predict(h, e, s), predictor.naive_predict(h, e, s))
    with pytest.raises(ValueError, match="expected h and code0_emb"):
        graphed.predict(h[:, :5], e[:, :5], s)
    with pytest.raises(ValueError, match="sampling has 4 rows for a batch of 3"):
        graphed.predict(h[:3], e[:3], s)
    with pytest.raises(ValueError, match="does not return logits"):
        graphed.predict(h, e, s, return_logits=True)
    assert graphed.predict(h[:0], e[:0], s.rows(slice(0, 0))).shape == (0, TINY.num_code_groups - 1)
    with pytest.raises(ValueError, match="buckets must be positive"):
        GraphedCodePredictor(predictor, buckets=(0, 4))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA graphs need the predictor on a CUDA device"):
            GraphedCodePredictor(predictor, use_graphs=True)
    graphed.capture_all()  # CPU: a no-op
    assert graphed.captured == ()


def test_frame_coder_with_the_wrapper_gives_the_same_codes():
    from engines.pipelines.dit.codes import FrameCoder, LatentChunk
    from engines.pipelines.dit.weights import build_models

    models = build_models(TINY, seed=0)
    plain = FrameCoder(models.codec_head, models.code_predictor, "cpu", max_batch_rows=16)
    g = torch.Generator().manual_seed(0)
    chunks = [LatentChunk(torch.randn(t, TINY.latent_dim, generator=g), 0, seed=i, greedy=i % 2 == 0,
                          top_p=0.9 if i == 3 else 1.0) for i, t in enumerate([5, 7, 12, 3])]
    want = plain.codes(chunks)
    wrapped = FrameCoder(models.codec_head, models.code_predictor, "cpu", max_batch_rows=16,
                         predictor_graphs=lambda predictor: GraphedCodePredictor(predictor, buckets=SMALL_BUCKETS))
    assert isinstance(wrapped.predictor, GraphedCodePredictor)
    got = wrapped.codes(chunks)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_cpu_engine_is_unchanged():
    from engines.build import build_engine

    engine = build_engine(EngineConfig.for_tests(warmup=False))
    assert type(engine.pipeline.coder.predictor) is CodePredictor


@pytest.mark.parametrize("kind", ["greedy", "mixed", "top_p"])
def test_predict_has_no_capture_hazards(kind):
    head, predictor = make()
    graphed = GraphedCodePredictor(predictor, buckets=SMALL_BUCKETS)
    h, e, s = batch(head, 9, kind)
    want = predictor.predict(h, e, s)
    with HostReadOrUpload():
        buf = graphed._buckets[16]
        buf.load(h, e, s)
        got = graphed._eager(buf, sampling_mode(s))[:9]  # exactly what a bucket graph captures
        got_call = graphed.predict(h, e, s)  # the whole call, copies in and out included
    assert torch.equal(got, want) and torch.equal(got_call, want)
    with pytest.raises(AssertionError, match="capture hazard: item"), HostReadOrUpload():
        h.sum().item()  # the mode does catch a host read


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (none visible to torch)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graphs_equal_eager_and_replay_without_sync(dtype):
    head, predictor = make("cuda")
    head, predictor = head.to(dtype), predictor.to(dtype)
    buckets = (1, 2, 4, 8, 16, 32, 64, 128)
    eager = GraphedCodePredictor(predictor, buckets=buckets, use_graphs=False)
    graphed = GraphedCodePredictor(predictor, buckets=buckets)
    assert graphed.use_graphs
    graphed.capture_all()
    assert len(graphed.captured) == len(buckets) * 3
    pointers = graphed.static_pointers()
    cases = [(n, kind) for n in (1, 3, 9, 70, 128) for kind in ("greedy", "mixed", "top_p")]
    cases.append((300, "top_p"))  # split: 128 + 128 + 44 -> 64
    for n, kind in cases:
        h, e, s = batch(head, n, kind, seed=n, device="cuda")
        ref = eager.predict(h, e, s)  # the same bucketed kernels, eagerly
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = graphed.predict(h, e, s)  # copies in, replay, copy out: no host sync allowed
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, ref), (n, kind)  # the graph replays exactly what it captured
        if dtype == torch.float32:
            # Against the plain loop at the unpadded batch size. A mismatch here but not above is
            # GEMM rounding that depends on the row count (padded bucket vs n), not a graph bug.
            assert torch.equal(got, predictor.predict(h, e, s)), (n, kind)
    assert graphed.static_pointers() == pointers
    assert len(graphed.captured) == len(buckets) * 3  # no capture after capture_all


def test_hash_keys_int_keys_match_tensor_keys():
    """Int keys are mixed on the host (capture-safe); the hashes equal the all-tensor path bit for bit."""
    from engines.models.sampling import hash_keys

    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 2**32, (257,), generator=g), torch.randint(0, 2**32, (7,), generator=g)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    for keys in [(5, a, 3, b[:, None]), (a, 2**32 - 1, b[:, None], 2**31 + 5), (123, 456), (a,)]:
        as_tensors = tuple(k if isinstance(k, torch.Tensor) else t(k) for k in keys)
        want = hash_keys(*as_tensors)
        got = hash_keys(*keys)
        assert got.dtype == torch.int64 and got.shape == want.shape and torch.equal(got, want)


# --------------------------------------------------------------------------- compiled layers


def test_compiled_layers_trace_whole_and_equal_eager():
    """``compile_backend``: the cached loop's layer step traces as one graph (fullgraph=True
    would raise on a break) shared by every layer, step and batch size; with dynamo's
    ``eager`` backend (no code generation: what is checked is the tracing, the device-side
    positions and the in-place cache writes) the codes and logits equal the plain loop."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    head, predictor = make()
    _, plain = make()
    torch._dynamo.reset()
    counters.clear()
    graphed = GraphedCodePredictor(predictor, buckets=SMALL_BUCKETS, compile_backend="eager")
    assert predictor.layer_step is not None
    for n, kind in ((1, "greedy"), (3, "mixed"), (9, "top_p"), (16, "greedy")):
        h, e, s = batch(head, n, kind, seed=n)
        assert torch.equal(graphed.predict(h, e, s), plain.predict(h, e, s)), (n, kind)
        got, got_logits = predictor.predict(h, e, s, return_logits=True)
        want, want_logits = plain.predict(h, e, s, return_logits=True)
        assert torch.equal(got, want) and torch.equal(got_logits, want_logits)
    # Batch 1 / 2+ and query length 1 / 2 specialise: a handful of graphs, not one per layer or step.
    assert 1 <= counters["stats"]["unique_graphs"] <= 6, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (none visible to torch)")
def test_cuda_compiled_graphs_match_eager_loop():
    """Inductor-compiled layers inside the CUDA graphs (the engine's configuration): fp32 codes
    equal the eager loop's (fused kernels reorder fp32 sums: logits within 1e-4 relative
    would still flip only near-ties, so codes are compared as a fraction >= 99 %)."""
    head, predictor = make("cuda")
    _, plain = make("cuda")
    graphed = GraphedCodePredictor(predictor, buckets=(1, 2, 4, 8, 16, 32, 64, 128), compile_backend="inductor")
    graphed.capture_all(modes=("greedy",))
    total = same = 0
    for n in (1, 5, 64, 100):
        h, e, s = batch(head, n, "greedy", seed=n, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = graphed.predict(h, e, s)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = plain.predict(h, e, s)
        total += want.numel()
        same += (got == want).sum().item()
    assert same / total >= 0.99, same / total


def test_capture_falls_back_to_plain_layers_when_compiled_capture_fails(monkeypatch, caplog):
    """As for the DiT: a failing compiled capture is retried with the plain layers, warned."""
    import logging

    head, predictor = make()
    graphed = GraphedCodePredictor(predictor, buckets=SMALL_BUCKETS, compile_backend="eager")
    graphed.graphs.use_graphs = True  # take capture_all's CUDA branch; the fake capture stands in for CUDA's
    seen = []

    def capture(fn, device, stream, pool, warmup_iters):
        seen.append(predictor.layer_step is not None)
        if predictor.layer_step is not None:
            raise RuntimeError("inductor failed")
        return object(), None

    monkeypatch.setattr(cuda_graphs, "capture", capture)
    with caplog.at_level(logging.WARNING):
        graphed.capture_all()
    assert predictor.layer_step is None and "capturing the plain layers" in caplog.text
    assert seen[0] and not any(seen[1:])
    assert len(graphed.captured) == len(SMALL_BUCKETS) * 3
