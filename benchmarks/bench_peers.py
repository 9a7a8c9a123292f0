"""streamvox beside faster-qwen3-tts on the same checkpoint and GPU: time to first audio and
real-time factor for one client, in rotating rounds.

    python3 benchmarks/bench_peers.py --checkpoint /tmp/ckpt-0.6b --chunks 1 2 4 8 --rounds 3
    .venv/bin/python benchmarks/bench_peers.py --checkpoint /tmp/ckpt-tiny --device cpu --chunks 1 --rounds 1

* **peer**: faster-qwen3-tts (0.5.4, with qwen-tts-hf and transformers 5; carried as wheels on a
  GPU host, scripts/gpu-verify.sh) in its own long-lived process (``--peer-worker``): its CUDA
  graphs captured by an untimed turn at each chunk size, then per turn one
  ``generate_custom_voice_streaming`` at that ``chunk_size``; time to first audio = from the call
  to its first PCM chunk, wall = to its last. Off CUDA faster-qwen3-tts cannot run (its graphs need
  a GPU): the worker then only loads the checkpoint with qwen-tts-hf and generates a few frames,
  the check that the peer reads our checkpoint, and its rows say "CPU check".
* **ours**: the real server (`streamvox serve --checkpoint`, a subprocess) and one WebSocket
  client per turn, as users get it (benchmarks/loadgen.py): time to first audio = from sending
  the text to the first PCM frame, wall = to ``session.done``.
* Both say the same sentence with the same speaker, sampled with the checkpoint's settings; the
  benchmark checkpoint never emits EOS, so both are given the checkpoint's own ``max_new_tokens``
  (ours in its session.config: without it streamvox would speak to the sentence's frame budget). **Rounds**: each round runs every variant once, the order rotated by one per
  round; figures are medians over rounds, ratios taken within a round.
* RTF = wall seconds / audio seconds (lower is better; < 1 keeps up); "x realtime" = its inverse,
  the figure faster-qwen3-tts's README calls RTF.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.machinery
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

TEXT = "The quick brown fox jumps over the lazy dog, while every stream keeps playing."
REPLY = "PEER "  # prefix of the worker's answer lines (anything else a library prints is ignored)


# --------------------------------------------------------------------------- the peer's process


# qwen-tts-hf imports these at module level for audio I/O, the 25 Hz tokenizer and the speaker
# encoder's front end, none of which the custom-voice path calls
OPTIONAL = {"librosa": ["librosa.filters"], "sox": [], "onnxruntime": [],
            "torchaudio": ["torchaudio.compliance", "torchaudio.compliance.kaldi"]}


class _Missing(types.ModuleType):
    """Stands in for a package that is not installed: every attribute raises when called."""

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def missing(*_args, **_kwargs):
            raise RuntimeError(f"{self.__name__}.{attr}: not installed (stubbed by bench_peers)")

        return missing


def stub_missing() -> list[str]:
    """A :class:`_Missing` module for each package of OPTIONAL that cannot be imported."""
    stubbed = []
    for name, subs in OPTIONAL.items():
        try:
            importlib.import_module(name)
            continue
        except ImportError:
            pass
        for full in (name, *subs):
            module = _Missing(full)
            module.__spec__ = importlib.machinery.ModuleSpec(full, None)
            module.__path__ = []
            sys.modules[full] = module
            parent, _, child = full.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, module)
        stubbed.append(name)
    return stubbed


def tolerate_moved_rope_theta() -> None:
    """qwen-tts-hf registers a "default" RoPE initialiser that reads ``config.rope_theta``; from
    transformers 5.17 the speech tokenizer's Mimi config keeps it in ``rope_parameters`` instead,
    and loading fails. Read it from either place (nothing else changes)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    original = ROPE_INIT_FUNCTIONS["default"]

    def default(config, *args, **kwargs):
        if not hasattr(config, "rope_theta") and isinstance(getattr(config, "rope_parameters", None), dict):
            theta = config.rope_parameters.get("rope_theta")
            config = types.SimpleNamespace(**{**config.to_dict(), "rope_theta": theta})
        return original(config, *args, **kwargs)

    ROPE_INIT_FUNCTIONS["default"] = default


