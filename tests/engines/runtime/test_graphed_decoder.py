"""GraphedDecoder: the streaming codec decoder over a static state pool, one CUDA graph per (rows, length).

On CPU the wrapper runs the same static-buffer path eagerly (use_graphs=False), so these
tests prove that decoding through the pool (gather rows, decode_step, scatter back;
padded rows and padded final chunks) equals plain ``decode_step`` per stream with its
own carried state (1e-5, fp32: batched convs/GEMMs round differently), that rows are
reset when reused, that padding rows touch only the scratch row, that the buffers never
move and that the step reads nothing on the host. The CUDA twins at the end check
graphed == eager and no host sync; they are skipped without CUDA.
"""

from __future__ import annotations

import logging

import pytest
import torch
from host_read_helpers import HostReadOrUpload, NoHostReads

from engines.config import EngineConfig, get_preset
from engines.models.codec_decoder import CodecDecoder
from engines.models.init import init_module_
from engines.pipelines.vocoder import VocalizeItem, Vocalizer
from engines.runtime.graphed_decoder import FOR_CONFIG_SPLIT_LENGTHS, GraphedDecoder
from engines.runtime.graphed_dit import max_chunk_frames

TOL = 1e-5
SPF = 1920
TINY = get_preset("tiny")


def make_decoder(preset: str = "tiny", device: str = "cpu", seed: int = 7) -> CodecDecoder:
    return init_module_(CodecDecoder(get_preset(preset).decoder), seed).eval().to(device)


def chunk_lengths(preset: str = "tiny") -> tuple[int, int, int]:
    s = get_preset(preset).stream
    return (s.first_chunk_frames, s.chunk_frames, max_chunk_frames(s))  # tiny: 4, 12, 15; small: 12, 25, 36


