"""Vocalizer: code frames -> PCM, per-stream streaming decode batched across streams.

PCM within 1e-5 of a one-shot decode (fp32 rounding of batched vs single convs, see
test_codec_decoder.py for the tolerance's rationale).
"""

from __future__ import annotations

import pytest
import torch

from engines.config import get_preset
from engines.models.codec_decoder import CodecDecoder
from engines.models.init import init_module_
from engines.pipelines.vocoder import VocalizeItem, Vocalizer

TINY = get_preset("tiny")
G, V = TINY.num_code_groups, TINY.decoder.codebook_size


def codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (frames, G), generator=torch.Generator().manual_seed(seed))


def make_decoder(seed: int = 2) -> CodecDecoder:
    return init_module_(CodecDecoder(TINY.decoder), seed).eval()


def make_vocalizer(decoder: CodecDecoder | None = None) -> Vocalizer:
    return Vocalizer(decoder or make_decoder(), device="cpu")


def test_result_shapes_and_audio():
    c = codes(6, 0)
    (res,) = make_vocalizer().vocalize([VocalizeItem("a", c, 0)])
    assert res.stream_id == "a" and torch.equal(res.codes, c)
    assert res.pcm.shape == (6 * 1920,) and res.pcm.dtype == torch.float32
    assert torch.isfinite(res.pcm).all() and res.pcm.pow(2).mean().sqrt() > 0.01


def test_a_stream_does_not_depend_on_its_batch_neighbours():
    target = VocalizeItem("target", codes(5, 0), 0)
    alone = make_vocalizer().vocalize([target])[0]
    others = [VocalizeItem(f"o{i}", codes(5 if i % 2 else 3 + i, 100 + i), 0) for i in range(7)]
    crowd = make_vocalizer().vocalize(others[:3] + [target] + others[3:])
    assert crowd[3].stream_id == "target"
    torch.testing.assert_close(crowd[3].pcm, alone.pcm, rtol=0, atol=1e-5)


def test_chunked_stream_equals_one_shot():
    decoder, c = make_decoder(), codes(20, 7)
    full = decoder(c.T[None])[0]
    voc = make_vocalizer(decoder)
    chunks, offset = [], 0
    for n in (4, 9, 7):  # the middle chunk crosses the decoder's 8-frame attention window
        chunks.append(voc.vocalize([VocalizeItem("s", c[offset:offset + n], offset, is_last=offset + n == 20)])[0])
        offset += n
    torch.testing.assert_close(torch.cat([x.pcm for x in chunks]), full, rtol=0, atol=1e-5)
    assert voc.open_streams() == 0  # is_last dropped the state


def test_two_chunks_of_one_stream_in_one_call_decode_in_order():
    c = codes(8, 8)
    one_shot = make_vocalizer().vocalize([VocalizeItem("s", c, 0)])[0]
    a, b = make_vocalizer().vocalize([VocalizeItem("s", c[:5], 0), VocalizeItem("s", c[5:], 5)])
    torch.testing.assert_close(torch.cat([a.pcm, b.pcm]), one_shot.pcm, rtol=0, atol=1e-5)


def test_close_and_open_streams():
    voc = make_vocalizer()
    voc.vocalize([VocalizeItem("a", codes(2, 0), 0), VocalizeItem("b", codes(2, 1), 0)])
    assert voc.open_streams() == 2
    voc.close("a")
    voc.close("never-opened")
    assert voc.open_streams() == 1
    # A closed stream starts afresh: same output as a brand-new vocalizer.
    again = voc.vocalize([VocalizeItem("a", codes(2, 0), 0)])[0]
    fresh = make_vocalizer().vocalize([VocalizeItem("a", codes(2, 0), 0)])[0]
    torch.testing.assert_close(again.pcm, fresh.pcm, rtol=0, atol=1e-6)


def test_empty_item_gives_empty_result():
    res = make_vocalizer().vocalize([VocalizeItem("a", codes(0, 0), 0), VocalizeItem("b", codes(2, 0), 0)])
    assert res[0].codes.shape == (0, G) and res[0].pcm.numel() == 0
    assert res[1].pcm.numel() == 2 * 1920


def test_bad_items_raise_before_any_state_changes():
    voc = make_vocalizer()
    voc.vocalize([VocalizeItem("a", codes(3, 0), 0)])
    with pytest.raises(ValueError, match="frame_offset 5 but the decoder is at frame 3"):
        voc.vocalize([VocalizeItem("a", codes(2, 1), 5)])
    with pytest.raises(ValueError, match="codes must be int64"):
        voc.vocalize([VocalizeItem("b", codes(2, 1), 0), VocalizeItem("c", codes(2, 1).float(), 0)])
    assert voc.open_streams() == 1  # "b" was not started by the failed call
