"""TalkerSource: continuous batching gives every utterance exactly its solo codes.

The solo reference is engines.pipelines.talker.reference.generate_codes (full vocabulary, dynamic
per-step host loop, itself checked against the official code in test_talker_parity.py).
Random in-process bundles (testsupport/talker.py) need no oracle; the last test runs the
oracle fixtures' cases all in one batch against the official codes.
"""

from __future__ import annotations

import pytest
import torch

from engines.contract import SynthesisRequest
from engines.pipelines.talker.source import SourceRunners, TalkerSource
from testsupport.talker import admissible, make_bundle, step

TEXTS = ["Hello world.", "the quick brown fox", "你好，世界。", "Numbers 2026 and 42, jumps over the lazy dog.", "a",
         "small test of streaming speech", "lazy dog", "this is"]
VOICES = ["Vivian", "Ryan", "Dylan", "Vivian", "Ryan", "Dylan", "Vivian", "Ryan"]
LANGS = ["English", "Auto", "Auto", "Chinese", "English", "English", "Auto", "Chinese"]
MAX_NEW = [30, 3, 12, 40, 7, 25, 2, 18]  # different lengths (EOS may end some earlier)
MODES = [True, False, True, False, True, True, False, True]



@pytest.fixture(scope="module")
def bundle():
    return make_bundle(seed=3, eos_gain=1.2, max_new_tokens=40)


def request(i: int, greedy: bool = True, seed: int = 0) -> SynthesisRequest:
    return SynthesisRequest(id=f"r{i}", text=TEXTS[i], voice=VOICES[i], language=LANGS[i], greedy=greedy, seed=seed)


def solo(bundle, i: int, greedy: bool = True, seed: int = 0) -> torch.Tensor:
    return bundle.generate_codes(TEXTS[i], VOICES[i], LANGS[i], greedy=greedy, max_new_tokens=MAX_NEW[i],
                                 non_streaming_mode=MODES[i], seed=seed)


def run(source: TalkerSource, pending: list[int], greedy: bool = True, seeds=None, scheduler=None):
    """Admit whatever fits between ticks; collect frames; record (rows, unfinished) per tick
    (``scheduler``: the core scheduler planning each tick, its prefill token budget included)."""
    frames: dict[str, list] = {}
    finals: dict[str, int] = {}
    ticks = []
    pending = list(pending)
    unfinished = set()
    while pending or source.active_slots:
        while pending and admissible(source):
            i = pending.pop(0)
            source.admit(request(i, greedy, seeds[i] if seeds else 0), max_new_tokens=MAX_NEW[i],
                         non_streaming_mode=MODES[i])
            unfinished.add(f"r{i}")
        before = set(unfinished)
        out = step(source, scheduler)
        ticks.append((source.last_batch_rows, len(before)))
        for f in out:
            got = frames.setdefault(f.request_id, [])
            assert f.frame_start == sum(c.shape[0] for c in got), "frames arrive in order, without gaps"
            assert f.request_id not in finals, "nothing after is_last"
            got.append(f.codes)
            if f.is_last:
                finals[f.request_id] = f.frame_start + f.codes.shape[0]
                unfinished.discard(f.request_id)
    codes = {rid: torch.cat(parts) for rid, parts in frames.items()}
    return codes, finals, ticks