def reply(obj: dict) -> None:
    print(REPLY + json.dumps(obj), flush=True)


def peer_worker(args) -> None:
    import torch

    stubbed = stub_missing()
    import qwen_tts  # noqa: F401  (registers its RoPE initialiser)

    tolerate_moved_rope_theta()
    checkpoint = json.loads((Path(args.checkpoint) / "config.json").read_text())
    speaker = sorted(checkpoint["talker_config"]["spk_id"])[0]
    if args.device != "cuda":  # no CUDA graphs off a GPU: check that the peer's loader reads the checkpoint
        from qwen_tts import Qwen3TTSModel

        model = Qwen3TTSModel.from_pretrained(args.checkpoint, device_map="cpu", dtype=torch.float32)
        t0 = time.perf_counter()
        wavs, rate = model.generate_custom_voice(TEXT, speaker=speaker, language="English", max_new_tokens=4)
        reply({"ready": True, "check_s": time.perf_counter() - t0, "samples": int(len(wavs[0])), "stubbed": stubbed})
        for _ in sys.stdin:
            reply({"error": "faster-qwen3-tts needs CUDA"})
        return
    from faster_qwen3_tts import FasterQwen3TTS

    model = FasterQwen3TTS.from_pretrained(args.checkpoint, device="cuda", dtype=torch.bfloat16)
    reply({"ready": True, "speaker": speaker, "stubbed": stubbed})
    for line in sys.stdin:
        req = json.loads(line)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first, samples, rate, chunks = None, 0, 24000, []
        for audio, rate, _timing in model.generate_custom_voice_streaming(
                req.get("text", TEXT), speaker=speaker, language="English", chunk_size=req["chunk"],
                max_new_tokens=req["max_new_tokens"]):
            if first is None and len(audio):
                first = time.perf_counter() - t0
            samples += len(audio)
            chunks.append((time.perf_counter() - t0, len(audio)))  # when each chunk came (open-loop underruns)
        wall = time.perf_counter() - t0
        reply({"ttfa_s": first, "wall_s": wall, "audio_s": samples / rate, "chunks": chunks})


class PeerProcess:
    def __init__(self, args):
        cmd = [args.peer_python, __file__, "--peer-worker", "--checkpoint", args.checkpoint, "--device", args.device]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.ready = self._read()

    def _read(self) -> dict | None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        return None  # the worker died: its stderr says why

    def ask(self, chunk: int, max_new_tokens: int, text: str = TEXT) -> dict:
        self.proc.stdin.write(json.dumps({"chunk": chunk, "max_new_tokens": max_new_tokens, "text": text}) + "\n")
        self.proc.stdin.flush()
        return self._read() or {"error": "the peer process exited"}

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


# --------------------------------------------------------------------------- coordinator


def ours_turn(url: str, max_new_tokens: int) -> dict:
    from loadgen import run_ws_session

    s = asyncio.run(run_ws_session(url, TEXT, config={"max_new_tokens": max_new_tokens}))
    if s.error or not s.ok:
        return {"error": s.error or "no session.done"}
    return {"ttfa_s": s.ttfa_s, "wall_s": s.wall_s, "audio_s": s.audio_s}


