"""The talker at scale: paged KV cache, chunked batched prefill, a decode step that does not grow
with the batch. Greedy/sampled codes must equal the solo reference loop exactly
(engines/pipelines/talker/reference.py, itself equal to the official generate())."""

from __future__ import annotations

import pytest
import torch
from test_talker_source import LANGS, MAX_NEW, MODES, TEXTS, VOICES, request, run, solo
from torch.utils._python_dispatch import TorchDispatchMode

from engines.contract import SynthesisRequest
from engines.core.scheduler import Scheduler
from engines.models.layers import DecoderLayer
from engines.models.paged_kv import KVPoolExhausted, PagedKVCache
from engines.pipelines.base import StepPlan
from engines.pipelines.talker.source import SourceRunners, TalkerSource
from testsupport.talker import admissible, make_bundle, step, waiting_prompt


@pytest.fixture(scope="module")
def bundle():
    return make_bundle(seed=3, eos_gain=1.2, max_new_tokens=40)


@pytest.mark.parametrize("block_size, budget", [(2, 5), (3, 64), (16, 7)])
def test_greedy_parity_across_block_boundaries_and_prefill_chunks(bundle, block_size, budget):
    """Tiny blocks (a stream crosses many block boundaries) and small prefill budgets (a prompt
    is prefilled in several chunks, batched with other prompts' chunks) change no code."""
    expected = {f"r{i}": solo(bundle, i) for i in range(8)}
    source = TalkerSource.from_bundle(bundle, max_slots=8, max_seq_len=128, block_size=block_size)
    codes, _, _ = run(source, list(range(8)), scheduler=Scheduler(max_slots=8, prefill_token_budget=budget))
    for rid, want in expected.items():
        assert torch.equal(codes.get(rid, want[:0]), want), rid
    assert source.cache.used_blocks == 0, "every block went back to the pool"


def test_sampled_rows_keep_their_draws_in_the_paged_batch(bundle):
    seeds = [21, 22, 23, 24, 25, 26, 27, 28]
    expected = {f"r{i}": solo(bundle, i, greedy=False, seed=seeds[i]) for i in range(8)}
    source = TalkerSource.from_bundle(bundle, max_slots=5, max_seq_len=128, block_size=4)
    codes, _, _ = run(source, list(range(8)), greedy=False, seeds=seeds,
                      scheduler=Scheduler(max_slots=5, prefill_token_budget=9))
    for rid, want in expected.items():
        assert torch.equal(codes.get(rid, want[:0]), want), rid


def test_pool_allocation_release_and_limits():
    cache = PagedKVCache(1, 1, 2, num_blocks=5, block_size=4, rows=3, max_positions=12, device="cpu",
                         dtype=torch.float32)
    assert (cache.capacity_blocks, cache.free_blocks) == (4, 4)
    cache.reserve(0, 5)  # 2 blocks
    cache.reserve(1, 8)  # 2 blocks
    assert cache.table.count_nonzero() == 0, "the device table changes at flush()"
    cache.flush()
    assert cache.used_blocks == 4 and cache.table[0, :2].tolist() == [1, 2] and 0 not in cache.table[1, :2].tolist()
    with pytest.raises(KVPoolExhausted, match="free blocks"):
        cache.reserve(2, 1)
    with pytest.raises(KVPoolExhausted, match="limit per stream"):
        cache.reserve(0, 13)
    assert cache.row_blocks(0) == 2, "a refused reservation takes nothing"
    cache.release(0)
    assert cache.free_blocks == 2 and cache.table[0].tolist() == [0, 0, 0]
    slots = cache.slots(torch.tensor([1]), torch.tensor([[0, 3, 4, 7]]))
    b0, b1 = cache.table[1, :2].tolist()
    assert slots.tolist() == [[4 * b0, 4 * b0 + 3, 4 * b1, 4 * b1 + 3]]