@pytest.mark.parametrize("batched_admission", [False, True], ids=["rows-started-one-by-one", "rows-started-together"])
def test_batched_with_seven_others_equals_solo(bundle, batched_admission):
    """(rows-started-together: the GPU's admission, the 8 prompts' inputs and row state in one pass)"""
    expected = {f"r{i}": solo(bundle, i) for i in range(8)}
    lengths = sorted({c.shape[0] for c in expected.values()})
    assert len(lengths) >= 5, f"utterances should differ in length, got {lengths}"
    source = TalkerSource.from_bundle(bundle, max_slots=8, max_seq_len=128,
                                      runners=SourceRunners(batched_admission=batched_admission))
    codes, finals, ticks = run(source, list(range(8)))
    for rid, exp in expected.items():
        assert torch.equal(codes[rid], exp), rid
        assert finals[rid] == exp.shape[0]
    # Finished utterances leave the batch: every tick's forward has exactly the rows of the
    # utterances still unfinished when it started, and the batch shrinks to the longest one.
    assert all(rows == unfinished for rows, unfinished in ticks), ticks
    assert ticks[0][0] == 8 and ticks[-1][0] == 1
    assert sum(rows for rows, _ in ticks) == sum(n + (1 if n < MAX_NEW[int(r[1:])] - 1 else 0)
                                                 for r, n in finals.items())  # + one EOS step each
    assert source.active_slots == 0 and admissible(source) == 8


def test_joining_between_ticks_equals_solo(bundle):
    """4 slots, 8 utterances: new ones join as others finish (rows move into the holes)."""
    expected = {f"r{i}": solo(bundle, i) for i in range(8)}
    source = TalkerSource.from_bundle(bundle, max_slots=4, max_seq_len=128)
    codes, _, ticks = run(source, [3, 0, 5, 2, 1, 7, 4, 6])
    assert max(rows for rows, _ in ticks) == 4
    for rid, exp in expected.items():
        assert torch.equal(codes[rid], exp), rid


@pytest.mark.parametrize("batched_admission", [False, True], ids=["rows-started-one-by-one", "rows-started-together"])
def test_sampled_batched_equals_solo(bundle, batched_admission):
    """Sampling noise is keyed by (seed, token index, id): batch neighbours change nothing."""
    seeds = [11, 12, 13, 14, 15, 16, 17, 18]
    expected = {f"r{i}": solo(bundle, i, greedy=False, seed=seeds[i]) for i in range(8)}
    source = TalkerSource.from_bundle(bundle, max_slots=8, max_seq_len=128,
                                      runners=SourceRunners(batched_admission=batched_admission))
    codes, _, _ = run(source, list(range(8)), greedy=False, seeds=seeds)
    for rid, exp in expected.items():
        assert torch.equal(codes[rid], exp), rid
    greedy = solo(bundle, 3)
    assert not torch.equal(expected["r3"][: greedy.shape[0]], greedy[: expected["r3"].shape[0]]), "sampling is on"


def test_cancel_frees_the_slot_and_leaves_others_alone(bundle):
    source = TalkerSource.from_bundle(bundle, max_slots=3, max_seq_len=128)
    for i in (3, 0, 5):
        source.admit(request(i), max_new_tokens=MAX_NEW[i], non_streaming_mode=MODES[i])
    got = {"r3": [], "r5": []}
    for _ in range(2):
        for f in step(source):
            got.setdefault(f.request_id, []).append(f.codes)
    assert source.cancel("r0") and not source.cancel("r0") and admissible(source) == 1
    assert source.rows == ["r3", "r5"]  # stable rows: r0's row is free, nothing moved
    while source.active_slots:
        for f in step(source):
            assert f.request_id != "r0"
            got[f.request_id].append(f.codes)
    assert torch.equal(torch.cat(got["r3"]), solo(bundle, 3))
    assert torch.equal(torch.cat(got["r5"]), solo(bundle, 5))


def test_limits_and_errors(bundle):
    source = TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=64)
    source.admit(request(0), max_new_tokens=1)  # one token, no frame: ends at once
    out = step(source)
    assert len(out) == 1 and out[0].is_last and out[0].codes.shape == (0, 4) and source.active_slots == 0
    with pytest.raises(ValueError, match="speaker"):
        source.admit(SynthesisRequest(id="x", text="hi", voice="nobody"))
    with pytest.raises(ValueError, match="language"):
        source.admit(SynthesisRequest(id="x", text="hi", voice="Ryan", language="Klingon"))
    source.admit(request(1))
    with pytest.raises(RuntimeError, match="slot"):
        source.admit(request(2))
    assert source.voices() == ["dylan", "ryan", "vivian"] and "auto" in source.languages()
    assert source._utts[0].max_frames == bundle.generation.max_new_tokens - 1
    # The cache bounds the frames: prompt + frames never exceed max_seq_len.
    source.cancel("r1")
    source.admit(request(3), max_new_tokens=1000)
    n = 0
    while source.active_slots:
        n += sum(f.codes.shape[0] for f in step(source))
    prompt_len = len(bundle.prompt.build(TEXTS[3], VOICES[3], LANGS[3]))
    assert n <= 64 - prompt_len


