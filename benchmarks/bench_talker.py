"""Talker speed, measured so it cannot flatter either side: ours vs the official ``generate()``,
prefill and decode timed apart, variants taking turns, next to the machine's floor.

    python benchmarks/bench_talker.py --size 0.6b --batches 1 8 --rounds 3 --steps 4 --threads 1
    python benchmarks/bench_talker.py --size 0.6b --batches 1 8 --baseline-commit HEAD~3   # + ours then
    scripts/mnn-env.sh && python benchmarks/bench_talker.py --size 0.6b --batches 1 --threads 2 \
        --no-official --mnn /tmp/mnn-0.6b     # + qwen3-tts-mnn (its model exported on first use; ~9 GB)
    python benchmarks/bench_talker.py --size 0.6b --batches 1 --threads 1 --quantize int8 --no-official \
        --mnn /tmp/mnn-0.6b-int8 --mnn-quant int8 --mnn-memory normal low   # + the peer in its own int8
    python benchmarks/bench_talker.py --size 0.6b --device cuda --dtype bfloat16 --batches 1 8 64 \
        --official-batches 1 8 --step-graphs --oracle-python /tmp/oracle-python

How (every number printed comes from this procedure):
* **Variants are long-lived processes** (``--worker``), each holding its own model (random
  weights at the chosen sizes: timing does not depend on their values) and built before the
  first round: "ours" (this tree), "official" (``qwen-tts`` in ``.venv-oracle``), "ours@REV"
  (``--baseline-commit``: that commit's engine, exported with ``git archive``), "mnn fp32"
  and "mnn fp32 unroll" (``--mnn DIR``: the qwen3-tts-mnn peer in ``.venv-mnn`` on the same random
  talker, exported by benchmarks/export_mnn.py, with its per-pass and its unrolled code predictor
  graphs; batch 1 only; ``--mnn-quant int8``: "mnn int8" / "mnn int8 unroll", its graphs in MNN's
  own block-wise int8, which MNN expands to fp32 in the sessions the peer creates; ``--mnn-memory
  low``: "mnn int8 lowmem", its sessions with MNN's Memory_Low hint, computing on the int8 weights
  and held to the floor of "ours int8") and on CUDA the step-graph variants. Only one works at
  a time; the others wait on their stdin.
* **Rounds**: at each batch size, every round runs each variant once, in an order rotated by
  one per round (so no variant always goes first, or always runs right after another), and
  the coordinator measures the machine's bandwidth in its own turn of the same round. Ratios
  are taken between figures of the SAME round (same machine load), then summarised.
* **Prefill and decode apart**, in every variant:
  - ours: prefill = admitting B requests (tokenize, prompt, KV blocks) + the chunked prefill
    forward(s) + code 0 of frame 0, i.e. until every row decodes; decode = one
    ``TalkerSource.tick()`` in steady state (code predictor + talker step + sampling; no
    admission, EOS blocked so every row emits one frame per tick);
  - official: a forward pre-hook on its talker stamps each call; prefill = ``generate()``'s
    start until the 2nd talker call starts (input embeds + prefill forward + first sampling);
    decode step k = start of call k+1 .. start of call k+2 (code predictor's 15-step
    ``generate()`` + talker step + HF's sampling loop), EOS unreachable;
  - mnn: its own ``synthesize_codes`` (pure pymnn: its native extension is a macOS arm64 build),
    greedy, EOS blocked (``min_new_tokens``); its ``on_frame`` callback stamps each frame's
    codes; prefill = the call's start (tokenizing, its voice-clone prompt) until frame 0's codes
    (so it includes frame 0's code predictor); decode step = one stamp to the next (talker
    step + code 0 in numpy + the code predictor: 15 ``cp_step`` calls and 15 numpy heads, or one
    ``cp_unrolled`` call);
  - all drop their first decode step (warm-up after the other process ran) and time
    ``--steps`` more; a turn reports its min and median step.
* **Summary per variant and batch**: min and median over rounds of the turn medians (the
  min is the least disturbed figure), ms per frame = step / B.
* **Floor**: bytes one step must read (the weights of one frame: talker layers, norm, the
  valid codec-head rows, 15 code-predictor passes; plus every row's K/V over its positions)
  / the read bandwidth measured in the coordinator's turn of each round (with the native
  extension: its plain AVX-512 / AVX2 read of 1 GiB on one thread, what one core streams; else
  a torch ``sum`` over 512 MiB); for fp32 variants also the compute floor 2 x B x weights / the
  best measured GEMM FLOP/s; the floor is the larger. "x floor" = a turn's step / the floor of
  the SAME round (min and median over rounds). torch's GEMV rate is printed for reference only:
  it is one kernel's speed, not what memory delivers.
* **Quantized modes** run their decode step in the native frame (engines/native) where it was
  built; ``--ort-too`` adds each mode with its step on ONNX Runtime ("ours int8 ort"; with
  ``--baseline-commit`` that commit's too).
* **The codec decoder beside it** (``--codec``): every "ours" variant also holds the speech
  tokenizer's decoder at the size's codec sizes (the released ones for 0.6b / 1.7b,
  benchmarks/released/) and, in the same turn, decodes its B rows in streaming chunks of
  ``--codec-chunk`` frames (``decode_step`` with carried state; the first chunk dropped). The
  report adds the whole CPU path per frame: talker + codec = total, RTF = total / 80 ms, next
  to their floors (talker: its GEMV floor; codec: its multiply-adds / the best GEMM FLOP/s).
  Before timing, every variant decodes the same 8 frames of codes and the coordinator compares
  the waveforms with the first variant's (max abs error, SNR): an fp32 reordering must stay at
  rounding level, a reduced precision shows its SNR. ``--codec-bf16`` adds "ours <mode>
  codec-bf16" (the decoder in bfloat16); ``--baseline-commit`` variants also run every
  ``--quantize`` mode, so a before / after of the whole path is one run.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SIZES = {  # talker hidden/layers/heads/kv/head_dim, predictor hidden/layers, G, codebook, text hidden
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, predictor_hidden=64, predictor_layers=2,
                 groups=4, codebook=64, text_hidden=64),
    "small": dict(hidden=256, layers=6, heads=8, kv_heads=4, head_dim=32, predictor_hidden=256, predictor_layers=3,
                  groups=8, codebook=256, text_hidden=256),
    # The released talker sizes (REFERENCES.md; text vocabulary kept small: it does not enter a step).
    "0.6b": dict(hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8, head_dim=128,
                 predictor_hidden=1024, predictor_intermediate=3072, predictor_layers=5, predictor_heads=16,
                 predictor_kv_heads=8, predictor_head_dim=128, groups=16, codebook=2048, text_hidden=2048),
    "1.7b": dict(hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8, head_dim=128,
                 predictor_hidden=1024, predictor_intermediate=3072, predictor_layers=5, predictor_heads=16,
                 predictor_kv_heads=8, predictor_head_dim=128, groups=16, codebook=2048, text_hidden=2048),
}
TEXT = "Streaming speech from the talker, one frame at a time, for every utterance in the batch."
REPLY = "BENCH "  # prefix of a worker's answer lines (anything else a library prints is ignored)


# --------------------------------------------------------------------------- shared helpers


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def frame_weights(talker, predictor) -> tuple[int, int]:
    """Weight bytes and elements one frame reads: the talker step, then G-1 code-predictor
    steps (int8 / int4 layers, engines/models/quantize*.py, count their packed bytes and scales)."""
    def size(module) -> tuple[int, int]:
        b = sum(p.numel() * p.element_size() for p in module.parameters())
        n = sum(p.numel() for p in module.parameters())
        for m in module.modules():
            if hasattr(m, "weight_bytes"):
                b += m.weight_bytes
                n += m.weight_elems if hasattr(m, "weight_elems") else m.in_features * m.out_features
        return b, n

    w = talker.codec_head.weight
    parts = [size(talker.model.layers), size(talker.model.norm), (talker.valid_ids.numel() * w[0].numel() *
                                                                   w.element_size(), talker.valid_ids.numel() * w[0].numel())]
    p = predictor
    layers = getattr(p, "fused_layers", None) or p.model.layers  # quantized: one module for every layer
    step = [size(layers), size(p.model.norm), size(p.small_to_mtp_projection), size(p.lm_head[0])]
    g = talker.cfg.num_code_groups - 1
    return (sum(b for b, _ in parts) + g * sum(b for b, _ in step), sum(n for _, n in parts) + g * sum(n for _, n in step))



def compile_backend(part: str) -> str | None:
    """The engine's torch.compile switch for ``part`` (STREAMVOX_COMPILE*, read by the service's
    settings); an older tree (``--variant`` at a previous commit) kept it in cuda_graphs."""
    try:
        from service.settings import runtime_switches
    except ImportError:
        from engines.runtime.cuda_graphs import compile_backend as older

        return older(part)
    return runtime_switches().compile_backend(part)

def paged_attention() -> bool:
    """The engine's paged-attention switch (STREAMVOX_PAGED_ATTENTION=0 turns it off: the settings read it)."""
    from service.settings import runtime_switches

    return runtime_switches().paged_attention