def test_a_stream_outgrowing_the_pool_ends_with_an_error_and_spares_the_others(bundle):
    """5 usable blocks of 8 positions: r5 (17-position prompt, 24 frames = 41 positions) cannot
    get its 6th block; it ends with kv_cache_exhausted while r6 (short) equals its solo codes."""
    source = TalkerSource.from_bundle(bundle, max_slots=2, max_seq_len=128, block_size=8, kv_blocks=6)
    source.admit(request(5), max_new_tokens=MAX_NEW[5], non_streaming_mode=MODES[5])
    source.admit(request(6), max_new_tokens=MAX_NEW[6], non_streaming_mode=MODES[6])
    got: dict[str, list] = {"r5": [], "r6": []}
    errors = {}
    while source.active_slots:
        for f in step(source):
            got[f.request_id].append(f.codes)
            if f.error:
                errors[f.request_id] = f.error
    assert list(errors) == ["r5"] and errors["r5"].startswith("kv_cache_exhausted") and "--kv-cache-gb" in errors["r5"]
    assert torch.equal(torch.cat(got["r6"]), solo(bundle, 6))
    r5, want = torch.cat(got["r5"]), solo(bundle, 5)
    assert 0 < r5.shape[0] < want.shape[0] and torch.equal(r5, want[: r5.shape[0]]), "frames before the error are right"
    assert source.cache.used_blocks == 0


def test_a_row_without_a_free_block_waits_then_continues_exactly(bundle):
    """6 usable blocks of 8 positions: r3 (10-position prompt + 8 steps: 3 blocks) and r5 (17 +
    25: 6 blocks) do not fit together; when r5 finds no block for position 24 it sits steps
    out until r3 ends, then carries on: no error, both equal their solo codes."""
    source = TalkerSource.from_bundle(bundle, max_slots=2, max_seq_len=128, block_size=8, kv_blocks=7)
    for i in (3, 5):
        source.admit(request(i), max_new_tokens=MAX_NEW[i], non_streaming_mode=MODES[i])
    got: dict[str, list] = {"r3": [], "r5": []}
    while source.active_slots:
        for f in step(source):
            assert f.error is None, f.error
            got[f.request_id].append(f.codes)
    assert source.kv_stalls > 0
    for i in (3, 5):
        assert torch.equal(torch.cat(got[f"r{i}"]), solo(bundle, i)), i


