"""End-to-end equivalence: the full engine vs an independent naive pipeline.

The engine runs the request through the worker thread beside 7 other requests:
slots at staggered steps, fused CFG (one forward with 2n rows), padded-encoder memo,
foreach Euler, batched code 0 + KV-cached code predictor, streamed decode with
carried state. The naive pipeline below is written plainly: one request, one chunk
at a time, plain Euler with two separate CFG forwards, a no-cache code predictor
(recomputes the whole sequence every step) and a one-shot decode of all codes.

Tolerance 1e-4 on the waveform: both paths are fp32 but sum in different orders
(batched vs single-row matmuls, chunked vs one-shot convolutions); the codes,
which are discrete, must be identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import Collected, tiny_engine

from engines.contract import SynthesisRequest
from engines.models.sampling import DOMAIN_NOISE, FrameSampling, keyed_normal

TARGET = SynthesisRequest(id="target", text="Hello there, streaming world. This is the naive check!", seed=1234,
                          steps=8, guidance_scale=2.5)
OTHERS = [
    "Seven other requests share the ticks.",
    "Short.",
    "Another one, with a comma; and a semicolon.",
    "Numbers: 3.5 and 42.",
    "The quick brown fox.",
    "Jumps over the lazy dog, again and again.",
    "Last one in the crowd.",
]


def naive_latents(engine, req: SynthesisRequest) -> torch.Tensor:
    """Plain flow-matching sampling, chunk after chunk, CFG as two forwards."""
    m, cfg = engine.models, engine.models.config
    D, Tc, shift = cfg.dit.latent_dim, cfg.dit.context_frames, cfg.stream.schedule_shift
    plans = engine.pipeline.planner.plan(req.text, engine.pipeline.voices.index(engine.resolve_voice(req.voice)), req.speed)
    ts = [shift * t / (1 + (shift - 1) * t) for t in np.linspace(1.0, 0.0, req.steps + 1).tolist()]
    context = torch.zeros(0, D)
    out = []
    for clause in plans:
        for start, n in clause.chunks:
            x = keyed_normal(req.seed, DOMAIN_NOISE, torch.arange(start, start + n), D)
            c = context.shape[0]
            positions = torch.arange(start - c, start + n)[None]
            ctx_mask = (torch.arange(c + n) < c)[None]
            frame_mask = torch.ones(1, c + n, dtype=torch.bool)
            enc_mask = torch.ones(1, clause.enc.shape[0], dtype=torch.bool)
            for k in range(req.steps):
                inp = torch.cat([context, x])[None]
                t = torch.tensor([ts[k]])
                v_pos = m.dit(inp, positions, ctx_mask, frame_mask, t, clause.enc[None], enc_mask)[0, c:]
                v_neg = m.dit(inp, positions, ctx_mask, frame_mask, t, clause.enc_null[None], enc_mask)[0, c:]
                v = v_neg + req.guidance_scale * (v_pos - v_neg)
                x = x + (ts[k + 1] - ts[k]) * v
            x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
            out.append(x)
            context = x[-Tc:]
    return torch.cat(out)


def naive_codes_and_audio(engine, latents: torch.Tensor, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    m = engine.models
    head, predictor, decoder = m.codec_head, m.code_predictor, m.decoder
    T = latents.shape[0]
    logits = head.logits(latents)
    logits[:, head.cfg.codebook_size:] = float("-inf")  # code 0 comes from the codebook only
    code0 = logits.argmax(-1)
    sampling = FrameSampling.for_stream(T, seed, 0, "cpu", greedy=True)
    rest = predictor.naive_predict(head.hidden(latents), head.embed(code0), sampling)
    codes = torch.cat([code0[:, None], rest], dim=1)  # [T, G]
    wav = decoder(codes.T[None])[0]  # one-shot decode of the whole utterance
    return codes, wav.numpy()


@pytest.fixture(scope="module")
def engine():
    eng = tiny_engine()
    yield eng
    eng.stop()


def test_engine_in_a_crowd_equals_naive_pipeline(engine):
    recorded: dict[str, list[torch.Tensor]] = {}
    vocalize = engine.vocalizer.vocalize

    def recording_vocalize(items):  # observe the codes the engine produced; behaviour unchanged
        results = vocalize(items)
        for r in results:
            recorded.setdefault(r.stream_id, []).append(r.codes.clone())
        return results

    engine.vocalizer.vocalize = recording_vocalize
    forwards_before = engine.pipeline.denoiser.forward_count
    ticks_before = engine.worker.ticks
    max_rows = []
    engine.add_tick_listener(lambda rep: max_rows.append(rep.batch_rows))
    try:
        cols = [Collected() for _ in range(8)]
        reqs = [TARGET] + [SynthesisRequest(id=f"other{i}", text=t, seed=i) for i, t in enumerate(OTHERS)]
        for r, c in zip(reqs, cols):
            engine.submit(r, c.deliver)
        for c in cols:
            assert c.done.wait(120)
    finally:
        engine.vocalizer.vocalize = vocalize
    assert all(c.error is None for c in cols)
    # One DiT forward per tick, and the crowd really shared ticks under fused CFG.
    assert engine.pipeline.denoiser.forward_count - forwards_before == engine.worker.ticks - ticks_before
    assert max(max_rows) >= 16, "8 guided requests should put 2n = 16 rows in one forward"

    with torch.no_grad():
        latents = naive_latents(engine, TARGET)
        codes, wav = naive_codes_and_audio(engine, latents, TARGET.seed)
    engine_codes = torch.cat(recorded["target"])
    assert engine_codes.shape == codes.shape
    assert torch.equal(engine_codes, codes)
    pcm = cols[0].pcm
    assert pcm.shape == wav.shape
    np.testing.assert_allclose(pcm, wav, atol=1e-4, rtol=0)
    assert np.abs(wav).max() > 1e-3  # the comparison is not between two silences
