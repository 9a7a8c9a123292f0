"""The DiT pipeline's codec side: finished latents -> code frames (codec head + code predictor).

Codes must be identical whatever the batch: sampling is keyed by seed/frame/group and
greedy argmax does not depend on batch neighbours.
"""

from __future__ import annotations

import pytest
import torch

from engines.config import get_preset
from engines.models.code_predictor import CodePredictor
from engines.models.codec_head import CodecHead
from engines.models.init import init_module_
from engines.pipelines.dit.codes import FrameCoder, LatentChunk, reference_codes

TINY = get_preset("tiny")
G = TINY.num_code_groups


def latents(frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(frames, TINY.latent_dim, generator=g)
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def parts(seed: int = 0):
    return (init_module_(CodecHead(TINY.codec_head), seed).eval(),
            init_module_(CodePredictor(TINY.code_predictor), seed + 1).eval())


def make_coder(**kw) -> FrameCoder:
    return FrameCoder(*parts(), device="cpu", **kw)


def test_codes_shape_and_range():
    (codes,) = make_coder().codes([LatentChunk(latents(6, 0), 0, seed=1)])
    assert codes.shape == (6, G) and codes.dtype == torch.int64
    assert (codes >= 0).all() and (codes < TINY.codec_head.codebook_size).all()


@pytest.mark.parametrize("greedy", [True, False])
def test_codes_match_the_naive_reference(greedy):
    head, predictor = parts()
    lat = latents(9, 3)
    (codes,) = FrameCoder(head, predictor, "cpu").codes([LatentChunk(lat, 40, seed=5, greedy=greedy,
                                                                     temperature=1.2, top_k=20)])
    ref = reference_codes(head, predictor, lat, seed=5, frame_offset=40, greedy=greedy, temperature=1.2, top_k=20)
    assert torch.equal(codes, ref)


def test_a_stream_does_not_depend_on_its_batch_neighbours():
    target = LatentChunk(latents(5, 0), 0, seed=42, greedy=False)
    (alone,) = make_coder().codes([target])
    others = [LatentChunk(latents(5 if i % 2 else 3 + i, 100 + i), 0, seed=i, greedy=bool(i % 3)) for i in range(7)]
    crowd = make_coder(max_batch_rows=7).codes(others[:3] + [target] + others[3:])  # rows split in pieces
    assert torch.equal(crowd[3], alone)


def test_chunked_stream_equals_one_shot():
    lat = latents(20, 7)
    (one_shot,) = make_coder().codes([LatentChunk(lat, 0, seed=9, greedy=False)])
    coder, parts_, offset = make_coder(), [], 0
    for n in (4, 9, 7):
        parts_ += coder.codes([LatentChunk(lat[offset:offset + n], offset, seed=9, greedy=False)])
        offset += n
    assert torch.equal(torch.cat(parts_), one_shot)


def test_empty_chunk_and_bad_latents():
    res = make_coder().codes([LatentChunk(torch.zeros(0, TINY.latent_dim), 0, seed=1),
                              LatentChunk(latents(2, 0), 0, seed=1)])
    assert res[0].shape == (0, G) and res[1].shape == (2, G)
    with pytest.raises(ValueError, match=r"latents must be floating point \[T, 64\]"):
        make_coder().codes([LatentChunk(torch.zeros(2, 3), 0, seed=1)])
    with pytest.raises(ValueError, match="top_p"):
        make_coder().codes([LatentChunk(latents(1, 1), 0, seed=1, top_p=0.0)])
    with pytest.raises(ValueError, match="codebook sizes differ"):
        bad = CodePredictor(TINY.code_predictor.__class__(**{**TINY.code_predictor.to_dict(), "vocab_size": 32}))
        FrameCoder(parts()[0], bad, device="cpu")
