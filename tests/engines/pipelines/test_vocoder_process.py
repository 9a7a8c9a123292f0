"""The codec decoder in a process of its own: the vocalizer's PCM to the bit, streams kept in
order and apart (prime, close, the last chunk), the weights shared rather than copied, a bad item
failing alone and a dead process failing only the streams it held."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from engines.config import get_preset
from engines.models.codec_decoder import CodecDecoder
from engines.models.init import init_module_
from engines.pipelines.vocoder import VocalizeItem, Vocalizer
from engines.pipelines.vocoder_process import CodecProcessError, VocoderProcess

TINY = get_preset("tiny")
G, V = TINY.num_code_groups, TINY.decoder.codebook_size


def codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (frames, G), generator=torch.Generator().manual_seed(seed))


def local(dtype: torch.dtype) -> Vocalizer:
    return Vocalizer(init_module_(CodecDecoder(TINY.decoder), 2).eval(), "cpu", dtype)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def pair(request):
    """(an in-process vocalizer, the same decoder's in a process)."""
    remote = VocoderProcess(local(request.param))
    remote.start()
    yield local(request.param), remote
    remote.shutdown()


def script() -> list[list[VocalizeItem]]:
    """Three streams' chunks over four calls: one primed (in-context cloning), one ending early."""
    a, b, c = codes(12, 1), codes(9, 2), codes(5, 3)
    return [[VocalizeItem("a", a[:1], 0), VocalizeItem("b", b[:4], 0)],
            [VocalizeItem("a", a[1:3], 1), VocalizeItem("c", c, 0, is_last=True), VocalizeItem("a", a[3:8], 3)],
            [VocalizeItem("b", b[4:9], 4, is_last=True)],
            [VocalizeItem("a", a[8:], 8, is_last=True)]]


def test_the_same_pcm_bytes_as_in_process(pair):
    near, far = pair
    for voc in (near, far):
        voc.prime("a", codes(3, 9))
    for call in script():
        got, want = far.vocalize(call), near.vocalize(call)
        assert [r.stream_id for r in got] == [it.stream_id for it in call]
        for g, w, it in zip(got, want, call):
            assert g.pcm.dtype == torch.float32 and g.pcm.numel() == it.num_frames * 1920
            assert torch.equal(g.pcm, w.pcm), it.stream_id
            assert torch.equal(g.codes, it.codes)
    assert far.open_streams() == near.open_streams() == 0


def test_close_forgets_a_stream_and_a_bad_item_changes_none(pair):
    near, far = pair
    c = codes(6, 4)
    far.vocalize([VocalizeItem("s", c[:2], 0)])
    assert far.open_streams() == 1
    with pytest.raises(ValueError, match="frame_offset 5 but the decoder is at frame 2"):
        far.vocalize([VocalizeItem("s", c[2:4], 5)])
    with pytest.raises(ValueError, match="codes must be int64"):
        far.vocalize([VocalizeItem("s", c[2:4], 2), VocalizeItem("t", c[:1].float(), 0)])
    rest = far.vocalize([VocalizeItem("s", c[2:], 2)])[0].pcm  # "s" is where it was
    near.vocalize([VocalizeItem("s", c[:2], 0)])
    assert torch.equal(rest, near.vocalize([VocalizeItem("s", c[2:], 2)])[0].pcm)
    far.close("s")
    far.close("never-opened")
    near.close("s")
    assert far.open_streams() == 0
    assert torch.equal(far.vocalize([VocalizeItem("s", c[:3], 0, is_last=True)])[0].pcm,
                       near.vocalize([VocalizeItem("s", c[:3], 0, is_last=True)])[0].pcm)


def test_the_weights_are_shared_not_copied(pair):
    _, far = pair
    assert all(p.is_shared() for p in far.decoder.parameters())


def test_a_dead_process_fails_its_streams_and_a_new_one_serves_the_rest():
    far = VocoderProcess(local(torch.bfloat16))
    try:
        far.start()
        c = codes(8, 5)
        far.vocalize([VocalizeItem("held", c[:3], 0)])
        os.kill(far.pid, signal.SIGKILL)
        with pytest.raises(CodecProcessError, match="died"):
            far.vocalize([VocalizeItem("held", c[3:5], 3)])
        with pytest.raises(CodecProcessError, match="decoder state died"):
            far.vocalize([VocalizeItem("held", c[5:], 5)])
        fresh = far.vocalize([VocalizeItem("new", c, 0, is_last=True)])[0].pcm  # a new child
        assert far.starts == 2 and far.pid is not None
        assert torch.equal(fresh, local(torch.bfloat16).vocalize([VocalizeItem("new", c, 0)])[0].pcm)
        far.close("held")  # the engine releases the failed request: the name is free again
        assert far.vocalize([VocalizeItem("held", c[:2], 0)])[0].pcm.numel() == 2 * 1920
    finally:
        far.shutdown()
    assert far.pid is None


def test_a_process_that_cannot_start_leaves_the_decoding_in_this_process(monkeypatch, caplog):
    """E.g. a /dev/shm smaller than the weights (Docker's default 64 MB): said once, served as before."""
    near = local(torch.bfloat16)
    far = VocoderProcess(local(torch.bfloat16))

    def full(*_):
        raise RuntimeError("unable to write to file </torch_1_2>: No space left on device (28)")

    monkeypatch.setattr(far.decoder, "share_memory", full)
    far.start()
    assert far.in_process and far.pid is None
    assert "No space left on device" in caplog.text and "STREAMVOX_CODEC_PROCESS=0" in caplog.text
    for call in script():
        for g, w in zip(far.vocalize(call), near.vocalize(call)):
            assert torch.equal(g.pcm, w.pcm)
    assert far.open_streams() == 0
