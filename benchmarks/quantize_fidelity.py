"""Fidelity of every talker precision against fp32, teacher-forced over the official code's
own greedy codes: the numbers the CPU default is chosen by (docs/QUANTIZATION.md).

    python benchmarks/quantize_fidelity.py                                   # oracle fixtures
    python benchmarks/quantize_fidelity.py --checkpoint DIR OFFICIAL.json    # + a released-size one
    # DIR: .venv-oracle/bin/python benchmarks/make_checkpoint.py --size 0.6b DIR
    # OFFICIAL.json: .venv-oracle/bin/python benchmarks/official_codes.py DIR OFFICIAL.json

Checkpoints: the talker oracle fixtures (tiny random CustomVoice checkpoints in the official
layout, their cases and the official ``generate()``'s greedy codes) and, with ``--checkpoint``,
random checkpoints at the released sizes with the official codes ``official_codes.py`` wrote.
Per mode (fp32, bf16 = the whole talker in bfloat16, int8, int4 and int8-int4p =
engines/models/quantize*.py), one utterance at a time, the talker is fed the OFFICIAL frames
(teacher forcing: every mode sees the same history, so one flipped choice does not make the
rest of the utterance another utterance) and at every step we keep
* code 0's distribution after the official logits processors (repetition penalty over the
  teacher's code-0 ids so far, min_new_tokens, [V-1024, V) suppressed but EOS): its top-1,
  and the mode's own frame: that code 0 with the code predictor's greedy codes 1..G-1;
Reported against fp32: **top-1 agreement** of code 0 (share of steps), **KL(fp32 || mode)** of
the code-0 distribution (nats, mean over steps), **TV**: the total-variation distance of the
distribution code 0 is served from (the checkpoint's temperature and top-k; mean over steps:
the share of sampled codes that differ however the draws are coupled), **codes equal** (all G codes of the mode's own
frames) and the **waveform SNR**: the mode's own frames and fp32's through the checkpoint's
codec decoder (fp32), 10 log10(|w_fp32|^2 / |w_mode - w_fp32|^2) in dB over the utterance.
Beside them, how often fp32's top-1 is the official code 0 (100 % where our fp32 talker
reproduces the official one; the parity tests assert that on the fixtures).

The code predictor (codes 1..G-1) is judged the same way, teacher-forced inside the frame too: at
each step, from the mode's talker hidden state, the predictor is fed the OFFICIAL frame's code 0
and its codes 1..i-1 (``CodePredictor.predict(..., forced=)``) and code i's logits are kept.
Reported per group against fp32, then as the mean over groups and the worst group: **top-1
agreement** and the **TV** of the distribution code i is served from (``subtalker_temperature``,
``subtalker_top_k``); and how often fp32's top-1 is the official code i.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engines.checkpoints.qwen3_tts import load_checkpoint  # noqa: E402
from engines.models.quantize import quantize_talker  # noqa: E402
from engines.models.sampling import FrameSampling, apply_talker_processors  # noqa: E402
from engines.pipelines.talker.reference import TalkerBundle, frame_embedding, prompt_tensors  # noqa: E402

MODES = ("fp32", "bf16", "int8", "int4", "int8-int4p")


def load_bundle(directory: Path, mode: str) -> TalkerBundle:
    bundle = TalkerBundle.from_checkpoint(directory, "cpu", torch.bfloat16 if mode == "bf16" else torch.float32)
    if mode not in ("fp32", "bf16"):
        quantize_talker(bundle.talker, bundle.predictor, mode)
    return bundle


@torch.no_grad()
def teacher_forced(bundle: TalkerBundle, case: dict, teacher: torch.Tensor) -> dict:
    """Feed ``teacher`` [T, G] (the official frames) -> code-0 scores [T, V] (float64 logits after the
    official processors, -inf where suppressed), the mode's own frames [T, G] (its code 0, its
    predictor's greedy codes), and the predictor's logits for codes 1..G-1 [T, G-1, V'] given the
    official frame's code 0 and earlier groups (teacher-forced inside the frame too)."""
    talker, predictor, gen = bundle.talker, bundle.predictor, bundle.generation
    device, dtype = talker.codec_head.weight.device, talker.codec_head.weight.dtype
    cfg = talker.cfg
    prompt = bundle.prompt.build(case["text"], case["speaker"], case["language"], case["non_streaming_mode"],
                                 instruct=case.get("instruct"))
    x, trailing, pad = prompt_tensors(talker, prompt, device)
    s, steps = x.shape[0], teacher.shape[0]
    cache = talker.new_cache(1, s + steps + 1, device, dtype)
    suppressed = torch.ones(cfg.vocab_size, dtype=torch.bool)
    suppressed[talker.valid_ids] = False
    h = talker(x[None], torch.arange(s)[None], cache, attend_len=s)
    logps, own, groups = [], [], []
    for step in range(steps):
        scores = talker.logits(h).float()
        seen = torch.zeros_like(scores, dtype=torch.bool)
        seen[0, teacher[:step, 0]] = True
        scores = apply_talker_processors(scores, seen, gen.repetition_penalty, cfg.codec_eos_token_id,
                                         torch.tensor([step < gen.min_new_tokens]))
        scores = scores.masked_fill(suppressed, float("-inf")).double()[0]
        code0 = scores.argmax()[None]
        sub = FrameSampling.for_stream(1, 0, step, device, greedy=True)
        rest = predictor.predict(h, talker.codec_part(code0), sub)
        groups.append(predictor.predict(h, talker.codec_part(teacher[step, :1]), sub, return_logits=True,
                                        forced=teacher[step, 1:][None])[1][0].double())
        logps.append(scores)
        own.append(torch.cat([code0, rest[0]]))
        text_part = trailing[step] if step < trailing.shape[0] else pad
        nxt = frame_embedding(talker, predictor, teacher[step][None]) + text_part
        h = talker(nxt[:, None].to(dtype), torch.tensor([[s + step]]), cache, attend_len=s + step + 1)
    return {"scores": torch.stack(logps), "own": torch.stack(own), "groups": torch.stack(groups)}


def kl(p_scores: torch.Tensor, q_scores: torch.Tensor) -> float:
    """Mean over steps of KL(p || q) of the softmax of the scores, nats (p = 0 terms are 0)."""
    p_log, q_log = torch.log_softmax(p_scores, -1), torch.log_softmax(q_scores, -1)
    p = p_log.exp()
    terms = torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p))
    return terms.sum(-1).mean().item()


