"""Stream tick loop: fused CFG, two-pass fallback, memo, no host reads, batch
independence, and equality with a naive one-job-at-a-time reference.

Tolerance 1e-5 (fp32): batched and single-row forwards run the same math on
differently shaped matmuls, so results differ only by summation order (~1e-6).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dit_helpers import CFG, TOL, C, D, _null, make_dit, make_job, run, stream_cfg  # noqa: F401
from host_read_helpers import NoHostReads

from engines.models.dit import FlowDiT
from engines.models.sampling import DOMAIN_NOISE, keyed_normal
from engines.pipelines.dit.denoiser import (
    APG_MOMENTUM,
    APG_NORM_THRESHOLD,
    ChunkJob,
    Denoiser,
)


def naive_schedule(steps: int, shift: float) -> list[float]:
    out = []
    for i in range(steps + 1):
        t = 1.0 - i / steps
        out.append(shift * t / (1 + (shift - 1) * t))
    return out


def naive_apg(pos, neg, scale, running):
    """APG written frame by frame with plain tensor math (reference for the denoiser)."""
    running = (pos - neg) + APG_MOMENTUM * running
    out = pos.clone()
    for f in range(pos.shape[0]):
        d = running[f]
        d = d * min(1.0, APG_NORM_THRESHOLD / float(d.norm()))
        unit = pos[f] / pos[f].norm()
        orth = d - torch.dot(d, unit) * unit
        out[f] = pos[f] + (scale - 1) * orth
    return out, running


@torch.no_grad()
def naive_reference(dit: FlowDiT, job: ChunkJob, guidance="cfg", timing="full", shift=3.0) -> torch.Tensor:
    """One job alone: plain loop, separate positive/negative forwards, no memo."""
    Tc, Tn = job.context.shape[0], job.num_frames
    x = keyed_normal(job.seed, DOMAIN_NOISE, torch.arange(job.frame_start, job.frame_start + Tn), D)
    ts = naive_schedule(job.steps, shift)
    positions = torch.arange(job.frame_start - Tc, job.frame_start + Tn)[None]
    context_mask = (torch.arange(Tc + Tn) < Tc)[None]
    frame_mask = torch.ones(1, Tc + Tn, dtype=torch.bool)
    enc_mask = torch.ones(1, job.enc.shape[0], dtype=torch.bool)
    guided = job.enc_null is not None and guidance != "none" and job.guidance_scale > 1
    running = torch.zeros_like(x)
    v_neg = None
    for i in range(job.steps):
        inp = torch.cat([job.context, x])[None]
        t = torch.tensor([ts[i]])
        v = dit(inp, positions, context_mask, frame_mask, t, job.enc[None], enc_mask)[0, Tc:]
        if guided:
            if timing == "full" or i == 0:
                v_neg = dit(inp, positions, context_mask, frame_mask, t, job.enc_null[None], enc_mask)[0, Tc:]
            if guidance == "cfg":
                v = v_neg + job.guidance_scale * (v - v_neg)
            else:
                v, running = naive_apg(v, v_neg, job.guidance_scale, running)
        x = x + (ts[i + 1] - ts[i]) * v
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


class ForwardRecorder:
    def __init__(self, module):
        self.calls: list[tuple] = []
        self.handle = module.register_forward_pre_hook(lambda m, args: self.calls.append(args))

    def rows(self) -> list[int]:
        return [a[0].shape[0] for a in self.calls]


# --------------------------------------------------------------------------- batching


def test_one_fused_forward_per_tick_with_2n_rows():
    dit = make_dit()
    denoiser = Denoiser(dit, stream_cfg(max_slots=4, batch_ceiling=8), "cpu")
    rec = ForwardRecorder(dit)
    for i in range(4):
        denoiser.admit(make_job(i, steps=3))
    for _ in range(3):
        before = len(rec.calls)
        denoiser.tick()
        assert len(rec.calls) == before + 1  # exactly one forward
        assert rec.rows()[-1] == 8 and denoiser.last_batch_rows == 8
    assert denoiser.forward_count == 3 and denoiser.active_slots == 0


def test_two_passes_above_the_ceiling_give_the_fused_result():
    jobs = [(0, make_job(i, steps=3)) for i in range(4)]
    dit = make_dit()
    fused = run(Denoiser(dit, stream_cfg(max_slots=4, batch_ceiling=8), "cpu"), jobs)
    rec = ForwardRecorder(dit)
    split_denoiser = Denoiser(dit, stream_cfg(max_slots=4, batch_ceiling=4), "cpu")
    split = run(split_denoiser, jobs)
    assert rec.rows() == [4, 4] * 3  # positive pass, negative pass, every tick
    assert split_denoiser.forward_count == 6
    for key in fused:
        torch.testing.assert_close(split[key], fused[key], rtol=0, atol=TOL)


class BufferReusingDiT(torch.nn.Module):
    """Mimics a CUDA-graph / TensorRT backend: every call returns the same output buffer."""

    def __init__(self, dit: FlowDiT):
        super().__init__()
        self.dit, self.cfg, self.out = dit, dit.cfg, None

    def forward(self, *args):
        v = self.dit(*args)
        if self.out is None or self.out.shape != v.shape:
            self.out = torch.empty_like(v)
        return self.out.copy_(v)


def test_two_passes_survive_a_backend_that_reuses_its_output_buffer():
    jobs = [(0, make_job(i, steps=3, frames=8, context=4, length=6)) for i in range(4)]  # equal shapes
    dit = make_dit()
    fused = run(Denoiser(dit, stream_cfg(max_slots=4, batch_ceiling=8), "cpu"), jobs)
    split = run(Denoiser(BufferReusingDiT(dit), stream_cfg(max_slots=4, batch_ceiling=4), "cpu"), jobs)
    for key in fused:
        torch.testing.assert_close(split[key], fused[key], rtol=0, atol=TOL)


def test_no_negative_rows_without_guidance():
    dit = make_dit()
    denoiser = Denoiser(dit, stream_cfg(max_slots=4, batch_ceiling=8), "cpu")
    denoiser.admit(make_job(0, scale=1.0))  # scale <= 1: guidance off
    denoiser.admit(make_job(1, guided=False))  # no null states
    denoiser.admit(make_job(2, scale=3.0))
    denoiser.tick()
    assert denoiser.last_batch_rows == 4  # 3 positive + 1 negative
    off = Denoiser(dit, stream_cfg(guidance="none"), "cpu")
    off.admit(make_job(2, scale=3.0))
    off.tick()
    assert off.last_batch_rows == 1


def test_context_frames_are_never_blanked_under_cfg():
    dit = make_dit()
    rec = ForwardRecorder(dit)
    denoiser = Denoiser(dit, stream_cfg(), "cpu")
    jobs = [make_job(i, context=4 + i) for i in range(3)]
    for j in jobs:
        denoiser.admit(j)
    denoiser.tick()
    x, positions, context_mask, frame_mask, t, enc, enc_mask = rec.calls[0]
    n = len(jobs)
    assert x.shape[0] == 2 * n
    # Negative rows carry the same frames (context included) as their positive rows...
    torch.testing.assert_close(x[n:], x[:n], rtol=0, atol=0)
    torch.testing.assert_close(context_mask[n:], context_mask[:n], rtol=0, atol=0)
    for r, j in enumerate(jobs):
        Tc = j.context.shape[0]
        torch.testing.assert_close(x[n + r, :Tc], j.context, rtol=0, atol=0)
        assert bool(context_mask[n + r, :Tc].all()) and not bool(context_mask[n + r, Tc:].any())
        # ...and only the text is swapped for the null states.
        L = j.enc.shape[0]
        torch.testing.assert_close(enc[r, :L], j.enc, rtol=0, atol=0)
        torch.testing.assert_close(enc[n + r, :L], j.enc_null, rtol=0, atol=0)


# --------------------------------------------------------------------------- memo


def test_memo_hit_returns_identical_objects():
    dit = make_dit()
    denoiser = Denoiser(dit, stream_cfg(), "cpu")
    encs = [make_job(i).enc for i in range(3)]
    caller_list = list(encs)
    a = denoiser.padded_encoder_states(tuple(caller_list))
    rebuilds = denoiser.memo_rebuilds
    b = denoiser.padded_encoder_states(tuple(caller_list))
    assert a[0] is b[0] and a[1] is b[1]
    assert denoiser.memo_rebuilds == rebuilds
    assert caller_list == encs  # callers' lists are not touched
    # A rebuild gives the same values as the hit.
    fresh = Denoiser(dit, stream_cfg(), "cpu").padded_encoder_states(tuple(encs))
    torch.testing.assert_close(fresh[0], a[0], rtol=0, atol=0)
    torch.testing.assert_close(fresh[1], a[1], rtol=0, atol=0)


def test_memo_survives_ticks_and_chunk_handover():
    dit = make_dit()
    rec = ForwardRecorder(dit)
    denoiser = Denoiser(dit, stream_cfg(), "cpu")
    jobs = [make_job(i, steps=2) for i in range(3)]
    for j in jobs:
        denoiser.admit(j)
    denoiser.tick()
    rebuilds = denoiser.memo_rebuilds
    denoiser.tick()  # same slot set: no rebuild, the very same tensors go in
    assert denoiser.memo_rebuilds == rebuilds
    assert rec.calls[1][5] is rec.calls[0][5] and rec.calls[1][6] is rec.calls[0][6]
    # The next chunks of the same clauses (same enc objects) land in the same rows.
    for j in jobs:
        denoiser.admit(dataclasses.replace(j, key=(j.key[0], 1), frame_start=j.frame_start + j.num_frames))
    denoiser.tick()
    assert denoiser.memo_rebuilds == rebuilds
    assert rec.calls[2][5] is rec.calls[0][5]


# --------------------------------------------------------------------------- host reads


def _steady_state_ticks(device: str, guidance: str, timing: str = "full"):
    dit = make_dit(device)
    denoiser = Denoiser(dit, stream_cfg(guidance=guidance, guidance_timing=timing), device)
    for i in range(3):  # staggered admissions, ragged rows, mixed guidance
        denoiser.admit(make_job(i, steps=4, frames=4 + 3 * i, context=i % 3, guided=i != 2, device=device))
        denoiser.tick()
    finished = 0
    with NoHostReads():
        for _ in range(4):  # includes finishing slots and slot-set changes
            finished += len(denoiser.tick())
    assert finished == 3 and denoiser.active_slots == 0


@pytest.mark.parametrize("guidance,timing", [("cfg", "full"), ("cfg", "initialize"), ("apg", "full")])
def test_steady_state_tick_has_no_host_reads(guidance, timing):
    _steady_state_ticks("cpu", guidance, timing)


@pytest.mark.parametrize("read", [
    lambda x: x.sum().item(),
    lambda x: x[x > 0],
    lambda x: bool(x.any()),
    lambda x: torch.equal(x, x),
    lambda x: x.nonzero(),
])
def test_host_read_detector_can_fail(read):
    with torch.no_grad(), pytest.raises(AssertionError, match="host read"):
        with NoHostReads():
            read(torch.ones(3))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_steady_state_tick_never_syncs_on_cuda():
    dit = make_dit("cuda")
    denoiser = Denoiser(dit, stream_cfg(), "cuda")
    for i in range(3):
        denoiser.admit(make_job(i, steps=4, frames=4 + 3 * i, context=i % 3, device="cuda"))
        denoiser.tick()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with NoHostReads():
            finished = [f for _ in range(4) for f in denoiser.tick()]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(finished) == 3 and denoiser.active_slots == 0


# --------------------------------------------------------------------------- numerics


def test_job_alone_equals_job_in_a_crowd():
    dit = make_dit()
    target = make_job(0, frames=9, context=3)
    alone = run(Denoiser(dit, stream_cfg(), "cpu"), [(0, target)])
    crowd = [(0, target)] + [(i % 3, make_job(i, frames=4 + 2 * i, context=i % 5, guided=i % 2 == 0))
                             for i in range(1, 8)]
    together = run(Denoiser(dit, stream_cfg(), "cpu"), crowd)
    torch.testing.assert_close(together[target.key], alone[target.key], rtol=0, atol=TOL)


@pytest.mark.parametrize("guidance,timing", [("cfg", "full"), ("cfg", "initialize"), ("apg", "full"), ("none", "full")])
def test_scheduler_matches_naive_reference(guidance, timing):
    dit = make_dit()
    jobs = [make_job(i, frames=4 + 3 * i, context=i % 4, steps=3 + i % 3, scale=1.5 + i / 2, guided=i != 1)
            for i in range(6)]
    admissions = [(i // 2, j) for i, j in enumerate(jobs)]  # staggered steps
    got = run(Denoiser(dit, stream_cfg(guidance=guidance, guidance_timing=timing), "cpu"), admissions)
    for j in jobs:
        want = naive_reference(dit, j, guidance=guidance, timing=timing)
        torch.testing.assert_close(got[j.key], want, rtol=0, atol=TOL)
        assert torch.allclose(got[j.key].pow(2).mean(-1), torch.ones(j.num_frames), atol=1e-5)


def test_noise_depends_on_seed_and_global_frames_only():
    dit = make_dit()
    a = make_job(0, seed=5, frame_start=40)
    got = run(Denoiser(dit, stream_cfg(), "cpu"),
              [(0, a), (0, dataclasses.replace(a, key=("b", 0), seed=6)),
               (0, dataclasses.replace(a, key=("c", 0), frame_start=41))])
    assert (got[("b", 0)] - got[a.key]).abs().max() > 1e-2
    assert (got[("c", 0)] - got[a.key]).abs().max() > 1e-2


# --------------------------------------------------------------------------- admission / cancel


def test_cancel_frees_the_slot_immediately():
    dit = make_dit()
    denoiser = Denoiser(dit, stream_cfg(max_slots=2, batch_ceiling=4), "cpu")
    a, b = make_job(0, steps=3), make_job(1, steps=3)
    denoiser.admit(a)
    denoiser.admit(b)
    assert denoiser.free_slots() == 0
    denoiser.tick()
    assert denoiser.cancel(a.key) is True
    assert denoiser.free_slots() == 1 and denoiser.active_slots == 1
    assert denoiser.cancel(a.key) is False
    denoiser.admit(make_job(2, steps=3))  # the freed slot is usable at once
    keys = [f.key for _ in range(3) for f in denoiser.tick()]
    assert a.key not in keys and b.key in keys


def test_admission_rejects_bad_jobs():
    dit = make_dit()
    denoiser = Denoiser(dit, stream_cfg(max_slots=1, batch_ceiling=2), "cpu")
    good = make_job(0)
    with pytest.raises(ValueError, match="steps"):
        denoiser.admit(dataclasses.replace(good, steps=0))
    with pytest.raises(ValueError, match="enc must be"):
        denoiser.admit(dataclasses.replace(good, enc=torch.zeros(4, C + 1)))
    with pytest.raises(ValueError, match="context must be"):
        denoiser.admit(dataclasses.replace(good, context=torch.zeros(2, D + 1)))
    with pytest.raises(ValueError, match="enc_null"):
        denoiser.admit(dataclasses.replace(good, enc_null=torch.zeros(1, C)))
    denoiser.admit(good)
    with pytest.raises(ValueError, match="already"):
        denoiser.admit(good)
    with pytest.raises(RuntimeError, match="no free slot"):
        denoiser.admit(make_job(1))
    with pytest.raises(ValueError, match="guidance"):
        Denoiser(dit, stream_cfg(guidance="bogus"), "cpu")
    with pytest.raises(ValueError, match="max_slots"):
        Denoiser(dit, stream_cfg(max_slots=8, batch_ceiling=4), "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_admission_and_ticks_never_sync_on_cuda():
    """Chunk admission is part of the steady state (every stream admits a chunk every few
    ticks): admitting, like ticking, must not wait for the device."""
    dit = make_dit("cuda")
    denoiser = Denoiser(dit, stream_cfg(), "cuda")
    jobs = [make_job(i, steps=4, frames=4 + 3 * i, context=i % 3, device="cuda") for i in range(3)]
    denoiser.admit(jobs[0])
    denoiser.tick()  # first use of every kernel outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with NoHostReads():
            for job in jobs[1:]:
                denoiser.admit(job)
                denoiser.tick()
            finished = [f for _ in range(6) for f in denoiser.tick()]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(finished) == 3 and denoiser.active_slots == 0