def summary(turns: list[dict]) -> dict:
    ok = [t for t in turns if "error" not in t and t.get("ttfa_s") is not None and t["audio_s"] > 0]
    if not ok:
        return {"error": next((t["error"] for t in turns if "error" in t), "no turns")}
    return {"ttfa_ms": statistics.median(t["ttfa_s"] for t in ok) * 1e3,
            "ttfa_min_ms": min(t["ttfa_s"] for t in ok) * 1e3,
            "rtf": statistics.median(t["wall_s"] / t["audio_s"] for t in ok),
            "audio_s": statistics.median(t["audio_s"] for t in ok), "turns": len(ok)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8], help="the peer's chunk_size values")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `streamvox serve` flag, repeatable")
    p.add_argument("--peer-python", default=sys.executable,
                   help="the interpreter that has faster-qwen3-tts, qwen-tts-hf and transformers 5")
    p.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer_worker:
        peer_worker(args)
        return 0

    from loadgen import Server, log_tail

    generation = json.loads((Path(args.checkpoint) / "generation_config.json").read_text())
    max_new_tokens = int(generation.get("max_new_tokens", 2048))
    peer = PeerProcess(args)
    if not peer.ready:
        print("peer: faster-qwen3-tts did not start (its stderr is above); ours is measured alone")
    elif args.device != "cuda":
        print(f"peer (CPU check): qwen-tts-hf loaded the checkpoint and generated {peer.ready['samples']} samples "
              f"in {peer.ready['check_s']:.1f} s (stubbed: {peer.ready['stubbed'] or 'none'})")
    server = Server.start("small", args.device, tempfile.mkdtemp(prefix="streamvox-peers-"),
                          extra=[f"--checkpoint={args.checkpoint}", *args.serve_arg])
    asyncio.run(server.wait_ready())
    variants = ["ours"] + ([f"peer chunk {c}" for c in args.chunks] if peer.ready and args.device == "cuda" else [])
    try:
        for name in variants:  # untimed: the peer captures its graphs on first use, ours is warm already
            run_variant(name, server.url, peer, max_new_tokens)
        turns: dict[str, list[dict]] = {v: [] for v in variants}
        ratios: list[tuple[str, float, float]] = []
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            got = {name: run_variant(name, server.url, peer, max_new_tokens) for name in order}
            for name, t in got.items():
                turns[name].append(t)
            for name in variants[1:]:
                a, b = got["ours"], got[name]
                if "error" not in a and "error" not in b and a.get("ttfa_s") and b.get("ttfa_s"):
                    ratios.append((name, b["ttfa_s"] / a["ttfa_s"],
                                   (b["wall_s"] / b["audio_s"]) / (a["wall_s"] / a["audio_s"])))
    except Exception:
        print("server log (last lines):\n" + log_tail(server.log))
        raise
    finally:
        server.stop()
        peer.close()
    report(args, variants, turns, ratios, max_new_tokens)
    return 0


def run_variant(name: str, url: str, peer: PeerProcess, max_new_tokens: int) -> dict:
    if name == "ours":
        return ours_turn(url, max_new_tokens)
    return peer.ask(int(name.split()[-1]), max_new_tokens)


def report(args, variants: list[str], turns: dict[str, list[dict]], ratios, max_new_tokens: int) -> None:
    import torch

    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\nbench_peers: {device}, checkpoint {args.checkpoint}, max_new_tokens {max_new_tokens}, "
          f"{args.rounds} rounds, one client; RTF = wall / audio (lower is better)")
    print(f"{'variant':<16} {'TTFA p50 ms':>11} {'TTFA min ms':>11} {'RTF p50':>8} {'x realtime':>10} {'audio s':>8}")
    for name in variants:
        s = summary(turns[name])
        if "error" in s:
            print(f"{name:<16} error: {s['error'][:200]}")
            continue
        print(f"{name:<16} {s['ttfa_ms']:>11.1f} {s['ttfa_min_ms']:>11.1f} {s['rtf']:>8.3f} {1 / s['rtf']:>10.2f} "
              f"{s['audio_s']:>8.2f}")
    for name in variants[1:]:
        mine = [(t, f) for n, t, f in ratios if n == name]
        if mine:
            print(f"{name} / ours, within a round (median): TTFA {statistics.median(t for t, _ in mine):.2f}x, "
                  f"RTF {statistics.median(f for _, f in mine):.2f}x")


if __name__ == "__main__":
    sys.exit(main())