def served(scores: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The distribution served code 0 is sampled from: scores / temperature, the top_k kept."""
    x = scores / temperature
    kth = x.topk(top_k, dim=-1).values[..., -1:]
    return torch.softmax(x.masked_fill(x < kth, float("-inf")), dim=-1)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    """Mean over steps of TV(p, q) = 1/2 sum |p - q|: the share of sampled codes that must differ
    between the two however the draws are coupled."""
    return 0.5 * (p - q).abs().sum(-1).mean().item()


def snr_db(ref: torch.Tensor, other: torch.Tensor) -> float:
    noise = (other - ref).pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * torch.log10(ref.pow(2).sum() / noise).item()


def decodable(frames: torch.Tensor, codebook: int) -> torch.Tensor:
    """A frame whose code 0 is a special id (EOS chosen mid-utterance) decodes as code 0 = 0."""
    return frames.masked_fill(frames >= codebook, 0)


def checkpoints(args) -> list[tuple[str, Path, list[dict]]]:
    """(name, directory, cases with their official codes)."""
    out = []
    if not args.no_fixtures:
        from tests.oracle import talker_fixtures as fx

        for name in fx.CHECKPOINTS:
            refs = fx.references(name)
            cases = [dict(text=c["prompt"], speaker=c["speaker"], language=c["language"],
                          non_streaming_mode=c["non_streaming_mode"], instruct=c["instruct"], name=case,
                          codes=refs[f"case/{case}/codes"]) for case, c in fx.cases(name).items()]
            out.append((name, fx.checkpoint_dir(name), [c for c in cases if c["codes"].shape[0]]))
    for directory, official in args.checkpoint or []:
        data = json.loads(Path(official).read_text())
        cases = [dict(c, name=f"case {i}", codes=torch.tensor(c["codes"], dtype=torch.long))
                 for i, c in enumerate(data["cases"])]
        out.append((Path(directory).name, Path(directory), cases))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", nargs=2, action="append", metavar=("DIR", "OFFICIAL_JSON"),
                    help="a CustomVoice checkpoint and official_codes.py's output for it (repeatable)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--no-fixtures", action="store_true", help="skip the oracle fixtures")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write every row here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = ["fp32"] + [m for m in args.modes if m != "fp32"]
    rows, groups, sampling, sampling_sub = [], [], {}, {}
    for name, directory, cases in checkpoints(args):
        t0 = time.time()
        parts = load_checkpoint(directory)
        codebook = parts.decoder.cfg.codebook_size
        runs = {}
        for mode in modes:
            bundle = load_bundle(directory, mode)
            sampling[name] = (bundle.generation.temperature, bundle.generation.top_k)
            sampling_sub[name] = (bundle.generation.subtalker_temperature, bundle.generation.subtalker_top_k)
            runs[mode] = [teacher_forced(bundle, c, c["codes"]) for c in cases]
            del bundle
            gc.collect()
        with torch.no_grad():
            wavs = {m: [parts.decode(decodable(r["own"], codebook).T[None])[0] for r in runs[m]] for m in modes}
        official_top1 = statistics.mean((r["scores"].argmax(-1) == c["codes"][:, 0]).double().mean().item()
                                        for r, c in zip(runs["fp32"], cases))
        temperature, top_k = sampling[name]
        for mode in modes:
            ref, got = runs["fp32"], runs[mode]
            agree = [(a["scores"].argmax(-1) == b["scores"].argmax(-1)).double().mean().item() for a, b in zip(ref, got)]
            steps = sum(r["scores"].shape[0] for r in ref)
            rows.append(dict(
                checkpoint=name, mode=mode, utterances=len(cases), steps=steps,
                top1=sum(a * r["scores"].shape[0] for a, r in zip(agree, ref)) / steps,
                kl=statistics.mean(kl(a["scores"], b["scores"]) for a, b in zip(ref, got)),
                tv=statistics.mean(total_variation(served(a["scores"], temperature, top_k),
                                                   served(b["scores"], temperature, top_k)) for a, b in zip(ref, got)),
                codes_equal=sum((a["own"] == b["own"]).double().sum().item() for a, b in zip(ref, got)) /
                sum(a["own"].numel() for a in ref),
                snr_db=statistics.median(snr_db(a, b) for a, b in zip(wavs["fp32"], wavs[mode])),
                snr_min_db=min(snr_db(a, b) for a, b in zip(wavs["fp32"], wavs[mode])),
                fp32_vs_official=official_top1))
        sub_temperature, sub_top_k = sampling_sub[name]
        for mode in modes:  # codes 1..G-1, per group, teacher-forced
            ref, got = (torch.cat([r["groups"] for r in runs[m]]) for m in ("fp32", mode))  # [steps, G-1, V]
            official = torch.cat([c["codes"][:, 1:] for c in cases])
            top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean(0)  # [G-1]
            tv = 0.5 * (served(ref, sub_temperature, sub_top_k) - served(got, sub_temperature, sub_top_k)).abs().sum(-1).mean(0)
            groups.append(dict(checkpoint=name, mode=mode, steps=ref.shape[0], top1=top1.mean().item(),
                               top1_worst=top1.min().item(), tv=tv.mean().item(), tv_worst=tv.max().item(),
                               top1_per_group=top1.tolist(), tv_per_group=tv.tolist(),
                               fp32_vs_official=(ref.argmax(-1) == official).double().mean().item()))
        print(f"quantize_fidelity: {name} ({len(cases)} utterances, {modes}) in {time.time() - t0:.0f} s",
              file=sys.stderr, flush=True)
    print("| checkpoint | mode | utterances / steps | code-0 top-1 = fp32 | KL(fp32 ‖ mode) nats | "
          "TV, served sampling | codes equal (all G) | waveform SNR dB, median (min) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        snr = "exact" if r["snr_db"] == float("inf") else f"{r['snr_db']:.1f} ({r['snr_min_db']:.1f})"
        print(f"| {r['checkpoint']} | {r['mode']} | {r['utterances']} / {r['steps']} | {r['top1']:.1%} | "
              f"{r['kl']:.2e} | {r['tv']:.2%} | {r['codes_equal']:.1%} | {snr} |")
    print("\nfp32 code-0 top-1 = the official code 0: " + ", ".join(
        f"{r['checkpoint']} {r['fp32_vs_official']:.1%}" for r in rows if r["mode"] == "fp32"))
    print("\nCode predictor, teacher-forced (official code 0 and earlier groups), codes 1..G-1:\n")
    print("| checkpoint | mode | steps | top-1 = fp32, mean over groups (worst group) | "
          "TV, served sampling, mean over groups (worst group) |")
    print("|---|---|---|---|---|")
    for r in groups:
        print(f"| {r['checkpoint']} | {r['mode']} | {r['steps']} | {r['top1']:.1%} ({r['top1_worst']:.1%}) | "
              f"{r['tv']:.2%} ({r['tv_worst']:.2%}) |")
    print("\nfp32 codes 1..G-1 top-1 = the official codes: " + ", ".join(
        f"{r['checkpoint']} {r['fp32_vs_official']:.1%}" for r in groups if r["mode"] == "fp32"))
    if args.json:
        Path(args.json).write_text(json.dumps({"code0": rows, "codes_1_to_G": groups}, indent=1))


if __name__ == "__main__":
    main()