def test_admission_waits_for_blocks(bundle):
    """The scheduler admits the rows the pool can give the waiting prompt plus growth; it is 0
    while a stream holds the blocks, opens again when it ends, and the wait is counted."""
    prompt = TalkerSource.from_bundle(bundle, max_slots=1).prompt_positions(request(3))
    blocks = -(-(prompt + 1) // 8)
    source = TalkerSource.from_bundle(bundle, max_slots=4, max_seq_len=128, block_size=8, kv_blocks=1 + blocks + 1)
    scheduler = waiting_prompt(Scheduler(max_slots=4), prompt)  # the scheduler holds the waiting prompt
    assert admissible(source, scheduler) == 1, "one prompt plus its growth block fits, not two"
    source.admit(request(3), max_new_tokens=6, non_streaming_mode=MODES[3])
    step(source, scheduler)  # prefilled and decoding: holds its prompt's blocks + 1 reserve
    assert admissible(source, scheduler) == 0 and source.free_rows() == 3
    while source.active_slots:
        step(source, scheduler)
    assert source.admission_waits > 0 and admissible(source, scheduler) == 1 and source.cache.used_blocks == 0
    source.check_fits(prompt)
    with pytest.raises(ValueError, match="--kv-cache-gb"):
        source.check_fits(8 * (blocks + 1))  # more blocks than the pool: it would wait forever
    with pytest.raises(ValueError, match="max_seq_len"):
        source.check_fits(128)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _decode_ops(bundle, rows: int) -> int:
    """Dispatched ops of one steady-state tick with ``rows`` decoding rows (same settings). The
    fused-GEMM choice is pinned as on CUDA (on CPU it is measured and may switch to separate
    GEMMs above some rows, which changes the op count, not the ops' shapes' static-ness)."""
    source = TalkerSource.from_bundle(bundle, max_slots=rows, max_seq_len=128)
    scheduler = Scheduler(max_slots=rows, prefill_token_budget=4096)
    for layer in bundle.talker.model.layers:
        layer.self_attn.fused_rows = layer.mlp.fused_rows = float("inf")
    for i in range(rows):
        source.admit(SynthesisRequest(id=f"s{i}", text=TEXTS[i % 8], voice=VOICES[i % 8], language=LANGS[i % 8],
                                      temperature=0.8, seed=i, top_p=0.9), max_new_tokens=40)
    step(source, scheduler)  # prefill + first step
    with torch.no_grad(), _CountOps() as counter:
        step(source, scheduler)
    assert source.last_batch_rows == rows
    return counter.ops


def test_decode_step_op_count_does_not_grow_with_the_batch(bundle):
    assert _decode_ops(bundle, 1) == _decode_ops(bundle, 64)


def test_the_adapter_builds_the_source_with_the_runners_its_switches_ask_for(bundle):
    """The static step on a CPU (as a GPU runs it): the decode step's and the prompts' runners are
    made from the source's own specs while it is built - nothing is set on it afterwards - and are
    the graphs its pipeline captures at start; the switches' batched admission too. Without: eager."""
    from dataclasses import replace

    from engines.config import EngineConfig, RuntimeSwitches
    from engines.pipelines.profile import PipelineSetup
    from engines.pipelines.talker.adapter import real_source
    from engines.runtime.graphed_prefill import GraphedPrefill
    from engines.runtime.graphed_talker import GraphedTalkerStep

    switches = RuntimeSwitches(static_step_on_cpu=True, batched_admission=False)
    setup = PipelineSetup(models=None, parts=bundle, device=torch.device("cpu"), dtype=torch.float32, max_slots=3,
                          vocalizer=None, config=EngineConfig.for_tests(switches=switches))
    source, graphed = real_source(setup)
    assert isinstance(source.step_runner, GraphedTalkerStep) and isinstance(source.prefill.runner, GraphedPrefill)
    assert source.step_runner.buckets == (1, 2, 3) and source.batched_admission is False
    assert graphed == source.graphed == (source.step_runner, source.prefill.runner)
    plain, graphed = real_source(replace(setup, config=EngineConfig.for_tests()))
    assert (plain.step_runner, plain.prefill.runner, graphed) == (None, None, ())


@pytest.mark.parametrize("greedy", [True, False])
def test_static_buckets_with_scratch_padding_change_no_code(bundle, greedy):
    """The graphed runner's static path (rows padded with the scratch row to 1/2/4/8, KV blocks
    rounded up to a power of two) run eagerly on CPU: every code equals the solo reference."""
    from engines.runtime.graphed_talker import GraphedTalkerStep

    seeds = [31, 32, 33, 34, 35, 36, 37, 38]
    expected = {f"r{i}": solo(bundle, i, greedy=greedy, seed=seeds[i]) for i in range(8)}
    source = TalkerSource.from_bundle(bundle, max_slots=6, max_seq_len=128, block_size=4,
                                      runners=SourceRunners(step=GraphedTalkerStep))
    assert source.step_runner.buckets == (1, 2, 4, 6) and source.step_runner.shape(5, 3) == (6, 4)
    codes, _, ticks = run(source, list(range(8)), greedy=greedy, seeds=seeds,
                          scheduler=Scheduler(max_slots=6, prefill_token_budget=16))
    for rid, want in expected.items():
        assert torch.equal(codes.get(rid, want[:0]), want), rid
    assert {rows for rows, _ in ticks} - {0, 1, 2, 4, 6}, "some steps really were padded"


def test_a_long_text_does_not_move_the_buffers_a_graphed_step_reads(bundle):
    """Captured graphs read the per-row buffers by address; moving one drops every graph, and each
    is captured again on first use while streams play. A source that hands out a step spec sizes
    its trailing-text buffer first, so a long sentence (here ~120 trailing text parts) moves nothing."""
    source = TalkerSource.from_bundle(bundle, max_slots=2, max_seq_len=512)
    spec = source.step_spec()
    version = spec.buffers_version()
    long_text = " ".join(["streaming speech, sentence by sentence"] * 20)
    source.admit(SynthesisRequest(id="long", text=long_text, voice=VOICES[0], language=LANGS[0], greedy=True,
                                  non_streaming_mode=False),  # streaming layout: the text trails
                 max_new_tokens=6)
    held = 0  # the most trailing text parts a row held (the long text's, while it speaks)
    for _ in range(4):
        step(source)
        held = max(held, int(source.state.trail_len.max()))
    assert held > 100
    assert spec.buffers_version() == version


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_per_bucket_equals_the_eager_step():
    from engines.runtime.graphed_talker import GraphedTalkerStep

    cuda_bundle = make_bundle(seed=3, eos_gain=1.2, max_new_tokens=40, device="cuda")
    eager = TalkerSource.from_bundle(cuda_bundle, max_slots=8, max_seq_len=128)
    want, _, _ = run(eager, list(range(8)), greedy=False, seeds=list(range(8)))
    graphed = TalkerSource.from_bundle(cuda_bundle, max_slots=8, max_seq_len=128,
                                       runners=SourceRunners(step=GraphedTalkerStep))
    graphed.step_runner.capture_all(max_blocks=2)
    got, _, _ = run(graphed, list(range(8)), greedy=False, seeds=list(range(8)))
    assert graphed.step_runner.captures > 0
    for rid in want:
        assert torch.equal(got[rid].cpu(), want[rid].cpu()), rid


def test_fused_projections_are_views_and_change_no_output():
    """fuse_projections(): q/k/v and gate/up become views of one matrix each (state_dict and
    memory unchanged) and the layer outputs are bitwise the unfused ones (fp32, CPU)."""
    plain, fused = make_bundle(seed=5).talker, make_bundle(seed=5).talker
    fused.fuse_projections()
    layer = fused.model.layers[0]
    assert layer.self_attn.q_proj.weight.data_ptr() == layer.self_attn.qkv_weight.data_ptr()
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == layer.mlp.gate_up.untyped_storage().data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), fused.state_dict().values()))
    x = torch.randn(3, 5, plain.cfg.hidden_size)
    cos, sin = plain.rope_table(8, torch.float32)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    with torch.no_grad():
        want = DecoderLayer.forward(plain.model.layers[0], x, cos[None, :5], sin[None, :5], mask)
        got = DecoderLayer.forward(layer, x, cos[None, :5], sin[None, :5], mask)
    assert torch.equal(got, want)


