"""The engine's codec side end to end vs the official modules: frame latents -> codes
(engines.pipelines.dit.codes.FrameCoder) -> audio, greedy, streamed in uneven chunks through
engines.pipelines.vocoder.Vocalizer with
the parts a real checkpoint directory gives (load_checkpoint)."""

from __future__ import annotations

import pytest
import torch

from engines.checkpoints.qwen3_tts import load_checkpoint
from engines.pipelines.dit.codes import FrameCoder, LatentChunk
from engines.pipelines.vocoder import VocalizeItem, Vocalizer
from tests.oracle.fixtures import (
    ALL_CHECKPOINTS,
    REL_TOL,
    checkpoint_dir,
    references,
    rel_err,
)

pytestmark = pytest.mark.parity

CHUNKS = (4, 3)  # then the rest: uneven chunks, not aligned with the decoder window


@pytest.mark.parametrize("name", ALL_CHECKPOINTS)
def test_vocalizer_matches_the_official_head_generate_and_decoder(name):
    refs = references(name)
    parts = load_checkpoint(checkpoint_dir(name))
    coder = FrameCoder(parts.head, parts.predictor, "cpu")
    vocalizer = Vocalizer(parts.decoder, "cpu")
    latents = refs["pipe/latents"]
    bounds = [0, CHUNKS[0], CHUNKS[0] + CHUNKS[1], latents.shape[0]]
    codes, pcm = [], []
    for start, end in zip(bounds, bounds[1:]):
        (chunk_codes,) = coder.codes([LatentChunk(latents[start:end], frame_offset=start, seed=0, greedy=True)])
        item = VocalizeItem("s", chunk_codes, frame_offset=start, is_last=end == latents.shape[0])
        (result,) = vocalizer.vocalize([item])
        codes.append(result.codes)
        pcm.append(result.pcm)
    assert torch.equal(torch.cat(codes), refs["pipe/codes"]), f"{name}: codes differ from the official modules"
    err = rel_err(torch.cat(pcm), refs["pipe/wav"])
    assert err <= REL_TOL, f"{name}: streamed vocalizer audio rel err {err:.2e}"
    assert vocalizer.open_streams() == 0
