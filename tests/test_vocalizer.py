"""Vocalizer: batched codes + per-stream streaming decode.

Codes must be identical whatever the batch (sampling is keyed by seed/frame/group and
greedy argmax does not depend on batch neighbours); PCM within 1e-5 (fp32 rounding of
batched vs single convs, see test_codec_decoder.py for the tolerance's rationale).
"""

from __future__ import annotations

import pytest
import torch

from engines.config import get_preset
from engines.models.code_predictor import CodePredictor
from engines.models.codec_decoder import CodecDecoder
from engines.models.codec_head import CodecHead
from engines.models.init import init_module_
from engines.pipelines.vocoder import VocalizeItem, Vocalizer, reference_codes

TINY = get_preset("tiny")
G = TINY.num_code_groups



def unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def latents(frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return unit_rms(torch.randn(frames, TINY.latent_dim, generator=g))


def parts(seed: int = 0):
    return (init_module_(CodecHead(TINY.codec_head), seed).eval(),
            init_module_(CodePredictor(TINY.code_predictor), seed + 1).eval(),
            init_module_(CodecDecoder(TINY.decoder), seed + 2).eval())


def make_vocalizer(**kw) -> Vocalizer:
    return Vocalizer(*parts(), device="cpu", **kw)


def test_result_shapes_and_audio():
    voc = make_vocalizer()
    (res,) = voc.vocalize([VocalizeItem("a", latents(6, 0), 0, seed=1)])
    assert res.stream_id == "a"
    assert res.codes.shape == (6, G) and res.codes.dtype == torch.int64
    assert (res.codes >= 0).all() and (res.codes < TINY.codec_head.codebook_size).all()
    assert res.pcm.shape == (6 * 1920,) and res.pcm.dtype == torch.float32
    assert torch.isfinite(res.pcm).all() and res.pcm.pow(2).mean().sqrt() > 0.01


@pytest.mark.parametrize("greedy", [True, False])
def test_codes_match_the_naive_reference(greedy):
    head, predictor, decoder = parts()
    voc = Vocalizer(head, predictor, decoder, device="cpu")
    lat = latents(9, 3)
    (res,) = voc.vocalize([VocalizeItem("a", lat, 40, seed=5, greedy=greedy, temperature=1.2, top_k=20)])
    ref = reference_codes(head, predictor, lat, seed=5, frame_offset=40, greedy=greedy, temperature=1.2, top_k=20)
    assert torch.equal(res.codes, ref)


def test_a_stream_does_not_depend_on_its_batch_neighbours():
    target = VocalizeItem("target", latents(5, 0), 0, seed=42, greedy=False)
    alone = make_vocalizer().vocalize([target])[0]
    others = [VocalizeItem(f"o{i}", latents(5 if i % 2 else 3 + i, 100 + i), 0, seed=i, greedy=bool(i % 3))
              for i in range(7)]
    crowd = make_vocalizer(max_batch_rows=7).vocalize(others[:3] + [target] + others[3:])  # rows split in pieces
    beside = crowd[3]
    assert beside.stream_id == "target"
    assert torch.equal(beside.codes, alone.codes)
    torch.testing.assert_close(beside.pcm, alone.pcm, rtol=0, atol=1e-5)


def test_chunked_stream_equals_one_shot():
    lat = latents(20, 7)
    one_shot = make_vocalizer().vocalize([VocalizeItem("s", lat, 0, seed=9, greedy=False)])[0]
    voc = make_vocalizer()
    chunks, offset = [], 0
    for n in (4, 9, 7):  # the middle chunk crosses the decoder's 8-frame attention window
        chunks.append(voc.vocalize([VocalizeItem("s", lat[offset:offset + n], offset, seed=9, greedy=False,
                                                 is_last=offset + n == 20)])[0])
        offset += n
    assert torch.equal(torch.cat([c.codes for c in chunks]), one_shot.codes)
    torch.testing.assert_close(torch.cat([c.pcm for c in chunks]), one_shot.pcm, rtol=0, atol=1e-5)
    assert voc.open_streams() == 0  # is_last dropped the state


def test_two_chunks_of_one_stream_in_one_call_decode_in_order():
    lat = latents(8, 8)
    one_shot = make_vocalizer().vocalize([VocalizeItem("s", lat, 0, seed=1)])[0]
    a, b = make_vocalizer().vocalize([VocalizeItem("s", lat[:5], 0, seed=1), VocalizeItem("s", lat[5:], 5, seed=1)])
    torch.testing.assert_close(torch.cat([a.pcm, b.pcm]), one_shot.pcm, rtol=0, atol=1e-5)


def test_close_and_open_streams():
    voc = make_vocalizer()
    voc.vocalize([VocalizeItem("a", latents(2, 0), 0, seed=1), VocalizeItem("b", latents(2, 1), 0, seed=1)])
    assert voc.open_streams() == 2
    voc.close("a")
    voc.close("never-opened")
    assert voc.open_streams() == 1
    # A closed stream starts afresh: same output as a brand-new vocalizer.
    again = voc.vocalize([VocalizeItem("a", latents(2, 0), 0, seed=1)])[0]
    fresh = make_vocalizer().vocalize([VocalizeItem("a", latents(2, 0), 0, seed=1)])[0]
    torch.testing.assert_close(again.pcm, fresh.pcm, rtol=0, atol=1e-6)


def test_empty_item_gives_empty_result():
    voc = make_vocalizer()
    res = voc.vocalize([VocalizeItem("a", torch.zeros(0, TINY.latent_dim), 0, seed=1),
                        VocalizeItem("b", latents(2, 0), 0, seed=1)])
    assert res[0].codes.shape == (0, G) and res[0].pcm.numel() == 0
    assert res[1].pcm.numel() == 2 * 1920


def test_bad_items_raise_before_any_state_changes():
    voc = make_vocalizer()
    voc.vocalize([VocalizeItem("a", latents(3, 0), 0, seed=1)])
    with pytest.raises(ValueError, match="frame_offset 5 but the decoder is at frame 3"):
        voc.vocalize([VocalizeItem("a", latents(2, 1), 5, seed=1)])
    with pytest.raises(ValueError, match=r"latents must be \[T, 64\]"):
        voc.vocalize([VocalizeItem("b", latents(2, 1), 0, seed=1), VocalizeItem("c", torch.zeros(2, 3), 0, seed=1)])
    assert voc.open_streams() == 1  # "b" was not started by the failed call
    with pytest.raises(ValueError, match="top_p"):
        voc.vocalize([VocalizeItem("d", latents(1, 1), 0, seed=1, top_p=0.0)])
    with pytest.raises(ValueError, match="codebook sizes differ"):
        bad = CodePredictor(TINY.code_predictor.__class__(**{**TINY.code_predictor.to_dict(), "vocab_size": 32}))
        Vocalizer(parts()[0], bad, parts()[2], device="cpu")


def test_items_with_known_codes_are_decoded_only():
    """The talker source hands over finished codes: the vocalizer must decode exactly them."""
    from engines.config import get_preset
    from engines.pipelines.dit.weights import build_models
    from engines.pipelines.vocoder import VocalizeItem, Vocalizer

    m = build_models(get_preset("tiny"), seed=3)
    voc = Vocalizer(m.codec_head, m.code_predictor, m.decoder, "cpu")
    G, V = m.config.num_code_groups, m.config.decoder.codebook_size
    codes = torch.randint(0, V, (7, G), generator=torch.Generator().manual_seed(0))
    first, second = voc.vocalize([VocalizeItem("s", None, 0, seed=0, codes=codes[:3])])[0], \
        voc.vocalize([VocalizeItem("s", None, 3, seed=0, codes=codes[3:], is_last=True)])[0]
    assert torch.equal(torch.cat([first.codes, second.codes]), codes)
    full = m.decoder(codes.T[None])[0]
    torch.testing.assert_close(torch.cat([first.pcm, second.pcm]), full, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="codes must be int64"):
        voc.vocalize([VocalizeItem("t", None, 0, seed=0, codes=codes.float())])