def test_a_long_prompt_prefills_in_chunks_while_others_keep_speaking(bundle):
    """The scheduler's prefill_token_budget 4: r3's 10-position prompt takes 3 ticks; r0 emits a
    frame in each of them, r3 its first frame in the third (prefill done, decode in the same tick);
    both still equal their solo codes. (The prefix cache is off: r3 would read r0's shared
    positions from it and need fewer chunks.)"""
    source = TalkerSource.from_bundle(bundle, max_slots=2, max_seq_len=128, prefix_cache_fraction=0)
    scheduler = Scheduler(max_slots=2, prefill_token_budget=4)
    source.admit(request(0), max_new_tokens=MAX_NEW[0], non_streaming_mode=MODES[0])
    got: dict[str, list] = {"r0": [], "r3": []}
    for _ in range(5):  # r0: prompt in 4 ticks, then speaking
        for f in step(source, scheduler):
            got[f.request_id].append(f.codes)
    source.admit(request(3), max_new_tokens=MAX_NEW[3], non_streaming_mode=MODES[3])
    for tick in range(3):
        out = step(source, scheduler)
        speaking = [f.request_id for f in out if f.codes.shape[0]]
        assert speaking == (["r0"] if tick < 2 else ["r0", "r3"]), (tick, speaking)
        for f in out:
            got[f.request_id].append(f.codes)
    while source.active_slots:
        for f in step(source, scheduler):
            got[f.request_id].append(f.codes)
    for i in (0, 3):
        assert torch.equal(torch.cat(got[f"r{i}"]), solo(bundle, i)), i


def test_the_source_prefills_exactly_what_the_plan_allows(bundle):
    """The source keeps no prefill budget of its own: each tick it prefills the positions the
    scheduler's plan gives (budget 5 here, three queued prompts), and a hand-made plan just as
    exactly, however small; the codes still equal the solo ones."""
    with pytest.raises(TypeError):
        TalkerSource.from_bundle(bundle, max_slots=3, prefill_token_budget=5)
    source = TalkerSource.from_bundle(bundle, max_slots=3, max_seq_len=128, prefix_cache_fraction=0)
    for i in range(3):
        source.admit(request(i), max_new_tokens=MAX_NEW[i], non_streaming_mode=MODES[i])
    before = source.capacity().prefill_waiting
    source.tick(StepPlan(prefill=(2,)))  # not the scheduler's: two positions of the oldest prompt
    assert source.capacity().prefill_waiting == (before[0] - 2,) + before[1:]
    scheduler = Scheduler(max_slots=3, prefill_token_budget=5)
    got: dict[str, list] = {}
    while source.active_slots:
        waiting = source.capacity().prefill_waiting
        plan = scheduler.step_plan(source.capacity())
        assert sum(plan.prefill) == min(5, sum(waiting))
        for f in source.tick(plan):
            got.setdefault(f.request_id, []).append(f.codes)
        assert sum(waiting) - sum(source.capacity().prefill_waiting) == sum(plan.prefill)
    for i in range(3):
        assert torch.equal(torch.cat(got[f"r{i}"]), solo(bundle, i)), i


