"""Time the OFFICIAL code predictor ``generate()`` (the baseline row of
benchmarks/bench_code_predictor.py). Runs inside .venv-oracle:

    .venv-oracle/bin/python tests/oracle/bench_generate.py \
        --config '{"vocab_size": 2048, "hidden_size": 1024, ..., "talker_hidden_size": 1024}' \
        --batches 1 8 64 --device cpu --dtype float32 --min-seconds 1

``--config`` takes the fields of streamvox's CodePredictorConfig (as JSON). Greedy
decoding, random weights (timing does not depend on their values), a fresh cache
per frame exactly as the official talker calls it. Prints one JSON object per batch:
{"variant": "official generate()", "batch": B, "ms_per_call": ..., "ms_per_frame": ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import official  # noqa: E402
from qwen_tts.core.models.modeling_qwen3_tts import (  # noqa: E402
    Qwen3TTSTalkerCodePredictorModelForConditionalGeneration,
)


def build(cfg: dict, device: torch.device, dtype: torch.dtype):
    predictor_cfg = official.Qwen3TTSTalkerCodePredictorConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=cfg.get("rope_theta", 1e6),
        num_code_groups=cfg["num_code_groups"], max_position_embeddings=64)
    talker_cfg = official.Qwen3TTSTalkerConfig(
        code_predictor_config=predictor_cfg.to_dict(), hidden_size=cfg["talker_hidden_size"],
        num_code_groups=cfg["num_code_groups"], num_hidden_layers=1)
    sub = talker_cfg.code_predictor_config
    sub._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen3TTSTalkerCodePredictorModelForConditionalGeneration(config=sub, talker_config=talker_cfg)
    return model.to(dtype).eval()


def time_ms(fn, device: torch.device, min_seconds: float, max_reps: int = 200) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn(), fn()
    sync()
    samples, start = [], time.perf_counter()
    while len(samples) < 3 or (time.perf_counter() - start < min_seconds and len(samples) < max_reps):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="CodePredictorConfig fields as JSON")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--min-seconds", type=float, default=1.0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = json.loads(args.config)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build(cfg, device, dtype)
    steps = cfg["num_code_groups"] - 1
    for batch in args.batches:
        inputs = torch.randn(batch, 2, cfg["talker_hidden_size"], device=device, dtype=dtype)

        @torch.inference_mode()
        def run():
            return model.generate(inputs_embeds=inputs, max_new_tokens=steps, do_sample=False,
                                  return_dict_in_generate=True)

        ms = time_ms(run, device, args.min_seconds)
        print(json.dumps({"variant": "official generate()", "batch": batch, "ms_per_call": round(ms, 4),
                          "ms_per_frame": round(ms / batch, 4)}), flush=True)


if __name__ == "__main__":
    main()