@pytest.mark.parity
def test_all_oracle_cases_in_one_batch_equal_official():
    from engines.pipelines.talker.reference import TalkerBundle
    from tests.oracle import talker_fixtures as fx

    for name in fx.CHECKPOINTS:
        bundle = TalkerBundle.from_checkpoint(fx.checkpoint_dir(name))
        refs, cases = fx.references(name), fx.cases(name)
        source = TalkerSource.from_bundle(bundle, max_slots=len(cases), max_seq_len=256)
        for case, c in cases.items():
            source.admit(SynthesisRequest(id=case, text=c["prompt"], voice=c["speaker"], language=c["language"],
                                          greedy=True), max_new_tokens=c["max_new_tokens"],
                         non_streaming_mode=c["non_streaming_mode"], instruct=c["instruct"])
        got: dict[str, list] = {case: [] for case in cases}
        while source.active_slots:
            for f in step(source):
                got[f.request_id].append(f.codes)
        for case in cases:
            assert torch.equal(torch.cat(got[case]), refs[f"case/{case}/codes"]), (name, case)


def test_tick_reads_nothing_from_the_device(bundle):
    """Steady-state ticks (mixed greedy/sampled rows, finishing rows, compaction) make no
    host read of device values: no .item(), nonzero, boolean-mask indexing or device->host
    copy other than the id buffer of the previous step (same detector as test_stream)."""
    from host_read_helpers import NoHostReads

    source = TalkerSource.from_bundle(bundle, max_slots=4, max_seq_len=128)
    for i in range(3):
        source.admit(request(i, greedy=i != 1, seed=i), max_new_tokens=6 + 4 * i, non_streaming_mode=MODES[i])
    finished = 0
    with torch.no_grad(), NoHostReads():
        while source.active_slots:
            finished += sum(f.is_last for f in step(source))
    assert finished == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_started_together_equal_rows_started_one_by_one_on_cuda():
    """The GPU's admission (fp32: the same kernels whichever way the rows start, so equal codes)."""
    cuda_bundle = make_bundle(seed=3, eos_gain=1.2, max_new_tokens=40, device="cuda")
    codes = {}
    for together in (False, True):
        source = TalkerSource.from_bundle(cuda_bundle, max_slots=8, max_seq_len=128,
                                          runners=SourceRunners(batched_admission=together))
        codes[together], _, _ = run(source, list(range(8)), greedy=False, seeds=list(range(8)))
    assert codes[True].keys() == codes[False].keys() == {f"r{i}" for i in range(8)}
    for rid, want in codes[False].items():
        assert torch.equal(codes[True][rid].cpu(), want.cpu()), rid


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_steady_state_tick_never_syncs_on_cuda():
    """On CUDA the only wait in a tick is the event of the previous step's id copy (its
    device->host copy is non_blocking into pinned memory, so the sync detector is the
    check here, not NoHostReads, which forbids every device->host copy)."""
    bundle = make_bundle(seed=3, eos_gain=1.2, max_new_tokens=40, device="cuda")
    source = TalkerSource.from_bundle(bundle, max_slots=4, max_seq_len=128)
    for i in range(3):
        source.admit(request(i, greedy=i != 1, seed=i), max_new_tokens=6 + 4 * i, non_streaming_mode=MODES[i])
    step(source)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    finished = 0
    try:
        with torch.no_grad():
            while source.active_slots:
                finished += sum(f.is_last for f in step(source))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert finished == 3
