"""Export bench_talker's random talker as a ``qwen3-tts-mnn`` model directory, so that peer runs
OUR weights at the same sizes (``bench_talker.py --mnn`` times it beside ours).

    scripts/mnn-env.sh                                   # once: .venv-mnn with qwen3-tts-mnn 0.3.1 + MNN
    python benchmarks/export_mnn.py --size 0.6b /tmp/mnn-0.6b            # ~3 min, 1.9 GB ONNX on the way
    python benchmarks/export_mnn.py --size 0.6b /tmp/mnn-0.6b --check 8  # + greedy codes vs ours, both layouts
    python benchmarks/export_mnn.py --size 0.6b /tmp/mnn-0.6b-int8 --quant int8 --check 8  # its own int8

The weights are ``testsupport.talker.make_bundle(seed=0, **bench_talker.SIZES[size])``, the
talker bench_talker's "ours" variants time. What the peer's pure-pymnn path (the only one on
Linux: its native extension is a macOS arm64 build) loads, read from its engine.py / weights.py:

* ``talker_step.mnn`` / ``cp_step.mnn``: one graph per model for prefill and decode,
  ``inputs_embeds [1, L, D]`` f32, ``position_ids [1, L]`` int32, ``past_kv [2 x layers, 1, 8, T, 128]``
  f32 -> ``last_hidden [1, L, D]`` (after the final norm: the peer applies the heads itself in
  numpy) and ``new_kv [2 x layers, 1, 8, T + L, 128]``. Built here from our own layer modules
  (``DecoderLayer.qkv`` / ``after_attention``, attention written out), exported to ONNX,
  converted by MNN's converter (fp32 weights: no ``--fp16`` / ``--weightQuantBits``; ``--quant int8``:
  MNN's own weight quantization, ``--weightQuantBits 8 --weightQuantBlock 128
  --weightQuantAsymmetric``, blocks of 128 weights with a scale and a zero point like ours; MNN's CPU
  backend computes on them only in a session with its Memory_Low hint, else it expands them to fp32:
  ``--check`` then runs the peer both ways against ours fp32 and ours int8). Position p
  attends to slots <= p, so the same graph is the prefill (T = 0) and a step. The talker's M-RoPE
  has its three position ids equal in TTS, which is the plain 1-D rotation used here (``--check``
  compares with our ``Talker.forward``, which computes M-RoPE).
* ``unrolled/cp_unrolled.mnn`` (beside links to everything else: a second model directory): the
  peer's preferred predictor path when the file exists, ``past_hidden [1, 1, D]``, ``g0_id [1]``
  int32 -> ``ids [15]`` int32, the frame's 15 predictor passes in one call, greedy (argmax) in
  the graph, heads and embeddings inside (in fp32; the per-pass path reads the fp16 tables).
* ``weights/*.bin`` + ``meta.json``: fp16 tables: codec embedding and head, text embedding (the
  peer indexes it with the released special ids, 151644..151673, so it has the released 151,936
  rows: ours first, our special tokens' rows copied to the released ids, zeros elsewhere), text
  projection, the predictor's 15 embeddings and heads.
* ``tokenizer/{vocab.json, merges.txt}``: our test tokenizer's byte-level BPE.
* ``vocoder.mnn``: a placeholder graph (codes -> their sum): the peer opens it at start-up, the
  talker benchmark never decodes audio.
* ``voice/``: the peer clones a voice (ref codes, speaker embedding, ref text): random codes, our
  "ryan" speaker row.

MNN's Python ``mnnconvert`` wrapper pip-installs a logging SDK and reports each converted model
to a remote service; the converter is called here through its C extension (``_tools``) instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MNN_PYTHON = REPO / ".venv-mnn" / "bin" / "python"
RELEASED_TEXT_VOCAB = 151936
# the ids qwen3_tts_mnn.engine / .tokenizer hard-code (the released tokenizer's), -> our tokens
PEER_TEXT_IDS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151671: "<tts_pad>",
                 151672: "<tts_text_bos>", 151673: "<tts_text_eod>"}
REF_TEXT = "Hello world, this is a small test."
REF_FRAMES = 8
UNROLLED = "unrolled"  # the sub-directory where cp_unrolled.mnn sits beside links to the rest
OPSET = 17
# MNN's converter flags per --quant: int8 is its block-wise asymmetric weight quantization, blocks of 128
# input channels with an fp32 scale and zero point (--weightQuantScaleBit's default), our int8's layout
QUANT_FLAGS = {"fp32": [], "int8": ["--weightQuantBits", "8", "--weightQuantBlock", "128", "--weightQuantAsymmetric"]}


def self_attention(q, k, v, mask, scale: float):
    """q [1, H, L, hd], k/v [1, KVH, T + L, hd], additive mask -> [1, L, H * hd] (``layers.attend``'s math)."""
    from engines.models.layers import expand_kv

    rep = q.shape[1] // k.shape[1]
    scores = (q @ expand_kv(k, rep).transpose(2, 3)) * scale + mask
    out = scores.softmax(-1) @ expand_kv(v, rep)
    b, h, s, hd = out.shape
    return out.transpose(1, 2).reshape(b, s, h * hd)


def through_layers(layers, x, cos, sin, positions, past: list):
    """x [1, L, D] at ``positions`` [1, L] through ``layers`` (our DecoderLayers), each attending to
    its ``past`` (k, v) [1, KVH, T, hd] (slot s holds position s) and the new positions
    -> (x, [(k, v) of T + L positions per layer])."""
    import torch

    slots = torch.arange(past[0][0].shape[2] + positions.shape[1], device=x.device)
    # [1, 1, L, T + L] added to the scores (an explicit softmax, not SDPA: torch exports SDPA's
    # boolean mask with IsNaN, which MNN's converter lacks)
    mask = torch.where(slots[None, :] <= positions[0][:, None], 0.0, float("-inf"))[None, None]
    new = []
    for layer, (past_k, past_v) in zip(layers, past):
        q, k, v = layer.qkv(x, cos, sin)
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        new.append((k, v))
        attn = self_attention(q, k, v, mask, layer.self_attn.scale)
        x = layer.after_attention(x, layer.self_attn.o_proj(attn))
    return x, new


def step_graph(layers, norm, rope):
    """``(inputs_embeds, position_ids, past_kv) -> (last_hidden, new_kv)`` over ``layers``,
    ``rope(positions [1, L]) -> cos, sin [1, L, hd]``."""
    import torch
    from torch import nn

    class StepGraph(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers, self.norm = layers, norm

        def forward(self, inputs_embeds, position_ids, past_kv):
            pos = position_ids.long()
            past = [(past_kv[2 * i], past_kv[2 * i + 1]) for i in range(len(self.layers))]
            x, new = through_layers(self.layers, inputs_embeds, *rope(pos), pos, past)
            return self.norm(x), torch.stack([t for kv in new for t in kv])

    return StepGraph().eval()


def unrolled_predictor_graph(talker, predictor):
    """``cp_unrolled.mnn``, the peer's preferred predictor path: ``(past_hidden [1, 1, D], g0_id [1]
    int32) -> ids [G - 1] int32``, the whole frame's code predictor in one call with greedy
    (argmax) codes, our ``CodePredictor.predict`` greedy unrolled (heads and embeddings inside)."""
    import torch
    from torch import nn

    from engines.models.layers import rope_cos_sin

    class Unrolled(nn.Module):
        def __init__(self):
            super().__init__()
            self.codec_embedding, self.predictor = talker.model.codec_embedding, predictor

        def forward(self, past_hidden, g0_id):
            p = self.predictor
            x = torch.cat([past_hidden, self.codec_embedding(g0_id.long())[None]], dim=1)  # [1, 2, D]
            kv_shape = (1, p.cfg.num_key_value_heads, 0, p.cfg.head_dim)
            past = [(x.new_zeros(kv_shape), x.new_zeros(kv_shape)) for _ in p.model.layers]
            ids, start = [], 0
            for i in range(p.cfg.num_code_groups - 1):
                pos = torch.arange(start, start + x.shape[1])[None]
                x, past = through_layers(p.model.layers, x, *rope_cos_sin(p.inv_freq, pos, torch.float32), pos, past)
                start += x.shape[1]
                code = p.lm_head[i](p.model.norm(x[:, -1])).argmax(-1)  # [1]
                ids.append(code)
                if i < p.cfg.num_code_groups - 2:
                    x = p.model.codec_embedding[i](code)[:, None]
            return torch.cat(ids).int()

    return Unrolled().eval()


STEP_INPUTS, STEP_OUTPUTS = ["inputs_embeds", "position_ids", "past_kv"], ["last_hidden", "new_kv"]
STEP_AXES = {"inputs_embeds": {1: "L"}, "position_ids": {1: "L"}, "past_kv": {3: "T"}, "last_hidden": {1: "L"},
             "new_kv": {3: "TL"}}


def step_example(hidden: int, layers: int, kv_heads: int, head_dim: int) -> tuple:
    import torch

    return (torch.randn(1, 2, hidden), torch.tensor([[3, 4]], dtype=torch.int32),
            torch.randn(2 * layers, 1, kv_heads, 3, head_dim))


def export_graph(graph, example: tuple, path: Path, inputs: list[str], outputs: list[str], axes: dict | None = None):
    import torch

    with torch.no_grad():
        torch.onnx.export(graph, example, str(path), input_names=inputs, output_names=outputs, opset_version=OPSET,
                          dynamo=False, dynamic_axes=axes or {})


def vocoder_placeholder():
    """codes [1, T, 16] int32 -> their sum (the peer opens vocoder.mnn; the bench never decodes)."""
    import torch

    class Placeholder(torch.nn.Module):
        def forward(self, codes):
            return codes.float().sum(-1)

    return Placeholder()


def convert(onnx_path: Path, mnn_path: Path, mnn_python: Path, quant: str = "fp32") -> None:
    """ONNX -> .mnn with MNN's converter (``quant``: fp32 weights or its int8, ``QUANT_FLAGS``), through
    its C extension (see the docstring)."""
    code = "import sys, _tools; _tools.mnnconvert(sys.argv)"
    mnn_path.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as work:  # it writes a scratch file of the weights into its cwd
        done = subprocess.run([str(mnn_python), "-c", code, "-f", "ONNX", "--modelFile", str(onnx_path.resolve()),
                               "--MNNModel", str(mnn_path.resolve()), "--bizCode", "streamvox", *QUANT_FLAGS[quant]],
                              capture_output=True, text=True, cwd=work)
    if not mnn_path.is_file():
        raise RuntimeError(f"MNN's converter wrote no {mnn_path}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def write_tables(bundle, out: Path) -> None:
    import numpy as np

    talker, predictor = bundle.talker, bundle.predictor
    tok = bundle.prompt.tokenizer
    text = talker.model.text_embedding.weight.detach().float().numpy()
    released = np.zeros((max(RELEASED_TEXT_VOCAB, text.shape[0]), text.shape[1]), np.float16)
    released[:text.shape[0]] = text
    for peer_id, token in PEER_TEXT_IDS.items():
        released[peer_id] = text[tok.token_to_id(token)]
    proj = talker.text_projection
    tables = {"codec_embedding": talker.model.codec_embedding.weight, "codec_head": talker.codec_head.weight,
              "text_embedding": released, "text_proj_fc1_w": proj.linear_fc1.weight,
              "text_proj_fc1_b": proj.linear_fc1.bias, "text_proj_fc2_w": proj.linear_fc2.weight,
              "text_proj_fc2_b": proj.linear_fc2.bias}
    for i, (emb, head) in enumerate(zip(predictor.model.codec_embedding, predictor.lm_head)):
        tables[f"cp_embed_{i}"], tables[f"cp_head_{i}"] = emb.weight, head.weight
    (out / "weights").mkdir(parents=True, exist_ok=True)
    meta = {}
    for name, t in tables.items():
        a = t if isinstance(t, np.ndarray) else t.detach().float().numpy().astype(np.float16)
        a.tofile(out / "weights" / f"{name}.bin")
        meta[name] = {"shape": list(a.shape), "dtype": "float16"}
    (out / "weights" / "meta.json").write_text(json.dumps(meta, indent=1))


def write_tokenizer(bundle, out: Path) -> None:
    """vocab.json + merges.txt of our byte-level BPE (the peer's tokenizer reads only those)."""
    model = json.loads(bundle.prompt.tokenizer._tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    (out / "tokenizer" / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False))
    (out / "tokenizer" / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def write_voice(bundle, out: Path, groups: int) -> None:
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(1)
    cb = bundle.predictor.cfg.vocab_size
    (out / "voice").mkdir(parents=True, exist_ok=True)
    torch.randint(0, cb, (REF_FRAMES, groups), generator=g, dtype=torch.int32).numpy().tofile(
        out / "voice" / "ref_code.i32.bin")
    speaker = bundle.prompt.config.speakers["ryan"]
    bundle.talker.model.codec_embedding.weight[speaker].detach().float().numpy().astype(np.float32).tofile(
        out / "voice" / "spk_emb.f32.bin")
    (out / "voice" / "meta.json").write_text(json.dumps({"ref_text": REF_TEXT, "ref_ids": None,
                                                          "ref_frames": REF_FRAMES}))


def bench_bundle(size: str):
    """The talker bench_talker's "ours" builds (same seed, sizes, EOS gain), fp32 on the CPU."""
    import torch

    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    from bench_talker import SIZES

    from testsupport.talker import make_bundle

    return make_bundle(seed=0, max_new_tokens=100_000, eos_gain=1.0, device="cpu", dtype=torch.float32,
                       **SIZES[size])


def export(bundle, out: Path, mnn_python: Path = MNN_PYTHON, keep_onnx: bool = False, quant: str = "fp32") -> None:
    """The whole model directory (see the module docstring) into ``out``, its graphs' weights in ``quant``."""
    import torch

    from engines.models.layers import rope_cos_sin

    talker, predictor = bundle.talker, bundle.predictor
    tc, pc = talker.cfg, predictor.cfg
    if (tc.num_key_value_heads, tc.head_dim, pc.num_key_value_heads, pc.head_dim) != (8, 128, 8, 128):
        raise SystemExit("qwen3-tts-mnn hard-codes K/V as [.., 8 heads, .., 128]: export the 0.6b/1.7b sizes")
    if tc.num_code_groups != 16 or tc.vocab_size != 3072:
        raise SystemExit("qwen3-tts-mnn hard-codes 16 code groups and a 3072-entry codec vocabulary")
    if not isinstance(predictor.small_to_mtp_projection, torch.nn.Identity):
        raise SystemExit("qwen3-tts-mnn's code predictor reads talker-width embeddings unprojected (0.6b sizes only)")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        write_tables(bundle, out)
    write_tokenizer(bundle, out)
    write_voice(bundle, out, tc.num_code_groups)
    onnx_dir = out / "onnx"
    onnx_dir.mkdir(exist_ok=True)
    unrolled = out / UNROLLED
    unrolled.mkdir(exist_ok=True)
    graphs = {  # .mnn path: (module, example inputs, input names, output names, dynamic axes)
        out / "talker_step.mnn": (
            step_graph(talker.model.layers, talker.model.norm,
                       lambda pos: rope_cos_sin(talker.inv_freq, pos, torch.float32)),
            step_example(tc.hidden_size, tc.num_hidden_layers, tc.num_key_value_heads, tc.head_dim),
            STEP_INPUTS, STEP_OUTPUTS, STEP_AXES),
        out / "cp_step.mnn": (
            step_graph(predictor.model.layers, predictor.model.norm,
                       lambda pos: rope_cos_sin(predictor.inv_freq, pos, torch.float32)),
            step_example(pc.hidden_size, pc.num_hidden_layers, pc.num_key_value_heads, pc.head_dim),
            STEP_INPUTS, STEP_OUTPUTS, STEP_AXES),
        out / "vocoder.mnn": (vocoder_placeholder(), (torch.zeros(1, 2, 16, dtype=torch.int32),), ["codes"],
                              ["wav"], {"codes": {1: "T"}}),
        unrolled / "cp_unrolled.mnn": (unrolled_predictor_graph(talker, predictor),
                                       (torch.randn(1, 1, tc.hidden_size), torch.tensor([5], dtype=torch.int32)),
                                       ["past_hidden", "g0_id"], ["ids"], None),
    }
    for path, (graph, example, inputs, outputs, axes) in graphs.items():
        onnx = onnx_dir / (path.stem + ".onnx")
        export_graph(graph, example, onnx, inputs, outputs, axes)
        convert(onnx, path, mnn_python, quant)
        print(f"  {path.relative_to(out)} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if not keep_onnx:
            onnx.unlink()
    if not keep_onnx:
        onnx_dir.rmdir()
    for f in out.iterdir():  # the unrolled layout: the same files and its one extra graph
        if f.name not in (UNROLLED, "onnx") and not (unrolled / f.name).exists():
            (unrolled / f.name).symlink_to(Path("..") / f.name)


# --------------------------------------------------------------------------- parity


PEER_RUN = r"""
import json, sys
import numpy as np
import MNN
from qwen3_tts_mnn import Qwen3TtsMnn
from qwen3_tts_mnn.engine import TTS_PAD
from qwen3_tts_mnn.tokenizer import build_assistant_text_ids
model, out, steps, text, memory = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
if memory == 'low':  # its sessions with MNN's Memory_Low hint, as bench_talker's "mnn ... lowmem"
    class LowMemory(MNN.Interpreter):
        def createSession(self, config=None, *rest):
            return super().createSession({**(config or {}), 'memory': 2}, *rest)
    MNN.Interpreter = LowMemory
tts = Qwen3TtsMnn(model, num_threads=1, language='english', backend='pymnn')
tts.load_voice(model + '/voice')
prefill, trailing = tts._build_prefill(build_assistant_text_ids(tts.tokenizer, text))
hidden, _ = tts._run_step(tts._talker, prefill, 0, np.zeros((56, 1, 8, 0, 128), np.float32), 56)
codes = tts.synthesize_codes(text, steps, temperature=0.0, repetition_penalty=1.0, min_new_tokens=10**9)
np.savez(out, prefill=prefill, trailing=trailing, tts_pad=tts._text_proj(np.array([TTS_PAD])),
         hidden=hidden[0, -1], codes=codes)
"""


def peer_run(model: Path, steps: int, text: str, mnn_python: Path = MNN_PYTHON, memory: str = "normal") -> dict:
    """The peer's own greedy loop on ``model`` (the export directory: its cp_step path, or
    ``unrolled/``: cp_unrolled; ``memory`` low: its MNN sessions with the Memory_Low hint) -> its
    prefill inputs, trailing text, tts_pad embedding, the prefill's last hidden state and its codes
    [steps, 16]."""
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        npz = Path(tmp) / "peer.npz"
        subprocess.run([str(mnn_python), "-c", PEER_RUN, str(model), str(npz), str(steps), text, memory], check=True)
        return dict(np.load(npz))


def compare(bundle, peer: dict, steps: int) -> dict:
    """Our modules fed what the peer's loop was fed: its prefill embeddings and trailing text (its
    voice-clone prompt), its fp16 tables (ours rounded to fp16 here the same way); greedy code 0
    over codes < 2048 (EOS blocked), greedy codes 1..15 -> the agreement with ``peer_run``'s codes
    and the prefill's last hidden state difference (``ours_codes``: ours, [steps][16]). Our
    modules may be quantized (engines/models/quantize.py; their heads then are already rounded)."""
    import torch

    from engines.models.sampling import FrameSampling

    talker, predictor = bundle.talker, bundle.predictor
    with torch.no_grad():
        for w in [talker.codec_head.weight, talker.model.codec_embedding.weight,
                  *(m.weight for m in predictor.lm_head if isinstance(m, torch.nn.Linear)),
                  *(m.weight for m in predictor.model.codec_embedding)]:
            w.copy_(w.half().float())
        prefill = torch.from_numpy(peer["prefill"])
        trailing, pad = torch.from_numpy(peer["trailing"]), torch.from_numpy(peer["tts_pad"])
        length = prefill.shape[1]
        cache = talker.new_cache(1, length + steps + 1, "cpu", torch.float32)
        h = talker(prefill, torch.arange(length)[None], cache)
        hidden_diff = float((h[0] - torch.from_numpy(peer["hidden"])).abs().max())
        greedy = FrameSampling.for_stream(1, 0, 0, "cpu", greedy=True)
        codebook = predictor.cfg.vocab_size
        ours = []
        for t in range(steps):
            g0 = int(talker.codec_head(h)[0, :codebook].argmax())
            emb0 = talker.model.codec_embedding.weight[g0][None]
            rest = predictor.predict(h, emb0, greedy)[0].tolist()
            ours.append([g0] + rest)
            e = emb0[0] + sum(predictor.model.codec_embedding[i].weight[c] for i, c in enumerate(rest))
            e = e + (trailing[t] if t < trailing.shape[0] else pad[0])
            h = talker(e[None, None], torch.tensor([[length + t]]), cache)
    theirs = peer["codes"].tolist()
    n = min(len(ours), len(theirs))
    frames_equal = sum(a == b for a, b in zip(ours, theirs))
    first_diff = next((i for i in range(n) if ours[i] != theirs[i]), None)
    return {"frames": n, "peer_frames": len(theirs), "frames_equal": frames_equal,
            "code0_equal": sum(a[0] == b[0] for a, b in zip(ours, theirs)),
            "codes_equal": sum(x == y for a, b in zip(ours, theirs) for x, y in zip(a, b)),
            "codes": n * 16, "first_differing_frame": first_diff, "prefill_hidden_max_abs_diff": hidden_diff,
            "ours_code0": [f[0] for f in ours], "peer_code0": [f[0] for f in theirs], "ours_codes": ours}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", default="0.6b", choices=["0.6b"])
    ap.add_argument("--mnn-python", type=Path, default=MNN_PYTHON)
    ap.add_argument("--check", type=int, default=0, metavar="FRAMES", help="then compare greedy codes with ours")
    ap.add_argument("--quant", default="fp32", choices=sorted(QUANT_FLAGS),
                    help="the step graphs' weights: fp32, or MNN's converter's block-wise int8 (see the docstring)")
    ap.add_argument("--check-only", action="store_true", help="the directory exists: only --check")
    ap.add_argument("--keep-onnx", action="store_true")
    args = ap.parse_args()
    if not args.mnn_python.is_file():
        raise SystemExit(f"no {args.mnn_python}: build it with scripts/mnn-env.sh")
    if not args.check_only:
        export(bench_bundle(args.size), args.out, args.mnn_python, args.keep_onnx, args.quant)
        print(f"wrote {args.out}")
    if args.check or args.check_only:
        from bench_talker import TEXT

        steps = args.check or 8
        # int8: the peer also with MNN's Memory_Low hint (its int8 computed as int8, not expanded to fp32)
        # and ours also in int8 (blocks of 128 with a scale and a zero point, on ONNX Runtime)
        modes = ["fp32", "int8"] if args.quant == "int8" else ["fp32"]
        memories = ["normal", "low"] if args.quant == "int8" else ["normal"]
        # the peer first, while this process holds no model (both at once need ~6 GB)
        peers = {(model, memory): peer_run(model, steps, TEXT, args.mnn_python, memory)
                 for model in (args.out, args.out / UNROLLED) for memory in memories}
        bundle = bench_bundle(args.size)
        ours = {}
        for mode in modes:
            if mode == "int8":
                from engines.models.quantize import quantize_talker

                quantize_talker(bundle.talker, bundle.predictor, "int8", native=False)
            for (model, memory), peer in peers.items():
                got = compare(bundle, peer, steps)
                ours[mode] = got.pop("ours_codes")  # the peers' prompts are the same: so are ours' codes
                print(f"{model} (MNN memory {memory}) vs ours {mode}: {json.dumps(got)}")
        if len(ours) == 2:
            a, b = ours["fp32"], ours["int8"]
            print(f"ours int8 vs ours fp32 on those inputs: frames equal {sum(x == y for x, y in zip(a, b))} / "
                  f"{len(a)}, code 0 equal {sum(x[0] == y[0] for x, y in zip(a, b))}, codes equal "
                  f"{sum(u == v for x, y in zip(a, b) for u, v in zip(x, y))} / {16 * len(a)}")


if __name__ == "__main__":
    main()