_READ_BUFFER = None


def read_bandwidth(device, nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes/s of the fastest of ``reps`` full reads of a buffer: on a CPU with the native extension
    (engines/native) its plain AVX-512 / AVX2 read of 1 GiB on this thread, what one core streams
    (the floor a weight-bound step is held to); else a torch ``sum`` over ``nbytes``."""
    import torch

    if device.type == "cuda":
        from bench_code_predictor import copy_bandwidth

        return copy_bandwidth(device)
    from engines import native

    if native.available():
        global _READ_BUFFER
        if _READ_BUFFER is None:  # written once (untouched pages would all read the zero page)
            _READ_BUFFER = torch.ones(1 << 30, dtype=torch.uint8)
        best = best_cpu = float("inf")
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.thread_time()
            native.lib.sv_read_bytes(_READ_BUFFER.data_ptr(), _READ_BUFFER.numel())
            best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.thread_time() - c0)
        read_bandwidth.cpu = _READ_BUFFER.numel() / best_cpu  # on-core time: the step's CPU column's floor
        return _READ_BUFFER.numel() / best
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def gemv_bandwidth(device, dtype, nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes/s of weights read by the library's own matrix-vector product (one row times a
    [n, 4096] weight of ``nbytes``): what a weight-bound step can reach with these kernels."""
    import torch
    import torch.nn.functional as F

    k = 4096
    w = torch.ones(nbytes // (k * dtype.itemsize), k, device=device, dtype=dtype)
    x = torch.ones(1, k, device=device, dtype=dtype)
    F.linear(x, w)
    sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        F.linear(x, w)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return w.numel() * dtype.itemsize / best


def gemm_flops(device, dtype, n: int = 1024, reps: int = 5) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def reply(obj) -> None:
    print(REPLY + json.dumps(obj), flush=True)


def serve(run) -> None:
    """A worker's loop: one JSON request per stdin line -> one reply line; EOF ends it."""
    reply({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply(run(req["batch"], req["steps"]))
        except Exception as exc:  # the coordinator prints it and goes on without this variant
            import traceback

            traceback.print_exc()
            reply({"error": f"{type(exc).__name__}: {exc}"})


def stats_of(step_s: list[float], cpu_s: list[float] | None = None) -> dict:
    out = {"step_min_ms": min(step_s) * 1e3, "step_med_ms": statistics.median(step_s) * 1e3}
    if cpu_s:  # the worker thread's CPU time (torch at 1 thread runs on it): robust to a busy machine
        out["step_cpu_ms"] = statistics.median(cpu_s) * 1e3
    return out


# --------------------------------------------------------------------------- the codec decoder (ours, any tree)

RELEASED = REPO / "benchmarks" / "released" / "Qwen3-TTS-12Hz-0.6B-CustomVoice.json"
AGREE_FRAMES = 8  # frames every variant decodes from the same codes before timing, for the agreement check


def codec_decoder(size: str, device, dtype):
    """The codec decoder at ``size``'s codec sizes (0.6b and 1.7b share the released one), random weights."""
    import torch

    from engines.models.codec_decoder import CodecDecoder
    from engines.models.configs import CodecDecoderConfig
    from engines.models.init import init_module_

    if size in ("0.6b", "1.7b"):
        fields = json.loads(RELEASED.read_text())["speech_tokenizer/config.json"]["decoder_config"]
        # the release leaves the decoder's KV heads at the official default: as many as the heads
        cfg = CodecDecoderConfig.from_dict({"num_key_value_heads": fields["num_attention_heads"], **fields})
    else:
        from engines.config import get_preset

        cfg = get_preset("tiny").decoder
    with torch.device("cpu"):
        decoder = init_module_(CodecDecoder(cfg), 0).eval()
    return decoder.to(device=device, dtype=dtype)


def codec_flops(decoder, chunk: int) -> float:
    """Multiply-adds x 2 of one streamed frame (convs, transposed convs, linears), counted by hooks."""
    import torch
    from torch import nn

    total = [0.0]

    def count(m, inputs, out):
        x = inputs[0]
        if isinstance(m, nn.Conv1d):
            total[0] += 2 * out.numel() * m.in_channels // m.groups * m.kernel_size[0]
        elif isinstance(m, nn.ConvTranspose1d):
            total[0] += 2 * x.numel() * m.out_channels * m.kernel_size[0]
        elif isinstance(m, nn.Linear):
            total[0] += 2 * out.numel() * m.in_features

    kinds = (nn.Conv1d, nn.ConvTranspose1d, nn.Linear)
    hooks = [m.register_forward_hook(count) for m in decoder.modules() if isinstance(m, kinds)]
    # hooks only fire through module calls: the GEMM paths call the weights directly, so count on the plain path
    device = next(decoder.parameters()).device
    codes = torch.zeros(1, decoder.cfg.num_quantizers, chunk, dtype=torch.long, device=device)
    with torch.no_grad(), _NoFastPaths():
        state = decoder.init_state(1)
        decoder.decode_step(codes, state)
    for h in hooks:
        h.remove()
    return total[0] / chunk


class _NoFastPaths:
    """Runs the decoder through its plain module calls (where its fast paths would bypass them)."""

    def __enter__(self):
        import engines.models.codec_decoder as cd

        self.saved = getattr(cd, "_few_samples", None)
        if self.saved is not None:
            cd._few_samples = lambda *a, **k: False
        return self

    def __exit__(self, *exc):
        import engines.models.codec_decoder as cd

        if self.saved is not None:
            cd._few_samples = self.saved


def codec_agreement_wave(decoder, chunk: int) -> list[float]:
    """Batch 1, AGREE_FRAMES frames of fixed codes decoded in chunks: the waveform every variant must match."""
    import torch

    g = torch.Generator().manual_seed(1234)
    codes = torch.randint(0, decoder.cfg.codebook_size, (1, decoder.cfg.num_quantizers, AGREE_FRAMES), generator=g)
    codes = codes.to(next(decoder.parameters()).device)
    state, out = decoder.init_state(1), []
    with torch.no_grad():
        for i in range(0, AGREE_FRAMES, chunk):
            wav, state = decoder.decode_step(codes[..., i:i + chunk], state)
            out.append(wav.float().cpu())
    return torch.cat(out, dim=-1)[0].tolist()


def time_codec(decoder, b: int, chunk: int, steps: int, device, with_cpu: bool) -> dict:
    """Streaming decode of b rows: one warm-up chunk, then ``steps`` timed chunks of ``chunk`` frames."""
    import torch

    g = torch.Generator().manual_seed(b)
    shape = (b, decoder.cfg.num_quantizers, chunk * (steps + 1))
    codes = torch.randint(0, decoder.cfg.codebook_size, shape, generator=g)
    codes = codes.to(device)
    state, times, cpu = decoder.init_state(b), [], []
    with torch.no_grad():
        for i in range(steps + 1):
            sync(device)
            t0, c0 = time.perf_counter(), time.thread_time()
            _, state = decoder.decode_step(codes[..., i * chunk:(i + 1) * chunk], state)
            sync(device)
            if i:
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
    per_frame = chunk * b
    out = {"codec_min_ms": min(times) * 1e3 / per_frame, "codec_med_ms": statistics.median(times) * 1e3 / per_frame}
    if with_cpu:
        out["codec_cpu_ms"] = statistics.median(cpu) * 1e3 / per_frame
    return out


# --------------------------------------------------------------------------- ours (this tree or an old one)


def ours_worker(args) -> None:
    import dataclasses

    import torch

    from engines.contract import SynthesisRequest
    from engines.core.scheduler import Scheduler
    from engines.pipelines.talker.source import TalkerSource
    try:
        from testsupport.talker import make_bundle
    except ImportError:  # a tree from before testsupport/ (--baseline-commit)
        from tests.talker_helpers import make_bundle

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    mode = args.quantize[0] if args.quantize else None
    if mode == "bf16":  # the whole talker in bfloat16 (weights, activations, KV)
        dtype = torch.bfloat16
    bundle = make_bundle(seed=0, max_new_tokens=100_000, eos_gain=1.0, device=device, dtype=dtype,
                         **SIZES[args.size])
    # EOS blocked (as the official run makes it unreachable): every row emits one frame per tick.
    bundle.generation = dataclasses.replace(bundle.generation, min_new_tokens=10**9)
    if mode not in (None, "bf16"):
        from engines.models.quantize import quantize_talker

        # ORT: --threads too; the native frame (engines/native) where built, unless this variant is the ORT one
        native = False if args.variant == "ours-ort" else None
        quantize_talker(bundle.talker, bundle.predictor, mode, threads=torch.get_num_threads(), native=native)
    predictor = bundle.predictor
    if device.type == "cuda" and args.variant == "ours":  # the code predictor's graphs, as the engine runs it
        from engines.runtime.graphed_predictor import DEFAULT_BUCKETS, GraphedCodePredictor

        top = max(args.batches)
        predictor = GraphedCodePredictor(bundle.predictor, buckets=tuple(b for b in DEFAULT_BUCKETS if b < top) + (top,),
                                         compile_backend=compile_backend("predictor"))
        predictor.capture_all()
    if args.variant == "ours+ctalk":  # compile off: dynamo's eager backend runs the same plumbing, no inductor
        bundle.talker.compile_layers(compile_backend("predictor") or "eager")
    weight_bytes, weight_elems = frame_weights(bundle.talker, bundle.predictor)
    cfg = bundle.talker.cfg
    kv_pos_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    prompt_len = len(bundle.prompt.build(TEXT, "Ryan", non_streaming_mode=True).text_ids)
    serial = 0
    codec = None
    if args.codec:
        codec = codec_decoder(args.size, device, getattr(torch, args.codec_dtype))
        codec_info = {"codec_flops": codec_flops(codec, args.codec_chunk),
                      "codec_wave": codec_agreement_wave(codec, args.codec_chunk)}

    def run(b: int, steps: int) -> dict:
        nonlocal serial
        warm = 1 if args.variant == "ours" or device.type != "cuda" else 12  # step graphs capture first
        # Every row says the same text: the prompt-prefix cache (where the tree has one) would
        # serve all but the first from memory, while the official rows are all prefilled.
        no_prefix = {"prefix_cache_fraction": 0.0} if "prefix_cache_fraction" in inspect.signature(
            TalkerSource.__init__).parameters else {}
        if "paged_attention" in inspect.signature(TalkerSource.__init__).parameters:  # an older tree read the variable
            no_prefix["paged_attention"] = paged_attention()
        source = TalkerSource.from_bundle(bundle, max_slots=b, max_seq_len=prompt_len + warm + steps + 16,
                                          kv_cache_gb=64.0, **no_prefix)
        source.predictor = predictor
        scheduler = Scheduler(max_slots=b)  # plans each step's prefill (its default token budget)
        if args.variant in ("ours+graphs", "ours+ctalk"):
            from engines.runtime.graphed_talker import GraphedTalkerStep

            source.step_runner = GraphedTalkerStep(source.step_spec(), compile_backend=compile_backend("predictor"))
        with torch.no_grad():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(b):
                source.admit(SynthesisRequest(id=f"u{serial}", text=TEXT, voice="Ryan", temperature=0,
                                              non_streaming_mode=True), max_new_tokens=warm + steps + 8)
                serial += 1
            while source._prefill_queue:  # every prompt prefilled and its code 0 sampled
                prefill_step = getattr(source, "prefill_step", None) or source._prefill  # older trees: _prefill
                prefill_step(scheduler.step_plan(source.capacity()).prefill)
            sync(device)
            prefill = time.perf_counter() - t0
            for _ in range(warm):
                source.tick(scheduler.step_plan(source.capacity()))
            times, cpu = [], []
            for _ in range(steps):
                sync(device)
                t0, c0 = time.perf_counter(), time.thread_time()
                out = source.tick(scheduler.step_plan(source.capacity()))
                sync(device)
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
                if sum(f.codes.shape[0] for f in out) != b:
                    raise RuntimeError(f"a tick emitted {sum(f.codes.shape[0] for f in out)} frames, not {b}")
        for rid in source.rows:
            source.cancel(rid)
        kv_positions = prompt_len + warm + steps / 2  # mean positions a row reads over the timed steps
        codec_out = {}
        if codec is not None:  # same turn, right after the talker: the same machine load
            codec_out = {**codec_info, **time_codec(codec, b, args.codec_chunk, steps, device, args.threads == 1)}
        return {"prefill_ms": prefill * 1e3, **stats_of(times, cpu if args.threads == 1 else None), **codec_out,
                "prompt_len": prompt_len,
                "weight_bytes": weight_bytes, "weight_elems": weight_elems,
                "kv_bytes": b * kv_positions * kv_pos_bytes}

    serve(run)


# --------------------------------------------------------------------------- official generate()


def official_worker(args) -> None:
    import torch

    sys.path.insert(0, str(REPO / "tests" / "oracle"))
    import official  # noqa: F401  (stubs, version pin)

    s = SIZES[args.size]
    cb = s["codebook"]
    special = cb
    talker = dict(
        code_predictor_config=dict(vocab_size=cb, hidden_size=s["predictor_hidden"],
                                   intermediate_size=s.get("predictor_intermediate", 2 * s["predictor_hidden"]),
                                   num_hidden_layers=s["predictor_layers"],
                                   num_attention_heads=s.get("predictor_heads", 4),
                                   num_key_value_heads=s.get("predictor_kv_heads", 2),
                                   head_dim=s.get("predictor_head_dim", s["predictor_hidden"] // s.get("predictor_heads", 4)),
                                   rope_theta=1_000_000, num_code_groups=s["groups"]),
        vocab_size=cb + 1024, hidden_size=s["hidden"], intermediate_size=s.get("intermediate", 2 * s["hidden"]),
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"], rope_theta=1_000_000,
        rope_scaling={"mrope_section": [s["head_dim"] // 2 - 2 * (s["head_dim"] * 5 // 32),
                                        s["head_dim"] * 5 // 32, s["head_dim"] * 5 // 32],
                      "interleaved": True, "rope_type": "default"},
        num_code_groups=s["groups"], text_hidden_size=s["text_hidden"], text_vocab_size=512,
        codec_pad_id=special + 100, codec_bos_id=special + 101, codec_eos_token_id=special + 102,
        codec_think_id=special + 106, codec_nothink_id=special + 107, codec_think_bos_id=special + 108,
        codec_think_eos_id=special + 109, spk_id={"ryan": special + 201}, spk_is_dialect={"ryan": False},
        codec_language_id={"english": special + 51})
    cfg = official.Qwen3TTSConfig(talker_config=talker, speaker_encoder_config={}, tokenizer_type="qwen3_tts_tokenizer_12hz",
                                  tts_model_size="bench", tts_model_type="custom_voice", im_start_token_id=500,
                                  im_end_token_id=501, tts_pad_token_id=502, tts_bos_token_id=503, tts_eos_token_id=504)
    dev = torch.device(args.device)
    model = official.Qwen3TTSForConditionalGeneration(cfg).eval().to(dev, getattr(torch, args.dtype))
    stamps: list[float] = []

    cpu_stamps: list[float] = []

    def stamp(*_):
        sync(dev)
        stamps.append(time.perf_counter())
        cpu_stamps.append(time.thread_time())

    model.talker.register_forward_pre_hook(stamp)
    g = torch.Generator().manual_seed(0)

    def run(b: int, steps: int) -> dict:
        # The same prompt length as ours: role, the body's token count, im_end + the next role.
        ids = [torch.cat([torch.tensor([[500, 10, 11]]), torch.randint(20, 400, (1, args.body_tokens), generator=g),
                          torch.tensor([[501, 12, 500, 10, 11]])], dim=1).to(dev) for _ in range(b)]
        stamps.clear()
        cpu_stamps.clear()
        with torch.no_grad():
            sync(dev)
            t0 = time.perf_counter()
            model.generate(input_ids=ids, languages=["English"] * b, speakers=["ryan"] * b, non_streaming_mode=True,
                           max_new_tokens=steps + 3, do_sample=False, subtalker_dosample=False,
                           eos_token_id=special + 100)  # codec_pad: suppressed, so never generated
        starts = stamps[1:]  # call 1 is the prefill
        times = [b1 - a1 for a1, b1 in zip(starts, starts[1:])][1:steps + 1]  # the first decode step is warm-up
        if len(times) < steps:
            raise RuntimeError(f"official generate() made {len(stamps)} talker calls, {steps + 3} expected")
        cpu_starts = cpu_stamps[1:]
        cpu = [b1 - a1 for a1, b1 in zip(cpu_starts, cpu_starts[1:])][1:steps + 1]
        return {"prefill_ms": (starts[0] - t0) * 1e3, **stats_of(times, cpu if args.threads == 1 else None)}

    serve(run)


# --------------------------------------------------------------------------- qwen3-tts-mnn (its own venv)


def mnn_worker(args) -> None:
    """The peer's own generation loop on the model directory benchmarks/export_mnn.py wrote
    (numpy + MNN only: this process has no torch). ``--mnn-memory low``: its sessions get MNN's
    Memory_Low hint (the peer itself asks only for ``numThread``), under which MNN's CPU backend keeps
    a weight-quantized graph's int8 weights and computes with them; without it MNN expands them to
    fp32 when a session is sized (an int8 talker_step.mnn: 1,709 MB of session memory, 476 MB with it)."""
    from qwen3_tts_mnn import Qwen3TtsMnn

    if args.mnn_memory == ["low"]:  # the peer's _MnnRunner makes MNN.Interpreter(path) (an immutable C type)
        import MNN

        class LowMemory(MNN.Interpreter):
            def createSession(self, config=None, *rest):  # BackendConfig::Memory_Low (pymnn reads an int only)
                return super().createSession({**(config or {}), "memory": 2}, *rest)

        MNN.Interpreter = LowMemory

    tts = Qwen3TtsMnn(args.mnn, num_threads=args.threads or os.cpu_count(), language="english", backend="pymnn")
    tts.load_voice(str(Path(args.mnn) / "voice"))
    stamps: list[tuple[float, float]] = []

    def stamp(*_):  # on_frame(t, frame): frame t's 16 codes are done
        stamps.append((time.perf_counter(), time.thread_time()))

    def run(b: int, steps: int) -> dict:
        if b != 1:
            raise ValueError("qwen3-tts-mnn generates one utterance at a time")
        stamps.clear()
        t0 = time.perf_counter()
        tts.synthesize_codes(TEXT, steps + 3, temperature=0.0, repetition_penalty=1.0, min_new_tokens=10**9,
                             on_frame=stamp)
        if len(stamps) < steps + 2:
            raise RuntimeError(f"qwen3-tts-mnn made {len(stamps)} frames, {steps + 3} expected")
        wall = [b1[0] - a1[0] for a1, b1 in zip(stamps, stamps[1:])][1:steps + 1]  # the first is warm-up
        cpu = [b1[1] - a1[1] for a1, b1 in zip(stamps, stamps[1:])][1:steps + 1]
        return {"prefill_ms": (stamps[0][0] - t0) * 1e3, **stats_of(wall, cpu if args.threads == 1 else None)}

    serve(run)


def mnn_specs(args, env: dict) -> list[tuple]:
    """The mnn variants' (name, command, cwd, env, batch sizes): the peer on the step graphs
    ("mnn fp32", its documented layout) and with its unrolled code predictor ("mnn fp32 unroll",
    the path it prefers when ``cp_unrolled.mnn`` exists); the model is exported first if ``--mnn``
    has none. Empty (the reason printed) when they cannot run here."""
    python = Path(args.mnn_python)
    quant = args.mnn_quant
    if not python.is_file():
        print(f"(no {python}: the mnn variants are skipped; build it with scripts/mnn-env.sh)")
        return []
    if args.size != "0.6b":
        print("(the mnn variants run at --size 0.6b only: the peer hard-codes the released K/V shapes)")
        return []
    model = Path(args.mnn)
    if not (model / "unrolled" / "cp_unrolled.mnn").is_file():  # (an existing DIR is trusted to be in --mnn-quant)
        print(f"exporting the talker for qwen3-tts-mnn ({quant}) into {model} (benchmarks/export_mnn.py, ~3 minutes)",
              flush=True)
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "export_mnn.py"), "--size", args.size, str(model),
                        "--mnn-python", str(python), "--quant", quant], check=True, env=dict(env, PYTHONPATH=str(REPO)))
    # MNN gets --threads; numpy's BLAS (the peer's code-0 and 15 predictor heads, small GEMVs) one thread,
    # its best here: with 2 OpenBLAS threads on the 2 loaded cores a frame took 1.7-2.1 s, not 0.7-0.9 s
    env = dict(env, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    me = [str(python), str(Path(__file__).resolve()), "--worker", "mnn", "--mnn"]
    layouts = {"step": (f"mnn {quant}", model), "unroll": (f"mnn {quant} unroll", model / "unrolled")}
    return [(name + (" lowmem" if memory == "low" else ""), me + [str(path), "--mnn-memory", memory], REPO, env, {1})
            for layout, (name, path) in layouts.items() if layout in args.mnn_layouts for memory in args.mnn_memory]


# --------------------------------------------------------------------------- coordinator


class Worker:
    """A variant's long-lived process; ``ask`` sends one request and waits for its reply."""

    def __init__(self, name: str, cmd: list[str], cwd: Path, env: dict, batches: set[int] | None = None):
        self.name = name
        self.batches = batches  # the batch sizes it runs at (None: all)
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.alive = self._read() is not None

    def _read(self) -> dict | None:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        return None

    def ask(self, batch: int, steps: int) -> dict | None:
        if not self.alive:
            return None
        try:
            self.proc.stdin.write(json.dumps({"batch": batch, "steps": steps}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it died since its last reply (e.g. killed for memory): go on without it
            got = None
        else:
            got = self._read()
        if got is None or "error" in got:
            print(f"  {self.name} at batch {batch}: {got and got['error'] or 'the process died'}", flush=True)
            self.alive = got is not None
            return None
        return got

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except BrokenPipeError:  # an unsent request to a dead worker
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def export_commit(rev: str) -> Path:
    """That commit's tree in a temporary folder (git archive: the checkout itself is untouched)."""
    out = Path(tempfile.mkdtemp(prefix="bench-talker-"))
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    if (out / "engines" / "native" / "talker_frame.c").is_file():  # its native frame built too (else ORT runs)
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=out, check=True,
                       capture_output=True, env=dict(os.environ, PYTHONPATH=str(out)))
    return out


def machine_line(device) -> str:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
    return (f"device {device} ({name}); {os.cpu_count()} CPUs; torch {torch.__version__}; "
            f"threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--official-batches", type=int, nargs="+", default=None,
                    help="batches the official variant runs at (default: --batches; it is slow at large ones)")
    ap.add_argument("--rounds", type=int, default=3, help="turns of every variant per batch size")
    ap.add_argument("--steps", "--ticks", type=int, default=4, dest="steps", help="timed decode steps per turn")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of every process (0 = default)")
    ap.add_argument("--baseline-commit", default=None, help="also time ours at this git revision")
    ap.add_argument("--quantize", nargs="*", default=[], choices=["int8", "int4", "int8-int4p", "bf16"],
                    help="also time ours with quantized weights (engines/models/quantize.py) and/or all in bf16")
    ap.add_argument("--ort-too", action="store_true",
                    help="also each --quantize mode with its decode step on ONNX Runtime (not the native frame)")
    ap.add_argument("--step-graphs", action="store_true", help="also ours with the whole step as CUDA graphs (on a CPU: its static-buffer path, eager)")
    ap.add_argument("--compile-talker", action="store_true", help="also step graphs + compiled talker layers")
    ap.add_argument("--eager-predictor", action="store_true", help=argparse.SUPPRESS)  # kept for old command lines
    ap.add_argument("--no-official", action="store_true", help="skip the .venv-oracle variant")
    ap.add_argument("--no-fp32", action="store_true",
                    help="skip the fp32 'ours' variant (with --quantize: only the quantized modes are timed)")
    ap.add_argument("--oracle-python", default=str(REPO / ".venv-oracle" / "bin" / "python"))
    ap.add_argument("--mnn", default=None, metavar="DIR",
                    help="also time qwen3-tts-mnn (fp32, batch 1; see --mnn-layouts) on the same random talker, "
                         "exported into DIR by benchmarks/export_mnn.py if DIR has no model yet; needs .venv-mnn: "
                         "scripts/mnn-env.sh")
    ap.add_argument("--mnn-layouts", nargs="+", default=["step"], choices=["step", "unroll"],
                    help="which mnn variants: its per-pass code predictor (~9.4 GB resident: a session per "
                         "predictor input shape) and/or the unrolled one (~6.2 GB)")
    ap.add_argument("--mnn-quant", default="fp32", choices=["fp32", "int8"],
                    help="the peer's weights: fp32, or its own int8 (MNN's block-wise weight quantization; "
                         "benchmarks/export_mnn.py --quant); give each its own --mnn DIR")
    ap.add_argument("--mnn-memory", nargs="+", default=["normal"], choices=["normal", "low"],
                    help="the peer's MNN sessions as it creates them (normal) and/or with MNN's Memory_Low hint "
                         "(low: \"mnn ... lowmem\"; an int8 graph then computes on its int8 weights, see mnn_worker)")
    ap.add_argument("--mnn-python", default=str(REPO / ".venv-mnn" / "bin" / "python"))
    ap.add_argument("--json", default=None, help="write every turn's figures here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # variant name inside a worker
    ap.add_argument("--variant", default="ours", help=argparse.SUPPRESS)
    ap.add_argument("--body-tokens", type=int, default=20, help=argparse.SUPPRESS)
    ap.add_argument("--codec", action="store_true",
                    help="also time the codec decoder in every ours variant and report the whole path per frame")
    ap.add_argument("--codec-chunk", type=int, default=4, help="frames per streamed codec chunk (the served chunk)")
    ap.add_argument("--codec-bf16", action="store_true",
                    help="also each ours variant with its codec decoder in bfloat16 (with --codec)")
    ap.add_argument("--codec-dtype", default="float32", help=argparse.SUPPRESS)  # inside a worker
    args = ap.parse_args()
    if args.worker == "mnn":  # the peer's venv: no torch
        mnn_worker(args)
        return

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if args.worker:
        sys.path.insert(0, args.worker if args.worker != "official" else str(REPO))
        sys.path.insert(1, str(REPO / "benchmarks"))
        (official_worker if args.worker == "official" else ours_worker)(args)
        return
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

    # OpenMP threads that sleep when idle, as `streamvox` runs them (clients/cli.py): spinning ones take
    # the cores from ONNX Runtime's (the int8 / int4 kernels)
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1",
               OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    common = ["--size", args.size, "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads),
              "--batches", *map(str, args.batches)]
    if args.codec:
        common += ["--codec", "--codec-chunk", str(args.codec_chunk)]
    me = [sys.executable, str(Path(__file__).resolve())]
    specs = [] if args.no_fp32 and args.quantize else [("ours", me + ["--worker", str(REPO), "--variant", "ours"], REPO)]
    if args.step_graphs:  # on a CPU the same static-buffer step runs eagerly (the dry run checks it)
        specs.append(("ours+graphs", me + ["--worker", str(REPO), "--variant", "ours+graphs"], REPO))
    if args.compile_talker:
        specs.append(("ours+ctalk", me + ["--worker", str(REPO), "--variant", "ours+ctalk"], REPO))
    for mode in args.quantize:
        specs.append((f"ours {mode}", me + ["--worker", str(REPO), "--variant", "ours", "--quantize", mode], REPO))
        if args.ort_too and mode != "bf16":  # the same mode with its decode step on ONNX Runtime
            specs.append((f"ours {mode} ort", me + ["--worker", str(REPO), "--variant", "ours-ort", "--quantize", mode],
                          REPO))
    if args.codec and args.codec_bf16:
        for mode in args.quantize or [None]:
            q = ["--quantize", mode] if mode else []
            specs.append((f"ours {mode + ' ' if mode else ''}codec-bf16",
                          me + ["--worker", str(REPO), "--variant", "ours", *q, "--codec-dtype", "bfloat16"], REPO))
    old_tree = None
    if args.baseline_commit:
        old_tree = export_commit(args.baseline_commit)
        rev = subprocess.run(["git", "rev-parse", "--short", args.baseline_commit], cwd=REPO, capture_output=True,
                             text=True).stdout.strip()
        if not (args.no_fp32 and args.quantize):
            specs.append((f"ours@{rev}", me + ["--worker", str(old_tree), "--variant", "ours"], old_tree))
        for mode in args.quantize:  # the talker (and with --codec the whole path) before, in every mode
            specs.append((f"ours@{rev} {mode}", me + ["--worker", str(old_tree), "--variant", "ours",
                                                      "--quantize", mode], old_tree))
            if args.ort_too and mode != "bf16":
                specs.append((f"ours@{rev} {mode} ort", me + ["--worker", str(old_tree), "--variant", "ours-ort",
                                                              "--quantize", mode], old_tree))
    oracle = Path(args.oracle_python)
    if not args.no_official:
        if oracle.is_file():
            from testsupport.talker import make_tokenizer  # the body length of ours' prompt, for the same prompt

            body = len(make_tokenizer().encode(f"<|im_start|>assistant\n{TEXT}<|im_end|>\n<|im_start|>assistant\n")) - 8
            specs.append(("official", [str(oracle), str(Path(__file__).resolve()), "--worker", "official",
                                       "--body-tokens", str(body)], REPO, env,
                          set(args.official_batches or args.batches)))
        else:
            print("(no .venv-oracle: the official variant is skipped; build it with scripts/oracle-env.sh)")
    if args.mnn:
        specs += mnn_specs(args, env)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    print(f"talker bench: size={args.size} dtype={args.dtype} rounds={args.rounds} steps/turn={args.steps} "
          f"commit {head.strip()}{' (+ local changes)' if dirty else ''}")
    print(machine_line(device), flush=True)

    workers = []
    try:
        for name, cmd, cwd, *own in specs:  # built one after another: the loads do not overlap the rounds
            w = Worker(name, cmd + common, cwd, *(own or [env]))  # own: its env and batch sizes
            print(f"  {name}: {'ready' if w.alive else 'FAILED to start'}", flush=True)
            workers.append(w)
        turns = run_rounds(args, device, workers)
    finally:
        for w in workers:
            w.close()
    report(args, device, [w.name for w in workers], turns)
    if args.json:
        Path(args.json).write_text(json.dumps(turns, indent=1))


def run_rounds(args, device, workers: list[Worker]) -> list[dict]:
    """Every (batch, round, variant) turn, rotating the variants' order by one per round; the
    coordinator's own turn measures bandwidth and GEMM throughput."""
    import torch

    turns = []
    for b in args.batches:
        for r in range(args.rounds):
            players = [w for w in workers if w.batches is None or b in w.batches] + [None]
            k = r % len(players)
            for w in players[k:] + players[:k]:
                if w is None:
                    dtype = getattr(torch, args.dtype)
                    turns.append(dict(variant="machine", batch=b, round=r, bandwidth=read_bandwidth(device),
                                      cpu_bandwidth=getattr(read_bandwidth, "cpu", None),
                                      gemv=gemv_bandwidth(device, dtype), flops=gemm_flops(device, dtype)))
                    continue
                got = w.ask(b, args.steps)
                if got is not None:
                    turns.append(dict(variant=w.name, batch=b, round=r, **got))
                    codec = f", codec {got['codec_min_ms']:.1f} ms/frame" if "codec_min_ms" in got else ""
                    print(f"  batch {b} round {r} {w.name}: prefill {got['prefill_ms']:.1f} ms, decode step "
                          f"min {got['step_min_ms']:.1f} / median {got['step_med_ms']:.1f} ms{codec}", flush=True)
    return turns


def report(args, device, names: list[str], turns: list[dict]) -> None:
    machine = [t for t in turns if t["variant"] == "machine"]
    if not machine:
        return
    bw = max(t["bandwidth"] for t in machine)
    flops = max(t["flops"] for t in machine)
    gemv = max(t["gemv"] for t in machine)
    print(f"\nmachine: best read bandwidth {bw / 1e9:.1f} GB/s (median {statistics.median(t['bandwidth'] for t in machine) / 1e9:.1f}), "
          f"torch's fp32 GEMV {gemv / 1e9:.1f} GB/s of weights (a kernel's rate, for reference), best GEMM "
          f"{flops / 1e9:.1f} GFLOP/s ({args.dtype}, {args.threads or 'default'} threads); "
          f"load average now {os.getloadavg()[0]:.2f}")
    print("decode = one step of B rows (code predictor + talker step + sampling); min / median over rounds of each "
          "turn's median; ms/frame = min step / B; floor = max(bytes read / read bandwidth, 2 x B x weights / GEMM "
          "FLOP/s (fp32 variants only)); 'x floor' = a turn's step / the floor from the bandwidth measured in the "
          "same round (min / median over rounds); the GEMV rate is a kernel's, never a floor; with 1 thread, 'CPU x "
          "floor': the step's thread CPU time over the floor from the read's own thread CPU time in the same round "
          "(time on a core only: what a loaded machine's waits for a core leave out of both)")
    cols = (f"{'variant':>18} | {'B':>3} | {'prefill ms min / med':>21} | {'step ms min / med':>19} | "
            f"{'ms/frame':>9} | {'GB read':>7} | {'floor ms':>9} | {'x floor min / med':>17} | {'CPU ms/step':>11} | "
            f"{'CPU x floor min / med':>21}")
    print(cols)
    print("-" * len(cols))
    for b in args.batches:
        fp = next((t for t in turns if t["batch"] == b and t["variant"] == "ours"), None)
        for name in names:
            mine = [t for t in turns if t["variant"] == name and t["batch"] == b]
            if not mine:
                continue
            # the variant's own bytes (int8 / bf16 read fewer); the official reads what ours reads, the
            # mnn peer what ours in its mode reads (int8: blocks of 128 with a scale and a zero point)
            ref = mine[0] if "weight_bytes" in mine[0] else fp
            if name.startswith("mnn int8") and name.endswith("lowmem"):  # else MNN expanded its weights to fp32
                ref = next((t for t in turns if t["batch"] == b and t["variant"] == "ours int8"), None)
            pre = [t["prefill_ms"] for t in mine]
            step = [t["step_med_ms"] for t in mine]
            best = min(step)
            if ref:
                bytes_read = ref["weight_bytes"] + ref["kv_bytes"]
                # compute floor from the fp32 GEMM rate: not a bound for int8 / int4 kernels, left out there
                comp = 0.0 if "int8" in name or "int4" in name else 2 * b * ref["weight_elems"] / flops
                floor_ms = max(bytes_read / bw, comp) * 1e3
                ratios = [t["step_med_ms"] / (max(bytes_read / m["bandwidth"], comp) * 1e3) for t in mine
                          for m in machine if m["batch"] == b and m["round"] == t["round"]]
                fl = (f"{bytes_read / 1e9:7.3f} | {floor_ms:9.4g} | {min(ratios):7.2f} / {statistics.median(ratios):7.2f}"
                      if ratios else f"{bytes_read / 1e9:7.3f} | {floor_ms:9.4g} | {'-':>17}")
            else:
                fl = f"{'-':>7} | {'-':>9} | {'-':>17}"
            cpu = [t["step_cpu_ms"] for t in mine if "step_cpu_ms" in t]
            cpu_cell = f"{min(cpu):11.1f}" if cpu else f"{'-':>11}"
            cpu_ratios = [t["step_cpu_ms"] / (bytes_read / m["cpu_bandwidth"] * 1e3) for t in mine if ref and
                          "step_cpu_ms" in t and comp == 0.0 for m in machine
                          if m["batch"] == b and m["round"] == t["round"] and m.get("cpu_bandwidth")]
            cpu_fl = (f"{min(cpu_ratios):9.2f} / {statistics.median(cpu_ratios):9.2f}" if cpu_ratios else f"{'-':>21}")
            print(f"{name:>18} | {b:3d} | {min(pre):9.1f} / {statistics.median(pre):9.1f} | "
                  f"{best:8.1f} / {statistics.median(step):8.1f} | {best / b:9.2f} | {fl} | {cpu_cell} | {cpu_fl}")
    print("\nratios within a round (other / ours; > 1 = ours faster), min .. median .. max over rounds:")
    for b in args.batches:
        for name in names[1:]:
            # the peer in its own int8 also against ours int8 (the same format: its fairer comparison)
            # without the fp32 variant (--no-fp32) the first one is the anchor
            anchors = list(dict.fromkeys(["ours" if "ours" in names else names[0]] + (
                ["ours int8"] if name.startswith("mnn int8") and "ours int8" in names else [])))  # each once
            for anchor, (what, key) in itertools.product(anchors, (("decode", "step_med_ms"), ("dec CPU", "step_cpu_ms"),
                                                                   ("prefill", "prefill_ms"))):
                rs = []
                for r in range(args.rounds):
                    a = next((t for t in turns if t["variant"] == anchor and t["batch"] == b and t["round"] == r), None)
                    o = next((t for t in turns if t["variant"] == name and t["batch"] == b and t["round"] == r), None)
                    if a and o and key in a and key in o:
                        rs.append(o[key] / a[key])
                if rs:
                    print(f"  B={b:3d} {what:>7} {name:>14} / {anchor}: {min(rs):.2f} .. {statistics.median(rs):.2f} .. "
                          f"{max(rs):.2f}")
    if args.codec:
        report_whole_path(args, names, turns, flops, bw)


def report_whole_path(args, names: list[str], turns: list[dict], flops: float, bw: float) -> None:
    """Talker + codec decoder per frame of audio, next to their floors; codec agreement and ratios."""
    import torch

    frame_ms = 80.0  # 1920 samples at 24 kHz
    print(f"\nwhole path per frame (talker step / B + codec decoder in chunks of {args.codec_chunk} frames), "
          f"min / median over rounds; RTF = total / {frame_ms:.0f} ms; floors: talker bytes / read bandwidth / B, codec "
          f"multiply-adds / best GEMM ({flops / 1e9:.1f} GFLOP/s, fp32)")
    cols = (f"{'variant':>24} | {'B':>3} | {'talker ms':>15} | {'codec ms':>15} | {'codec CPU':>9} | "
            f"{'total ms':>15} | {'RTF':>11} | {'floor t / c / total':>21} | {'floor RTF':>9}")
    print(cols)
    print("-" * len(cols))
    for b in args.batches:
        for name in names:
            mine = [t for t in turns if t["variant"] == name and t["batch"] == b and "codec_min_ms" in t]
            if not mine:
                continue
            talk = [t["step_med_ms"] / b for t in mine]
            cod = [t["codec_med_ms"] for t in mine]
            tot = [t["step_med_ms"] / b + t["codec_med_ms"] for t in mine]  # same turn: same load
            cpu = [t["codec_cpu_ms"] for t in mine if "codec_cpu_ms" in t]
            ref = mine[0]
            talker_floor = (ref["weight_bytes"] + ref["kv_bytes"]) / bw * 1e3 / b
            codec_floor = ref["codec_flops"] / flops * 1e3
            floor = talker_floor + codec_floor
            cpu_cell = f"{min(cpu):9.1f}" if cpu else f"{'-':>9}"
            print(f"{name:>24} | {b:3d} | {min(talk):6.1f} / {statistics.median(talk):6.1f} | "
                  f"{min(cod):6.1f} / {statistics.median(cod):6.1f} | {cpu_cell} | "
                  f"{min(tot):6.1f} / {statistics.median(tot):6.1f} | {min(tot) / frame_ms:4.2f} / "
                  f"{statistics.median(tot) / frame_ms:4.2f} | "
                  f"{talker_floor:6.1f} / {codec_floor:5.1f} / {floor:6.1f} | "
                  f"{floor / frame_ms:9.2f}")
    first = next((t for t in turns if t["variant"] == names[0] and "codec_wave" in t), None)
    if first is not None:
        ref_wave = torch.tensor(first["codec_wave"], dtype=torch.float64)
        print(f"\ncodec agreement with {names[0]} ({AGREE_FRAMES} frames of the same codes, chunks of "
              f"{args.codec_chunk}; RMS {ref_wave.pow(2).mean().sqrt():.3f}):")
        for name in names[1:]:
            other = next((t for t in turns if t["variant"] == name and "codec_wave" in t), None)
            if other is None:
                continue
            w = torch.tensor(other["codec_wave"], dtype=torch.float64)
            err = (w - ref_wave).abs().max().item()
            noise = (w - ref_wave).pow(2).sum().item()
            snr = "exact" if noise == 0 else f"{10 * math.log10(ref_wave.pow(2).sum().item() / noise):.1f} dB"
            print(f"  {name:>24}: max abs error {err:.2e}, SNR {snr}")
    print("codec ratios within a round (ms per frame, a variant / the same mode in this tree, or / the first "
          "variant; < 1 = faster), min .. median .. max:")
    for b in args.batches:
        for name in names[1:]:
            # "ours@REV int8" and "ours int8 codec-bf16" against "ours int8": only the codec differs
            base = " ".join(w.split("@")[0] for w in name.split() if w != "codec-bf16")
            base = base if base in names and base != name else names[0]
            rs = []
            for r in range(args.rounds):
                a = next((t for t in turns if t["variant"] == base and t["batch"] == b and t["round"] == r), None)
                o = next((t for t in turns if t["variant"] == name and t["batch"] == b and t["round"] == r), None)
                if a and o and "codec_med_ms" in a and "codec_med_ms" in o:
                    rs.append(o["codec_med_ms"] / a["codec_med_ms"])
            if rs:
                print(f"  B={b:3d} {name:>24} / {base}: {min(rs):.2f} .. {statistics.median(rs):.2f} .. {max(rs):.2f}")


if __name__ == "__main__":
    main()