def test_greedy_rows_mixed_with_sampled_rows_keep_their_codes(bundle):
    """Four greedy (temperature 0) and four sampled rows (top-k 0 / top-p 0.9 / the defaults) in one
    batch: every row equals its solo run (greedy rows: the official greedy codes)."""
    temps = {4: 1.3, 5: 0.7}
    source = TalkerSource.from_bundle(bundle, max_slots=8, max_seq_len=128, block_size=8)
    for i in range(8):
        sampled = i >= 4
        req = SynthesisRequest(id=f"r{i}", text=TEXTS[i], voice=VOICES[i], language=LANGS[i], seed=40 + i,
                               temperature=temps.get(i) if sampled else 0, top_p=0.9 if i == 6 else None,
                               top_k=0 if i == 7 else None)
        source.admit(req, max_new_tokens=MAX_NEW[i], non_streaming_mode=MODES[i])
    got: dict[str, list] = {}
    while source.active_slots:
        for f in step(source):
            got.setdefault(f.request_id, []).append(f.codes)
    for i in range(4):
        assert torch.equal(torch.cat(got[f"r{i}"]), solo(bundle, i)), i
    # the sampled rows alone, one at a time: the same codes
    for i in range(4, 8):
        alone = TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=128)
        req = SynthesisRequest(id=f"r{i}", text=TEXTS[i], voice=VOICES[i], language=LANGS[i], seed=40 + i,
                               temperature=temps.get(i), top_p=0.9 if i == 6 else None, top_k=0 if i == 7 else None)
        alone.admit(req, max_new_tokens=MAX_NEW[i], non_streaming_mode=MODES[i])
        want = []
        while alone.active_slots:
            want += [f.codes for f in step(alone)]
        assert torch.equal(torch.cat(got[f"r{i}"]), torch.cat(want)), i


@pytest.mark.timeout(300)
def test_compiled_talker_layers_equal_the_eager_forward_and_write_the_pool_in_place():
    """Talker.compile_layers (STREAMVOX_COMPILE_TALKER=1): the paged forward through
    torch.compile (inductor, on CPU here) gives the eager hidden states and K/V within fp32
    rounding (1e-5: the same maths in fused kernels); the K/V land in the pool's own storage at
    the written slots, every other slot untouched."""
    bundle = make_bundle(seed=4)
    source = TalkerSource.from_bundle(bundle, max_slots=3, max_seq_len=64, kv_blocks=12)
    talker = bundle.talker
    rows = torch.arange(3)
    for r in rows.tolist():
        source.cache.reserve(r, 24)
    source.cache.flush()
    x = torch.randn(3, 3, talker.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[0, 1, 2], [5, 6, 7], [20, 21, 22]])
    pools = [t.clone() for t in (*source.cache.k, *source.cache.v)]
    storage = [t.data_ptr() for t in (*source.cache.k, *source.cache.v)]
    with torch.no_grad():
        want = talker.forward_paged(x, positions, source.cache, rows, 2, source.rope)
        eager_pools = [t.clone() for t in (*source.cache.k, *source.cache.v)]
        for t, before in zip((*source.cache.k, *source.cache.v), pools):
            t.copy_(before)
        talker.compile_layers("inductor")
        got = talker.forward_paged(x, positions, source.cache, rows, 2, source.rope)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert [t.data_ptr() for t in (*source.cache.k, *source.cache.v)] == storage
    for t, e in zip((*source.cache.k, *source.cache.v), eager_pools):
        torch.testing.assert_close(t, e, rtol=0, atol=1e-5)
    written = source.cache.slots(rows, positions).reshape(-1)
    untouched = torch.ones(source.cache.k[0].shape[0], dtype=torch.bool)
    untouched[written] = False
    assert all(torch.equal(t[untouched], p[untouched]) for t, p in zip((*source.cache.k, *source.cache.v), pools))
