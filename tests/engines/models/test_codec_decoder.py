"""Codec decoder: streaming decode with carried state == full decode; causality; sane random audio.

Tolerance: streamed and full decodes compute the same sums with different conv input
lengths and attention key sets, so fp32 results differ by rounding only (observed
~5e-6 on samples of RMS ~0.25 after ~40 layers); 1e-5 is the bar the brief sets. In
float64 the same comparison must hold to 1e-10, which shows the streaming is exact
math rather than a lucky approximation (a missing context sample gives ~1e-2).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engines.config import get_preset
from engines.models.codec_decoder import CodecDecoder, DecoderState
from engines.models.init import init_module_

CFG = get_preset("tiny").decoder
T = 2 * CFG.sliding_window + 5  # longer than the attention window, so the window must slide



@pytest.fixture(scope="module")
def decoder() -> CodecDecoder:
    return init_module_(CodecDecoder(CFG), 11).eval()


def random_codes(batch: int, frames: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.codebook_size, (batch, CFG.num_quantizers, frames), generator=g)


def stream(decoder: CodecDecoder, codes: torch.Tensor, chunk: int) -> torch.Tensor:
    state = decoder.init_state(codes.shape[0])
    out = []
    for start in range(0, codes.shape[-1], chunk):
        wav, state = decoder.decode_step(codes[..., start:start + chunk], state)
        out.append(wav)
    return torch.cat(out, dim=-1)


@pytest.mark.parametrize("chunk", [1, 3, 7, CFG.sliding_window + 3])
def test_streamed_decode_equals_full_decode(decoder, chunk):
    codes = random_codes(2, T)
    full = decoder(codes)
    assert full.shape == (2, T * decoder.samples_per_frame) == (2, T * 1920)
    torch.testing.assert_close(stream(decoder, codes, chunk), full, rtol=0, atol=1e-5)


def test_streaming_is_exact_in_float64(decoder):
    dec64 = init_module_(CodecDecoder(CFG), 11).double().eval()
    codes = random_codes(1, T, seed=1)
    torch.testing.assert_close(stream(dec64, codes, 4), dec64(codes), rtol=0, atol=1e-10)


def test_streams_at_different_positions_batch_together(decoder):
    """Two streams at different frame positions decoded as one batch == each alone."""
    a, b = random_codes(1, 12, seed=2), random_codes(1, 12, seed=3)
    sa = decoder.decode_step(a[..., :9], decoder.init_state(1))[1]  # stream a is at frame 9
    sb = decoder.decode_step(b[..., :2], decoder.init_state(1))[1]  # stream b is at frame 2
    batch_state = type(sa).cat([sa, sb])
    wav, new_state = decoder.decode_step(torch.cat([a[..., 9:12], b[..., 2:5]]), batch_state)
    wa, _ = decoder.decode_step(a[..., 9:12], sa)
    wb, _ = decoder.decode_step(b[..., 2:5], sb)
    torch.testing.assert_close(wav[0], wa[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(wav[1], wb[0], rtol=0, atol=1e-5)
    assert new_state.position.tolist() == [12, 5]


def test_decode_step_leaves_the_input_state_untouched(decoder):
    codes = random_codes(1, 6, seed=4)
    state = decoder.decode_step(codes[..., :3], decoder.init_state(1))[1]
    first, _ = decoder.decode_step(codes[..., 3:], state)
    again, _ = decoder.decode_step(codes[..., 3:], state)  # a retry sees the same state
    assert torch.equal(first, again)


def test_decoder_is_causal_and_depends_on_codes(decoder):
    codes = random_codes(1, 10, seed=5)
    changed = codes.clone()
    changed[0, :, 6] = (changed[0, :, 6] + 1) % CFG.codebook_size
    a, b = decoder(codes), decoder(changed)
    cut = 6 * decoder.samples_per_frame
    assert torch.equal(a[:, :cut], b[:, :cut])  # nothing before frame 6 may change
    assert (a[:, cut:] - b[:, cut:]).abs().max() > 1e-3  # and frame 6 onwards must


def test_random_init_gives_audible_unclipped_audio(decoder):
    wav = decoder(random_codes(2, 25, seed=6))
    assert torch.isfinite(wav).all()
    rms = wav.pow(2).mean().sqrt()
    assert 0.02 < rms < 0.6, rms
    assert (wav.abs() >= 1).float().mean() < 0.01


def test_state_dict_keys_follow_official_names(decoder):
    keys = set(decoder.state_dict())
    expected = {
        "quantizer.rvq_first.vq.layers.0._codebook.embedding_sum",
        "quantizer.rvq_first.vq.layers.0._codebook.cluster_usage",
        "quantizer.rvq_first.output_proj.weight", "quantizer.rvq_first.input_proj.weight",
        f"quantizer.rvq_rest.vq.layers.{CFG.num_quantizers - 2}._codebook.embedding_sum",
        "pre_conv.conv.weight", "pre_conv.conv.bias",
        "pre_transformer.input_proj.weight", "pre_transformer.output_proj.bias", "pre_transformer.norm.weight",
        "pre_transformer.layers.0.self_attn.q_proj.weight", "pre_transformer.layers.0.self_attn.o_proj.weight",
        "pre_transformer.layers.0.mlp.gate_proj.weight", "pre_transformer.layers.0.input_layernorm.weight",
        "pre_transformer.layers.0.self_attn_layer_scale.scale", "pre_transformer.layers.0.mlp_layer_scale.scale",
        "upsample.0.0.conv.weight", "upsample.1.1.dwconv.conv.weight", "upsample.1.1.norm.weight",
        "upsample.1.1.pwconv1.weight", "upsample.1.1.pwconv2.bias", "upsample.1.1.gamma",
        "decoder.0.conv.weight", "decoder.1.block.0.alpha", "decoder.1.block.0.beta", "decoder.1.block.1.conv.weight",
        "decoder.1.block.2.act1.alpha", "decoder.1.block.2.conv1.conv.weight", "decoder.4.block.4.conv2.conv.bias",
        "decoder.5.alpha", "decoder.6.conv.weight",
    }
    assert expected <= keys, expected - keys
    assert not any("q_norm" in k or "inv_freq" in k for k in keys)
    assert decoder.state_dict()["decoder.1.block.1.conv.weight"].shape == (CFG.decoder_dim, CFG.decoder_dim // 2, 16)


def test_bad_inputs_raise_clear_errors(decoder):
    with pytest.raises(ValueError, match=r"expected codes \[B, 4, T\]"):
        decoder(torch.zeros(1, 3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        decoder(torch.zeros(1, 4, 5))
    with pytest.raises(ValueError, match="state batch"):
        decoder.decode_step(random_codes(2, 3), decoder.init_state(1))
    with pytest.raises(ValueError, match="num_semantic_quantizers"):
        CodecDecoder(dataclasses.replace(CFG, num_semantic_quantizers=4))


# --------------------------------------------------------------------------- CPU fast paths
# A conv over many channels and few samples runs as one GEMM (codec_decoder._few_samples); it must
# compute what torch's convolution computes: the same sums in another order, so fp32 rounding only
# (~1e-6 of the output's scale measured at these sizes; a wrong tap, dilation or overlap is O(1)).


@pytest.mark.parametrize("kernel, dilation", [(7, 1), (7, 9), (3, 1), (1, 1)])
@pytest.mark.parametrize("frames", [1, 3])
def test_wide_causal_conv_gemm_path_equals_torch_conv(kernel, dilation, frames):
    from engines.models.codec_decoder import CausalConv

    conv = init_module_(CausalConv(256, 96, kernel, dilation=dilation), 3).eval()
    conv.slot = 0
    state = DecoderState([torch.randn(2, 256, conv.context)], [], [], torch.zeros(2, dtype=torch.int64))
    x = torch.randn(2, 256, frames)
    padded = torch.cat([state.conv[0], x], dim=-1)
    with torch.no_grad():
        expected = conv.conv(padded)
        got_step, got_full = conv.step(x, state), conv(x)
        expected_full = conv.conv(torch.nn.functional.pad(x, (conv.context, 0)))
    assert got_step.shape == expected.shape
    torch.testing.assert_close(got_step, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_full, expected_full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel, stride", [(16, 8), (2, 2), (10, 5)])
def test_wide_transposed_conv_gemm_path_equals_torch_conv(kernel, stride):
    from engines.models.codec_decoder import CausalTransConv

    conv = init_module_(CausalTransConv(512, 48, kernel, stride), 4).eval()
    x = torch.randn(2, 512, 5)
    with torch.no_grad():
        full = conv.conv(x)
        expected = full[..., : full.shape[-1] - conv.trim]
        got = conv(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_snakebeta_matches_its_formula_and_follows_loaded_parameters():
    from engines.models.codec_decoder import SnakeBeta

    act = init_module_(SnakeBeta(8), 5)
    x = torch.randn(2, 8, 50) * 3

    def formula(m):
        a, b = m.alpha.detach().exp()[:, None], m.beta.detach().exp()[:, None]
        return x + 1.0 / (b + 1e-9) * torch.sin(x * a).pow(2)

    with torch.no_grad():
        torch.testing.assert_close(act(x), formula(act), rtol=1e-6, atol=1e-6)
        act.load_state_dict({"alpha": torch.randn(8), "beta": torch.randn(8)})  # cached coefficients go stale
        torch.testing.assert_close(act(x), formula(act), rtol=1e-6, atol=1e-6)
    # With autograd on, the same values and a gradient for the parameters.
    y = act(x)
    torch.testing.assert_close(y.detach(), formula(act), rtol=1e-6, atol=1e-6)
    y.sum().backward()
    assert act.alpha.grad is not None and act.alpha.grad.abs().sum() > 0


def test_codebook_table_follows_loaded_parameters():
    from engines.models.codec_decoder import EuclideanCodebook

    book = init_module_(EuclideanCodebook(4, 16), 6)
    codes = torch.arange(16)[None]
    with torch.no_grad():
        first = book.decode(codes)
        torch.testing.assert_close(first[0], book.embedding_sum / book.cluster_usage[:, None])
        book.load_state_dict({"embedding_sum": torch.randn(16, 4), "cluster_usage": torch.rand(16) + 0.5})
        torch.testing.assert_close(book.decode(codes)[0], book.embedding_sum / book.cluster_usage[:, None])
