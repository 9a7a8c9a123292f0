"""benchmarks/export_mnn.py's graphs compute what our modules compute: exported to ONNX from a tiny
talker and run with ONNX Runtime (the MNN conversion and the qwen3-tts-mnn peer itself need
.venv-mnn, outside CI: ``export_mnn.py --check`` compares the peer's codes with ours there)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from export_mnn import (  # noqa: E402
    STEP_AXES,
    STEP_INPUTS,
    STEP_OUTPUTS,
    export_graph,
    step_example,
    step_graph,
    unrolled_predictor_graph,
)

from engines.models.layers import rope_cos_sin  # noqa: E402
from engines.models.sampling import FrameSampling  # noqa: E402
from tests.talker_helpers import make_bundle  # noqa: E402


def session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def test_talker_step_graph_prefill_then_steps_equal_talker_forward(tmp_path):
    """Prefill (no past) then single positions, K/V carried between calls: the last hidden state
    equals Talker.forward's (which computes M-RoPE; the graph the 1-D rotation) at every call."""
    talker = make_bundle(seed=0).talker
    cfg = talker.cfg
    graph = step_graph(talker.model.layers, talker.model.norm,
                       lambda pos: rope_cos_sin(talker.inv_freq, pos, torch.float32))
    path = tmp_path / "talker_step.onnx"
    export_graph(graph, step_example(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim),
                 path, STEP_INPUTS, STEP_OUTPUTS, STEP_AXES)
    sess = session(path)
    g = torch.Generator().manual_seed(3)
    cache = talker.new_cache(1, 16, "cpu", torch.float32)
    kv = np.zeros((2 * cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
    start = 0
    for length in (5, 1, 1):
        x = torch.randn(1, length, cfg.hidden_size, generator=g)
        positions = torch.arange(start, start + length)[None]
        hidden, kv = sess.run(None, {"inputs_embeds": x.numpy(), "position_ids": positions.int().numpy(),
                                     "past_kv": kv})
        with torch.no_grad():
            ours = talker(x, positions, cache)
        assert hidden.shape == (1, length, cfg.hidden_size) and kv.shape[3] == start + length
        np.testing.assert_allclose(hidden[0, -1], ours[0].numpy(), atol=1e-4, rtol=1e-4)
        start += length


def test_unrolled_predictor_graph_equals_greedy_predict(tmp_path):
    """``(past_hidden, g0_id) -> ids``: the greedy codes 1..G-1 of CodePredictor.predict."""
    bundle = make_bundle(seed=1)
    talker, predictor = bundle.talker, bundle.predictor
    path = tmp_path / "cp_unrolled.onnx"
    d = talker.cfg.hidden_size
    export_graph(unrolled_predictor_graph(talker, predictor), (torch.randn(1, 1, d), torch.tensor([5], dtype=torch.int32)),
                 path, ["past_hidden", "g0_id"], ["ids"])
    sess = session(path)
    g = torch.Generator().manual_seed(4)
    greedy = FrameSampling.for_stream(1, 0, 0, "cpu", greedy=True)
    for g0 in (0, 7, 21):
        h = torch.randn(1, d, generator=g)
        (ids,) = sess.run(None, {"past_hidden": h[:, None].numpy(), "g0_id": np.array([g0], np.int32)})
        with torch.no_grad():
            ours = predictor.predict(h, talker.model.codec_embedding.weight[g0][None], greedy)
        assert ids.dtype == np.int32
        assert ids.reshape(-1).tolist() == ours[0].tolist()
