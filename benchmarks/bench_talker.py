"""Talker source: ms per talker step and per frame at batch 1/8/64 (ours), next to the
official ``generate()`` when the oracle venv (.venv-oracle) is present.

    python benchmarks/bench_talker.py [--size small] [--device auto] [--batches 1 8 32] [--no-official]
    python benchmarks/bench_talker.py --size 0.6b --device cuda --dtype bfloat16 --batches 1 8 64 256 \
        --official-batches 1 8 64 --oracle-python /tmp/oracle-python

Random weights at the chosen sizes (timing does not depend on their values).
* ours, "talker step": one batched talker forward (decode, query length 1) at B rows over the
  paged KV cache (engines/models/paged_kv.py); "KV MiB used": the pool blocks the rows hold;
* ours, "tick": TalkerSource.tick() = code predictor for B frames + talker step + code-0
  sampling, in steady state (finished utterances are replaced at once, so the batch stays
  full: continuous batching; a replacement's chunked prefill runs inside the next tick, as
  served); ms per frame = tick / frames emitted;
* official: ``Qwen3TTSForConditionalGeneration.generate`` (HF generate, dynamic cache) on
  B utterances, greedy, EOS made unreachable so it runs exactly N steps; decode only:
  ms per step = (wall of N steps - wall of 2 steps) / (N - 2), so its prefill is left out as
  ours is; ms per frame = that / B. Runs in .venv-oracle as a subprocess (this script, --official-worker);
* floor (CUDA): the weights one frame must read (talker layers + final norm + the valid
  codec-head rows, then G-1 code-predictor steps of its layers, norm, projection and one
  lm_head) / the measured device copy bandwidth, per frame = that / batch (KV reads and
  activations ignored, so it is a lower bound while weight-bound).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

SIZES = {  # talker hidden/layers/heads/kv/head_dim, predictor hidden/layers, G, codebook, text hidden
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, predictor_hidden=64, predictor_layers=2,
                 groups=4, codebook=64, text_hidden=64),
    "small": dict(hidden=256, layers=6, heads=8, kv_heads=4, head_dim=32, predictor_hidden=256, predictor_layers=3,
                  groups=8, codebook=256, text_hidden=256),
    # The released talker sizes (REFERENCES.md; text vocabulary kept small: it does not enter a step).
    "0.6b": dict(hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8, head_dim=128,
                 predictor_hidden=1024, predictor_intermediate=3072, predictor_layers=5, predictor_heads=16,
                 predictor_kv_heads=8, groups=16, codebook=2048, text_hidden=2048),
    "1.7b": dict(hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8, head_dim=128,
                 predictor_hidden=1024, predictor_intermediate=3072, predictor_layers=5, predictor_heads=16,
                 predictor_kv_heads=8, groups=16, codebook=2048, text_hidden=2048),
}
TEXT = "Streaming speech from the talker, one frame at a time, for every utterance in the batch."


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def frame_weight_bytes(talker, predictor) -> int:
    """Weight bytes one frame reads: the talker step, then G-1 code-predictor steps."""
    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    head_row = talker.codec_head.weight[0].numel() * talker.codec_head.weight.element_size()
    talker_bytes = size(talker.model.layers) + size(talker.model.norm) + talker.valid_ids.numel() * head_row
    p = predictor
    step = size(p.model.layers) + size(p.model.norm) + size(p.small_to_mtp_projection) + size(p.lm_head[0])
    return talker_bytes + (talker.cfg.num_code_groups - 1) * step


def ours(size: str, device: torch.device, dtype: torch.dtype, batches: list[int], ticks: int,
         graphed: bool = True, step_graphs: bool = False, compile_talker: bool = False) -> tuple[list[dict], float | None]:
    """``step_graphs``: the whole decode step per static bucket (engines/runtime/graphed_talker.py,
    captured on first use: the warm-up ticks) instead of the code predictor's graphs.
    ``compile_talker``: the talker's layers through torch.compile too (STREAMVOX_COMPILE_TALKER=1)."""
    from engines.contract import SynthesisRequest
    from engines.pipelines.talker.source import TalkerSource
    from service.settings import runtime_switches
    from tests.talker_helpers import make_bundle

    compile_backend = runtime_switches().compile_backend  # the engine's switches (STREAMVOX_COMPILE=0: none)

    bundle = make_bundle(seed=0, max_new_tokens=10_000, eos_gain=1.0, device=device, dtype=dtype, **SIZES[size])
    if compile_talker and compile_backend("predictor"):  # the same switch as the engine's (STREAMVOX_COMPILE)
        bundle.talker.compile_layers(compile_backend("predictor"))
    floor_ms = None
    if device.type == "cuda":
        from bench_code_predictor import copy_bandwidth

        floor_ms = frame_weight_bytes(bundle.talker, bundle.predictor) / copy_bandwidth(device) * 1e3
    rows = []
    predictor = bundle.predictor
    if device.type == "cuda" and graphed and not step_graphs:  # as the engine runs it (engines/core/engine.py)
        from engines.runtime.graphed_predictor import (
            DEFAULT_BUCKETS,
            GraphedCodePredictor,
        )

        predictor = GraphedCodePredictor(bundle.predictor, buckets=tuple(
            b for b in DEFAULT_BUCKETS if b < max(batches)) + (max(batches),),
            compile_backend=compile_backend("predictor"))
        predictor.capture_all()
    for b in batches:
        # The paged pool holds every row at 256 positions (prompt + 200 frames) with room to spare.
        source = TalkerSource.from_bundle(bundle, max_slots=b, max_seq_len=256, kv_cache_gb=1024.0)
        source.predictor = predictor
        if step_graphs:
            from engines.runtime.graphed_talker import GraphedTalkerStep

            source.step_runner = GraphedTalkerStep(source, compile_backend=compile_backend("predictor"))
        serial = 0

        def fill():
            nonlocal serial
            while source.free_slots():
                source.admit(SynthesisRequest(id=f"u{serial}", text=TEXT, voice="Ryan", temperature=0),
                             max_new_tokens=200)
                serial += 1

        fill()
        for _ in range(3 if not step_graphs else 12):  # warm-up (step graphs: captures of the first block buckets)
            source.tick()
            fill()
        sync(device)
        frames, spent = 0, 0.0
        for _ in range(ticks):
            t0 = time.perf_counter()
            out = source.tick()
            sync(device)
            spent += time.perf_counter() - t0
            frames += sum(f.codes.shape[0] for f in out)
            fill()  # a replacement's prefill runs in the next tick (chunked, beside the decode step)
        # The talker step alone, at B rows, over the source's own paged cache.
        t = bundle.talker
        x = torch.randn(b, 1, t.cfg.hidden_size, device=device, dtype=dtype)
        rows_idx = torch.arange(b, device=device)
        pos = source.state.pos[:b, None].clone()
        n_blocks = max(source.cache.row_blocks(r) for r in range(b))
        with torch.no_grad():
            for _ in range(2):
                t.forward_paged(x, pos, source.cache, rows_idx, n_blocks, source.rope)
            sync(device)
            t0 = time.perf_counter()
            reps = max(3, ticks // 2)
            for _ in range(reps):
                t.forward_paged(x, pos, source.cache, rows_idx, n_blocks, source.rope)
            sync(device)
            step_ms = (time.perf_counter() - t0) * 1e3 / reps
        variant = ("graphs+ctalk" if compile_talker else "step graphs") if step_graphs else "eager step"
        rows.append(dict(variant=variant, batch=b, talker_step_ms=step_ms, tick_ms=spent * 1e3 / ticks,
                         frame_ms=spent * 1e3 / max(frames, 1), frames=frames,
                         kv_mib=source.cache.used_blocks * source.cache.memory_bytes() / source.cache.num_blocks / 2**20))
    return rows, floor_ms


def official_worker(size: str, device: str, dtype: str, batches: list[int], steps: int) -> None:
    """Inside .venv-oracle: time the official generate(); prints one JSON line."""
    sys.path.insert(0, str(REPO / "tests" / "oracle"))
    import official  # noqa: F401  (stubs, version pin)

    s = SIZES[size]
    cb = s["codebook"]
    special = cb
    talker = dict(
        code_predictor_config=dict(vocab_size=cb, hidden_size=s["predictor_hidden"],
                                   intermediate_size=s.get("predictor_intermediate", 2 * s["predictor_hidden"]),
                                   num_hidden_layers=s["predictor_layers"],
                                   num_attention_heads=s.get("predictor_heads", 4),
                                   num_key_value_heads=s.get("predictor_kv_heads", 2),
                                   head_dim=s["predictor_hidden"] // s.get("predictor_heads", 4),
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
    dev = torch.device(device)
    model = official.Qwen3TTSForConditionalGeneration(cfg).eval().to(dev, getattr(torch, dtype))
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        ids = [torch.cat([torch.tensor([[500, 10, 11]]), torch.randint(20, 400, (1, 20), generator=g),
                          torch.tensor([[501, 12, 500, 10, 11]])], dim=1).to(dev) for _ in range(b)]

        def run(n):
            model.generate(input_ids=ids, languages=["English"] * b, speakers=["ryan"] * b, non_streaming_mode=True,
                           max_new_tokens=n, do_sample=False, subtalker_dosample=False,
                           eos_token_id=special + 100)  # codec_pad: suppressed, so never generated

        def timed(n):
            sync(dev)
            t0 = time.perf_counter()
            run(n)
            sync(dev)
            return time.perf_counter() - t0

        run(3)
        # Decode only: the same prompt run for 2 and for `steps` new tokens; the difference
        # leaves the prefill (and the first step) out, as our tick figures do.
        short, long = timed(2), timed(steps)
        step_ms = max(long - short, 0.0) * 1e3 / (steps - 2)
        rows.append(dict(batch=b, step_ms=step_ms, frame_ms=step_ms / b, prefill_ms=max(short * 1e3 - step_ms, 0.0)))
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--official-batches", type=int, nargs="+", default=None,
                    help="batches for the official baseline (default: --batches; it is slow at large ones)")
    ap.add_argument("--eager-predictor", action="store_true", help="CUDA: skip the code predictor's graphs")
    # both variants compile the code predictor's layers as the engine does (STREAMVOX_COMPILE=0: not)
    ap.add_argument("--step-graphs", action="store_true",
                    help="CUDA: also time the whole decode step replayed as one graph per bucket (same run)")
    ap.add_argument("--compile-talker", action="store_true",
                    help="also time the step graphs with the talker's layers compiled (STREAMVOX_COMPILE_TALKER=1)")
    ap.add_argument("--ticks", type=int, default=20, help="timed ticks per batch size")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    ap.add_argument("--no-official", action="store_true", help="skip the .venv-oracle baseline")
    ap.add_argument("--oracle-python", default=str(REPO / ".venv-oracle" / "bin" / "python"),
                    help="python with qwen-tts for the official baseline (default: .venv-oracle)")
    ap.add_argument("--official-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.official_worker:
        with torch.no_grad():
            official_worker(args.size, str(device), args.dtype, args.batches, args.ticks + 1)
        return

    print(f"talker bench: size={args.size} device={device} dtype={args.dtype} threads={torch.get_num_threads()}")
    mine, floor_ms = ours(args.size, device, getattr(torch, args.dtype), args.batches, args.ticks,
                          graphed=not args.eager_predictor)
    for wanted, compile_talker in ((args.step_graphs, False), (args.compile_talker, True)):
        if not wanted:
            continue
        try:
            mine += ours(args.size, device, getattr(torch, args.dtype), args.batches, args.ticks, step_graphs=True,
                         compile_talker=compile_talker)[0]
        except Exception:  # the other rows still print
            traceback.print_exc()
            print(f"step graphs{' with the talker compiled' if compile_talker else ''} failed (traceback above)")
    theirs: dict[int, dict] = {}
    oracle = Path(args.oracle_python)
    if not args.no_official and oracle.is_file():
        cmd = [str(oracle), __file__, "--official-worker", "--size", args.size, "--device", str(device),
               "--dtype", args.dtype, "--ticks", str(args.ticks),
               "--batches", *map(str, args.official_batches or args.batches)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        if res.returncode == 0:
            theirs = {r["batch"]: r for r in json.loads(res.stdout.strip().splitlines()[-1])}
        else:
            print("official baseline failed:\n" + res.stderr[-2000:])
    elif not args.no_official:
        print("(no .venv-oracle: official baseline skipped; build it with scripts/oracle-env.sh)")
    if floor_ms is not None:
        print(f"memory floor: one frame's weights / measured copy bandwidth = {floor_ms:.3f} ms at batch 1")
    print(f"{'variant':>12} | {'batch':>5} | {'talker step ms':>14} | {'tick ms':>8} | {'ms/frame':>8} | {'KV MiB used':>11} | "
          f"{'floor ms/frame':>14} | {'x floor':>7} || {'official step ms':>16} | {'official ms/frame':>17} | "
          f"{'official/ours':>13}")
    for r in mine:
        o = theirs.get(r["batch"])
        off = (f"{o['step_ms']:16.2f} | {o['frame_ms']:17.2f} | {o['frame_ms'] / r['frame_ms']:13.2f}" if o
               else f"{'-':>16} | {'-':>17} | {'-':>13}")
        floor = f"{floor_ms / r['batch']:14.4f} | {r['frame_ms'] / (floor_ms / r['batch']):7.1f}" if floor_ms else (
            f"{'n/a':>14} | {'n/a':>7}")
        print(f"{r['variant']:>12} | {r['batch']:5d} | {r['talker_step_ms']:14.2f} | {r['tick_ms']:8.2f} | {r['frame_ms']:8.2f} | "
              f"{r['kv_mib']:11.1f} | {floor} || {off}")
    skipped = sorted(set(args.batches) - set(theirs)) if theirs else []
    if skipped:
        print(f"(official baseline not run at batch {', '.join(map(str, skipped))}: --official-batches)")


if __name__ == "__main__":
    main()
