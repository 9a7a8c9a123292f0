"""A tiny DiT and stream jobs for the tick-loop tests (tiny preset, CPU or CUDA)."""

from __future__ import annotations

import dataclasses

import torch

from engines.config import get_preset
from engines.models.dit import FlowDiT
from engines.models.init import init_module_
from engines.models.sampling import keyed_normal
from engines.pipelines.dit.denoiser import ChunkJob, Denoiser

CFG = get_preset("tiny")
D, C = CFG.dit.latent_dim, CFG.dit.cond_dim
TOL = 1e-5
_TEST_DOMAIN = 1000  # test data draws, apart from the engine's domains


def make_dit(device="cpu") -> FlowDiT:
    return init_module_(FlowDiT(CFG.dit), 3).to(device).eval()


def stream_cfg(**overrides):
    return dataclasses.replace(CFG.stream, **overrides)


def _null(device) -> torch.Tensor:
    return keyed_normal(7, _TEST_DOMAIN, torch.arange(1, device=device), C)[0]  # [C]


def make_job(i: int, *, frames=12, context=4, steps=4, scale=2.0, guided=True, frame_start=None,
             length=None, seed=None, device="cpu") -> ChunkJob:
    """A chunk job with deterministic test tensors; ragged sizes depend on ``i``."""
    L = length or 5 + 3 * i
    enc = keyed_normal(100 + i, _TEST_DOMAIN, torch.arange(L, device=device), C)
    ctx = keyed_normal(200 + i, _TEST_DOMAIN, torch.arange(context, device=device), D)
    return ChunkJob(key=(f"r{i}", 0), enc=enc, enc_null=_null(device).expand(L, C) if guided else None,
                    context=ctx, frame_start=frame_start if frame_start is not None else 16 + 7 * i,
                    num_frames=frames, seed=seed if seed is not None else 1234 + i, steps=steps,
                    guidance_scale=scale)


def run(sched: Denoiser, admissions: list[tuple[int, ChunkJob]]) -> dict:
    """Admit each job at its tick, tick until all finished; {key: latents}."""
    out, tick, pending = {}, 0, list(admissions)
    while pending or sched.active_slots:
        for entry in [e for e in pending if e[0] == tick]:
            sched.admit(entry[1])
            pending.remove(entry)
        for f in sched.tick():
            out[f.key] = f.latents
        tick += 1
        assert tick < 1000
    return out
