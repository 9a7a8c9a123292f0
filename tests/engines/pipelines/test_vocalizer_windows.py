"""The vocalizer in the default codec precision (bf16 on a CPU with native bf16) decodes on fixed
windows: the same codes give the same PCM (<= 1 LSB of 16-bit audio) whatever the chunks they come
in, the streams decoded beside them and the caller's thread count, and a padded window never
reaches the samples it returns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.build import resolve_codec_dtype
from engines.config import get_preset
from engines.models.codec_decoder import CodecDecoder
from engines.models.init import init_module_
from engines.pipelines.vocoder import WINDOW_FRAMES, VocalizeItem, Vocalizer, window_frames

TINY = get_preset("tiny")
G, V = TINY.num_code_groups, TINY.decoder.codebook_size
FRAMES = 24
LSB = 1 / 32768  # one step of 16-bit PCM
DEFAULT = resolve_codec_dtype("auto", torch.device("cpu"), torch.float32)
DECODERS: dict[torch.dtype, CodecDecoder] = {}  # one per precision (a vocalizer casts its decoder in place)


def codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (frames, G), generator=torch.Generator().manual_seed(seed))


def vocalizer(dtype: torch.dtype = DEFAULT) -> Vocalizer:
    if dtype not in DECODERS:
        DECODERS[dtype] = init_module_(CodecDecoder(TINY.decoder), 2).eval()
    return Vocalizer(DECODERS[dtype], "cpu", dtype)


def chunked(voc: Vocalizer, stream: str, c: torch.Tensor, sizes: list[int], offset: int = 0) -> torch.Tensor:
    out = []
    for n in sizes:
        out.append(voc.vocalize([VocalizeItem(stream, c[offset:offset + n], offset)])[0].pcm)
        offset += n
    return torch.cat(out)


def lsb(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / LSB).item()


C = codes(FRAMES, 7)


@pytest.fixture(scope="module", params=sorted({DEFAULT, torch.bfloat16}, key=str))
def reference(request):
    """(dtype, the codes decoded in one call)."""
    return request.param, vocalizer(request.param).vocalize([VocalizeItem("s", C, 0)])[0].pcm


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7, 16])
def test_equal_chunks_of_any_size_give_the_same_pcm(reference, size):
    dtype, whole = reference
    sizes = [size] * (FRAMES // size) + ([FRAMES % size] if FRAMES % size else [])
    assert lsb(chunked(vocalizer(dtype), "s", C, sizes), whole) <= 1


@settings(max_examples=12, deadline=None)
@given(cuts=st.lists(st.integers(1, FRAMES - 1), max_size=8, unique=True))
def test_random_chunkings_give_the_same_pcm(cuts):
    ends = sorted(cuts) + [FRAMES]
    sizes = [b - a for a, b in zip([0] + ends[:-1], ends)]
    whole = vocalizer().vocalize([VocalizeItem("s", C, 0)])[0].pcm
    assert lsb(chunked(vocalizer(), "s", C, sizes), whole) <= 1


def test_neighbours_and_the_callers_threads_do_not_change_a_stream():
    """Alone in one call at one thread; then in three chunks at two threads, each call beside six
    streams in chunks of other sizes (the served crowd: a stream's chunks follow the load)."""
    sizes = [3, 5, 16]
    others = {f"o{i}": (codes(FRAMES, 100 + i), [2 + i, 1, FRAMES - 3 - i]) for i in range(6)}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = vocalizer().vocalize([VocalizeItem("target", C, 0)])[0].pcm
        torch.set_num_threads(2)
        voc, got, starts = vocalizer(), [], [0, 3, 8]
        for k, start in enumerate(starts):
            items = []
            for i, (name, (c, cuts)) in enumerate(others.items()):
                a = sum(cuts[:k])
                items.append(VocalizeItem(name, c[a:a + cuts[k]], a))
            items.insert(k + 1, VocalizeItem("target", C[start:start + sizes[k]], start))
            got.append(next(r.pcm for r in voc.vocalize(items) if r.stream_id == "target"))
    finally:
        torch.set_num_threads(before)
    assert lsb(torch.cat(got), alone) <= 1


def test_a_primed_stream_gives_the_same_pcm_in_any_chunks():
    """In-context cloning primes the stream with reference frames first (they end inside a window)."""
    ref = codes(7, 11)
    whole, cut = vocalizer(), vocalizer()
    whole.prime("s", ref)
    cut.prime("s", ref)
    assert lsb(chunked(cut, "s", C, [1, 6, 2, 15]), whole.vocalize([VocalizeItem("s", C, 0)])[0].pcm) <= 1


def test_a_failed_call_changes_no_stream():
    voc, other = vocalizer(), vocalizer()
    first = chunked(voc, "s", C, [3])
    chunked(other, "s", C, [3])
    with pytest.raises(ValueError, match="codes must be int64"):
        voc.vocalize([VocalizeItem("s", C[3:6], 3), VocalizeItem("t", C[:2].float(), 0)])
    assert voc.open_streams() == 1
    assert lsb(chunked(voc, "s", C, [5], offset=3), chunked(other, "s", C, [5], offset=3)) <= 1
    assert first.numel() == 3 * 1920


def test_windows_follow_a_streams_first_chunks_then_a_fixed_size():
    assert [window_frames(p) for p in (0, 1, 2, 4, 8, 12)] == [1, 1, 2, 4, 4, 4] and WINDOW_FRAMES == 4


def test_chunks_that_end_on_window_ends_decode_each_window_once():
    voc, calls = vocalizer(), []
    decode_step = voc.decoder.decode_step

    def counted(codes, state):
        calls.append(codes.shape[-1])
        return decode_step(codes, state)

    voc.decoder.decode_step = counted
    try:
        chunked(voc, "s", C, [1, 1, 2, 4, 8])  # a stream's chunks as the scheduler cuts them
        assert calls == [1, 1, 2, 4, 4, 4]
        calls.clear()
        chunked(voc, "s", C, [1, 2, 1], offset=16)  # a window padded twice, then decoded whole
        assert calls == [WINDOW_FRAMES] * 3
    finally:
        del voc.decoder.decode_step


@pytest.mark.parametrize("op", ["linear", "conv", "transposed conv", "attention"])
def test_a_kernel_of_fixed_shapes_computes_each_row_from_that_row_alone(op):
    """What the windows rest on, per kernel kind the decoder runs (bf16, two threads): the rows
    after row r changed, the same shapes give rows 0..r bit for bit."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).bfloat16()  # noqa: E731
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if op == "linear":
            w, x = rand(1536, 1024), rand(1, 17, 1024)
            f, cut = (lambda x: F.linear(x, w)), (lambda y, r: y[:, :r])
            later = lambda x, r: x[:, r:]  # noqa: E731
        elif op == "conv":
            w, x = rand(384, 384, 7), rand(1, 384, 300)
            f, cut = (lambda x: F.conv1d(x, w)), (lambda y, r: y[..., :r])
            later = lambda x, r: x[..., r + 6:]  # noqa: E731
        elif op == "transposed conv":
            w, x = rand(768, 384, 10), rand(1, 768, 40)
            f, cut = (lambda x: F.conv_transpose1d(x, w, stride=5)), (lambda y, r: y[..., :r * 5])
            later = lambda x, r: x[..., r:]  # noqa: E731
        else:
            q, k, v = rand(1, 16, 8, 64), rand(1, 16, 80, 64), rand(1, 16, 80, 64)
            mask = torch.ones(8, 80, dtype=torch.bool).tril(72)
            x = torch.cat([q, k[:, :, 72:], v[:, :, 72:]], dim=1)  # the rows that change: this chunk's
            past_k, past_v = k[:, :, :72], v[:, :, :72]

            def f(x):
                q, kk, vv = x[:, :16], torch.cat([past_k, x[:, 16:32]], 2), torch.cat([past_v, x[:, 32:]], 2)
                return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)

            cut, later = (lambda y, r: y[:, :, :r]), (lambda x, r: x[:, :, r:])
        y = f(x)
        for r in (1, 3, 5):
            changed = x.clone()
            later(changed, r).copy_(rand(*later(changed, r).shape))
            assert torch.equal(cut(f(changed), r), cut(y, r)), f"{op}: rows < {r} changed"
    finally:
        torch.set_num_threads(before)