def codes(dec: CodecDecoder, t: int, seed: int, device="cpu") -> torch.Tensor:
    """[t, G] random codes (the GraphedDecoder / vocalizer layout)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, dec.cfg.codebook_size, (t, dec.cfg.num_quantizers), generator=g).to(device)


class Reference:
    """Plain decode_step per stream, batch 1, carried DecoderState (what the pool must equal)."""

    def __init__(self, dec: CodecDecoder):
        self.dec, self.states = dec, {}

    def __call__(self, items):
        out = []
        for sid, c, is_last in items:
            if c.shape[0] == 0:
                out.append(None)
                continue
            state = self.states.get(sid) or self.dec.init_state(1, c.device)
            wav, self.states[sid] = self.dec.decode_step(c.T[None], state)
            out.append(wav[0])
            if is_last:
                self.states.pop(sid)
        return out


def check_call(g: GraphedDecoder, ref: Reference, items, atol=TOL):
    got, want = g.decode(items), ref(items)
    for (sid, c, _), a, b in zip(items, got, want):
        assert a.shape == (c.shape[0] * SPF,), sid
        if b is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=lambda m: f"stream {sid}: {m}")
    return got


def schedule(dec: CodecDecoder, lengths):
    """Interleaved streams, staggered starts, chunk lengths on and off the graphed ones, final
    chunks padded, two items of one stream in one call, a finished stream's row reused.
    Yields (items, expected fallback steps in this call)."""
    a, b, c = lengths
    s = iter(range(1000))
    k = lambda t: codes(dec, t, next(s))  # noqa: E731
    yield [("A", k(a), False)], 0
    yield [("A", k(b), False), ("B", k(a), False)], 0
    yield [("B", k(b), False), ("A", k(b), False), ("C", k(a), False)], 0
    # A ends with a short final chunk (padded to a); C's 7-frame middle chunk is no chunk length (eager).
    yield [("A", k(3), True), ("B", k(b), False), ("C", k(7), False)], 1
    # D starts after A finished (takes its row); B ends with a longest chunk; E is empty.
    yield [("D", k(a), False), ("B", k(c), True), ("C", k(b), False), ("E", k(0), False)], 0
    # Two items of D in one call (two rounds); C's final chunk is longer than a (padded to b).
    yield [("D", k(b), False), ("C", k(a + 1), True), ("D", k(a), False)], 0
    # D's final chunk is padded to c; F's only chunk is final but longer than every length: cut
    # into c + 2 (the 2-frame final piece padded to a), no eager step.
    yield [("D", k(b + 2), True), ("F", k(c + 2), True)], 0

# --------------------------------------------------------------------------- causality (padding the final chunk)


def padding_error(dec: CodecDecoder) -> float:
    """max |decode(final 5 frames) - decode(5 frames + 3 zero frames)[:5 * 1920]| after a 6-frame chunk."""
    state = dec.decode_step(codes(dec, 6, 1).T[None], dec.init_state(1))[1]
    last = codes(dec, 5, 2)
    plain = dec.decode_step(last.T[None], state)[0]
    padded = dec.decode_step(torch.cat([last, torch.zeros_like(last[:3])]).T[None], state)[0]
    return (padded[:, : 5 * SPF] - plain).abs().max().item()


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_padding_a_final_chunk_does_not_change_its_samples(preset, monkeypatch):
    dec = make_decoder(preset)
    assert padding_error(dec) < TOL  # strictly causal: appended frames cannot reach earlier samples
    # Mutation: one sample of lookahead in the output conv. The same check must see it.
    conv = dec.decoder[-1]
    step = conv.step
    monkeypatch.setattr(conv, "step", lambda x, st: (lambda y: y + 0.5 * torch.nn.functional.pad(y[..., 1:], (0, 1)))(
        step(x, st)))
    assert padding_error(dec) > 1e-3


# --------------------------------------------------------------------------- numerics through the pool


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_pool_equals_plain_decode_step_per_stream(preset, caplog):
    dec = make_decoder(preset)
    g = GraphedDecoder(dec, max_streams=4, chunk_lengths=chunk_lengths(preset), use_graphs=False)
    assert g.row_buckets == (1, 2, 4) and g.pool.batch == 5 and g.scratch_row == 4
    ref = Reference(dec)
    fallbacks = 0
    rows_of_a = None
    with caplog.at_level(logging.WARNING, logger="streamvox.graphed_decoder"):
        for n, (items, eager) in enumerate(schedule(dec, chunk_lengths(preset))):
            check_call(g, ref, items)
            fallbacks += eager
            assert g.fallback_calls == fallbacks, n
            if n == 0:
                rows_of_a = g.row_of("A")
            if n == 3:
                assert g.row_of("A") is None  # released after its last chunk
            if n == 4:
                assert g.row_of("D") == rows_of_a  # reused, and decoded like a fresh init_state
                assert g.row_of("B") is None and g.row_of("E") is None  # an empty item takes no row
    assert g.open_streams() == 0 and sorted(g._free) == [0, 1, 2, 3]
    assert sum("outside the graphed chunk lengths" in r.getMessage() for r in caplog.records) == 1


def test_acquired_row_is_reset_to_init_state():
    dec = make_decoder()
    g = GraphedDecoder(dec, 2, (4,), use_graphs=False)
    g.decode([("x", codes(dec, 4, 0), False)])
    row = g.row_of("x")
    assert g.pool.position[row] == 4 and g.pool.keys[0][row].abs().sum() > 0
    g.release("x")
    g.release("x")  # unknown / already released ids are ignored
    assert g.acquire("y") == row
    fresh = dec.init_state(1)
    for have, want in zip(g._state_tensors(), [t for t in (*fresh.conv, *fresh.keys, *fresh.values, fresh.position)
                                               if t.numel()]):
        assert torch.equal(have[row:row + 1], want)
    assert g.acquire("y") == row  # acquire is idempotent for an open stream


def test_padding_rows_and_other_streams_rows_are_untouched():
    dec = make_decoder()
    g = GraphedDecoder(dec, 6, (4, 12), use_graphs=False)
    pointers = g.static_pointers()
    g.decode([(s, codes(dec, 4, i), False) for i, s in enumerate("abcde")])  # buckets (1, 2, 4, 6): one padding row
    before = [x.clone() for x in g._state_tensors()]
    busy = [g.row_of(s) for s in "abc"]
    g.decode([(s, codes(dec, 12, 10 + i), False) for i, s in enumerate("abc")])  # bucket 4: one padding row
    assert g._index[:4].tolist() == busy + [g.scratch_row]
    untouched = [r for r in range(g.pool.batch) if r not in busy and r != g.scratch_row]
    for x, y in zip(g._state_tensors(), before):
        assert torch.equal(x[untouched], y[untouched])  # streams d, e and the free row
        assert not torch.equal(x[busy], y[busy])
    assert (g.pool.position[busy] == 16).all() and (g.pool.position[[g.row_of("d"), g.row_of("e")]] == 4).all()
    assert torch.isfinite(g.graphs.outputs[(4, 12)]).all()  # the padding row's output too
    for R, T in [(1, 4), (2, 12), (6, 4)]:
        g.decode([(s, codes(dec, T, R), False) for s in "abcdef"[:R]])
    assert g.static_pointers() == pointers


def test_output_is_a_fresh_tensor():
    dec = make_decoder()
    g = GraphedDecoder(dec, 2, (4,), use_graphs=False)
    (a,) = g.decode([("x", codes(dec, 4, 0), False)])
    kept = a.clone()
    g.decode([("x", codes(dec, 4, 1), False)])  # same bucket: overwrites the static output, not a
    assert torch.equal(a, kept) and a.data_ptr() != g.graphs.outputs[(1, 4)].data_ptr()


def test_batches_beyond_the_largest_bucket_are_split():
    dec = make_decoder()
    g = GraphedDecoder(dec, 5, (4,), row_buckets=(1, 2), use_graphs=False)
    ref = Reference(dec)
    for n in range(2):
        check_call(g, ref, [(s, codes(dec, 4, 10 * n + i), False) for i, s in enumerate("vwxyz")])
    assert g.fallback_calls == 0 and set(g.graphs.outputs) == {(1, 4), (2, 4)}


def test_pool_full_raises_before_any_state_changes():
    dec = make_decoder()
    g = GraphedDecoder(dec, 2, (4,), use_graphs=False)
    g.decode([("a", codes(dec, 4, 0), False)])
    before = [x.clone() for x in g._state_tensors()]
    with pytest.raises(RuntimeError, match="decoder state pool is full"):
        g.decode([("a", codes(dec, 4, 1), False), ("b", codes(dec, 4, 2), False), ("c", codes(dec, 4, 3), False)])
    assert g.open_streams() == 1 and all(torch.equal(x, y) for x, y in zip(g._state_tensors(), before))
    with pytest.raises(RuntimeError, match="pool is full"):
        for s in "bcd":
            g.acquire(s)


def test_argument_checks_and_config():
    dec = make_decoder()
    with pytest.raises(ValueError, match="max_streams"):
        GraphedDecoder(dec, 0, (4,))
    with pytest.raises(ValueError, match="chunk_lengths"):
        GraphedDecoder(dec, 2, ())
    with pytest.raises(ValueError, match="row buckets"):
        GraphedDecoder(dec, 2, (4,), row_buckets=(1, 4))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA graphs need the decoder on a CUDA device"):
            GraphedDecoder(dec, 2, (4,), use_graphs=True)
    g = GraphedDecoder.for_config(dec, TINY, 8)
    assert g.chunk_lengths == (1, 2, 4, 8, 12, 15) and g.row_buckets == (1, 2, 4, 8) and not g.use_graphs
    assert GraphedDecoder.for_config(dec, TINY, 40).row_buckets == (1, 2, 4, 8, 16)  # capped; larger batches split
    assert g.graph_length(12, False) == 12 and g.graph_length(5, False) is None and g.graph_length(5, True) == 8  # for_config's split length 8
    assert g.graph_length(16, True) is None
    with pytest.raises(ValueError, match="codes must be integer"):
        g.decode([("a", codes(dec, 5, 0).T, False)])  # [G, t] is the wrong layout
    g.capture_all()  # CPU: a no-op
    assert g.captured == ()


def test_step_has_no_host_reads():
    """What a graph captures (_step) issues no host read / host->device upload; the whole call
    (which uploads the row indices from the host on purpose, pinned and non-blocking on CUDA)
    reads no device value on the host."""
    dec = make_decoder()
    g = GraphedDecoder(dec, 4, (4, 12), use_graphs=False)
    items = [(s, codes(dec, 4, i), False) for i, s in enumerate("abc")]
    g.decode(items)
    g._load(items, [0, 1, 2], 4, 4)
    with torch.no_grad(), HostReadOrUpload(), NoHostReads():
        g._step((4, 4))
    with torch.no_grad(), NoHostReads():
        g.decode([("a", codes(dec, 3, 5), True), ("b", codes(dec, 12, 6), False), ("c", codes(dec, 7, 7), False)])
    with pytest.raises(AssertionError, match="capture hazard"), torch.no_grad(), HostReadOrUpload():
        g.pool.select([0])  # DecoderState.select uploads host indices: the guard does catch it


# --------------------------------------------------------------------------- through the vocalizer


def test_vocalizer_with_a_graphed_decoder_equals_the_plain_one():
    decoder = init_module_(CodecDecoder(TINY.decoder), 2).eval()
    plain = Vocalizer(decoder, "cpu")
    g = GraphedDecoder(decoder, 4, chunk_lengths(), use_graphs=False)
    voc = Vocalizer(decoder, "cpu", graphed_decoder=g)
    calls = [
        [VocalizeItem("a", codes(decoder, 4, 0), 0), VocalizeItem("b", codes(decoder, 4, 1), 0)],
        [VocalizeItem("a", codes(decoder, 12, 2), 4), VocalizeItem("b", codes(decoder, 5, 3), 4, is_last=True),
         VocalizeItem("c", codes(decoder, 4, 9), 0)],
        [VocalizeItem("a", codes(decoder, 9, 4), 16), VocalizeItem("c", codes(decoder, 12, 8), 4),
         VocalizeItem("d", codes(decoder, 0, 5), 0)],
    ]
    for n, items in enumerate(calls):
        want, got = plain.vocalize(items), voc.vocalize(items)
        for w, r in zip(want, got):
            assert torch.equal(w.codes, r.codes)
            assert r.pcm.dtype == torch.float32 and r.pcm.shape == w.pcm.shape
            torch.testing.assert_close(r.pcm, w.pcm, rtol=0, atol=TOL)
        assert voc.open_streams() == plain.open_streams()
        if n == 1:
            assert g.row_of("b") is None and g.open_streams() == 2  # b's last chunk released its row
    assert g.fallback_calls == 1  # a's 9-frame middle chunk
    with pytest.raises(ValueError, match="chunks must be contiguous"):
        voc.vocalize([VocalizeItem("a", codes(decoder, 4, 6), 0)])  # next_frame is still tracked
    voc.close("a")
    voc.close("zzz")
    assert g.row_of("a") is None and voc.open_streams() == 1 and g.open_streams() == 1
    with pytest.raises(RuntimeError, match="streams are open"):
        voc.graphed_decoder = None
    voc.close("c")
    voc.graphed_decoder = None  # nothing open: back to the plain path
    with pytest.raises(ValueError, match="must wrap this vocalizer's decoder"):
        voc.graphed_decoder = GraphedDecoder(make_decoder(), 2, (4,), use_graphs=False)


def test_cpu_engine_has_no_graphed_decoder():
    from engines.build import build_engine

    engine = build_engine(EngineConfig.for_tests(warmup=False))
    assert engine.vocalizer.graphed_decoder is None


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (none visible to torch)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graphs_equal_eager_and_replay_without_sync(dtype, monkeypatch):
    # fp32 means fp32: cuDNN convs default to TF32, whose rounding (~1e-3) would swamp the
    # batched-vs-batch-1 comparison with plain decode_step below.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    dec = make_decoder(device="cuda").to(dtype)
    lengths = chunk_lengths()
    eager = GraphedDecoder(dec, 4, lengths, use_graphs=False)
    g = GraphedDecoder(dec, 4, lengths)
    assert g.use_graphs
    g.capture_all()
    assert len(g.captured) == len(g.row_buckets) * len(lengths)
    assert not g.pool.position[: g.scratch_row].any()  # warm-up and capture touched only the scratch row
    assert g.pool.position[g.scratch_row] > 0
    pointers = g.static_pointers()
    ref = Reference(dec)
    for items, _ in schedule(dec, lengths):
        items = [(s, c.cuda(), last) for s, c, last in items]
        want = eager.decode(items)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = g.decode(items)  # copies in, pinned row upload, replay, copy out: no host sync
        finally:
            torch.cuda.set_sync_debug_mode("default")
        plain = ref(items)
        for a, b, p in zip(got, want, plain):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=0, atol=TOL if dtype == torch.float32 else 2e-2)
            if dtype == torch.float32 and p is not None:
                torch.testing.assert_close(a, p, rtol=0, atol=TOL)
    assert g.fallback_calls == eager.fallback_calls == sum(eager_steps for _, eager_steps in schedule(dec, lengths))
    assert g.static_pointers() == pointers
    assert len(g.captured) == len(g.row_buckets) * len(lengths)  # no capture after capture_all
    assert g.open_streams() == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (none visible to torch)")
def test_cuda_engine_graphs_the_decoder_before_ready():
    from engines.build import build_engine

    engine = build_engine(EngineConfig().updated(preset="tiny", device="cuda", warmup=True))
    g = engine.vocalizer.graphed_decoder
    assert isinstance(g, GraphedDecoder) and g.use_graphs and g.captured == ()
    assert g.max_streams == 2 * TINY.stream.max_slots
    assert g.chunk_lengths == tuple(sorted({*chunk_lengths(), *FOR_CONFIG_SPLIT_LENGTHS}))  # split pieces too
    engine.start()  # captures every bucket, then the warm-up request decodes through the pool
    try:
        assert len(g.captured) == len(g.row_buckets) * len(g.chunk_lengths)
        assert engine.stats().ready and g.open_streams() == 0
    finally:
        engine.stop()


def test_chunks_without_a_graph_are_cut_into_graphed_pieces(caplog):
    """With split lengths (what the engine uses), a non-final chunk of any length decodes as
    consecutive graphed pieces (streaming steps compose), equal to one plain decode_step of
    the whole chunk within 1e-5, and nothing runs eagerly."""
    dec = make_decoder("small")
    first, chunk, longest = chunk_lengths("small")
    g = GraphedDecoder(dec, 4, (first, chunk, longest), use_graphs=False, split_lengths=(1, 2, 4, 8))
    assert g.pieces(30, False) == [25, 4, 1] and g.pieces(13, False) == [12, 1] and g.pieces(25, False) == [25]
    assert g.pieces(40, True) == [36, 4] and g.pieces(3, True) == [3]  # final: last piece padded when run
    assert g.graph_length(3, True) == 4
    plain = GraphedDecoder(dec, 4, (first, chunk, longest), use_graphs=False)
    assert plain.pieces(30, False) == [30]  # no exact cut without split lengths: eager, whole
    ref = Reference(dec)
    s = iter(range(100))
    calls = [[("a", codes(dec, first, next(s)), False), ("b", codes(dec, 13, next(s)), False)],
             [("a", codes(dec, 30, next(s)), False), ("b", codes(dec, 35, next(s)), False)],
             [("a", codes(dec, 19, next(s)), True), ("b", codes(dec, 40, next(s)), True)]]
    with caplog.at_level(logging.WARNING, logger="streamvox.graphed_decoder"):
        for items in calls:
            check_call(g, ref, items)
    assert g.fallback_calls == 0 and not caplog.records and g.open_streams() == 0
