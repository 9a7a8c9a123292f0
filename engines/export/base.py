"""The backend seam: what the tick loop and the vocalizer call, whatever runs the math.

* The :class:`~engines.pipelines.dit.denoiser.Denoiser` calls ``dit(x, positions, context_mask,
  frame_mask, t, enc, enc_mask) -> v`` and reads ``dit.cfg``.
* The :class:`~engines.pipelines.vocoder.Vocalizer` calls ``decoder.decode_step(codes, state)``,
  ``decoder.init_state(batch, device, dtype)``, reads ``decoder.cfg`` /
  ``decoder.samples_per_frame``; offline code calls ``decoder(codes)``.

A torch module satisfies this by itself. An exported backend (ONNX Runtime, TensorRT)
provides a *runner* with the same call signatures; the runners here hold the shared,
backend-independent parts: input validation against the exported profile, the
flattening of :class:`DecoderState` into named tensors, and splitting decoder calls
that exceed the profile (decoder rows are independent and streaming decode composes,
so a split call computes the same audio). The DiT is never split: the scheduler's
batch ceiling is set to the profile's max batch instead (see ``apply_backend``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.models.codec_decoder import DecoderState
from engines.models.configs import CodecDecoderConfig, DiTConfig


class BackendError(RuntimeError):
    """Base of the errors a backend raises with an actionable message."""


class BackendUnavailable(BackendError):
    """The runtime a backend needs (onnxruntime, TensorRT, polygraphy, CUDA) is not installed/usable."""


class ArtifactMismatch(BackendError):
    """Exported graphs / engines do not belong to the weights or config being served."""


class ShapeOutsideProfile(BackendError, ValueError):
    """An input shape is outside the [min, max] range the graph/engine was exported/built for."""


@dataclass(frozen=True)
class AxisRange:
    """Range of one dynamic axis: TensorRT optimization-profile min/opt/max."""

    min: int
    opt: int
    max: int

    def __post_init__(self):
        if not 1 <= self.min <= self.opt <= self.max:
            raise ValueError(f"need 1 <= min <= opt <= max, got {self.min}, {self.opt}, {self.max}")

    def contains(self, n: int) -> bool:
        return self.min <= n <= self.max

    def to_list(self) -> list[int]:
        return [self.min, self.opt, self.max]


def check_axes(graph: str, sizes: dict[str, int], profile: dict[str, AxisRange],
               source: str = "exported profile") -> None:
    """Raise ShapeOutsideProfile naming the first axis whose size is out of range."""
    for axis, n in sizes.items():
        r = profile.get(axis)
        if r is not None and not r.contains(n):
            raise ShapeOutsideProfile(f"{graph}: {axis} = {n} is outside the {source} "
                                      f"[{r.min}, {r.max}]; re-export with a wider range "
                                      f"(streamvox export) and rebuild the engines")


class DiTRunner:
    """Calls like FlowDiT. Subclasses implement :meth:`_run` on validated inputs."""

    graph = "dit"
    profile_source = "exported profile"  # TensorRT: the engine's optimization profile

    def __init__(self, cfg: DiTConfig, profile: dict[str, AxisRange]):
        self.cfg = cfg
        self.profile = profile

    @property
    def max_batch(self) -> int:
        """Most rows one forward accepts (the engine profile's max batch)."""
        return self.profile["batch"].max

    # Engine/Models call .to()/.eval() on every component; the graph's device and dtype
    # were fixed at export/build time, so these are no-ops that keep the chaining API.
    def to(self, *args, **kwargs) -> "DiTRunner":
        return self

    def eval(self) -> "DiTRunner":
        return self

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, context_mask: torch.Tensor,
                 frame_mask: torch.Tensor, t: torch.Tensor, enc: torch.Tensor,
                 enc_mask: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        if D != self.cfg.latent_dim or enc.shape[-1] != self.cfg.cond_dim:
            raise ValueError(f"{self.graph}: expected x [..., {self.cfg.latent_dim}] and "
                             f"enc [..., {self.cfg.cond_dim}], got {tuple(x.shape)} and {tuple(enc.shape)}")
        check_axes(self.graph, {"batch": B, "frames": T, "enc_len": enc.shape[1]}, self.profile,
                   self.profile_source)
        return self._run(x, positions, context_mask, frame_mask, t, enc, enc_mask)

    forward = __call__

    def _run(self, x, positions, context_mask, frame_mask, t, enc, enc_mask) -> torch.Tensor:
        raise NotImplementedError


def state_names(num_conv: int, num_layers: int) -> list[str]:
    """Flat names of a DecoderState's tensors, in the order the step graph takes them."""
    return ([f"conv_{i}" for i in range(num_conv)] + [f"key_{i}" for i in range(num_layers)]
            + [f"value_{i}" for i in range(num_layers)] + ["position"])


def flatten_state(state: DecoderState) -> list[torch.Tensor]:
    return [*state.conv, *state.keys, *state.values, state.position]


def live_state_indices(template: DecoderState) -> list[int]:
    """Indices (into flatten_state) of the carried tensors that are not empty."""
    return [i for i, x in enumerate(flatten_state(template)) if x.numel() > 0]


def unflatten_state(flat: list[torch.Tensor], num_conv: int, num_layers: int) -> DecoderState:
    c, l = num_conv, num_layers
    return DecoderState(conv=list(flat[:c]), keys=list(flat[c:c + l]), values=list(flat[c + l:c + 2 * l]),
                        position=flat[c + 2 * l])


class DecoderRunner:
    """Calls like CodecDecoder (``forward``, ``decode_step``, ``init_state``).

    ``template`` is a zero DecoderState of batch 1 (shapes of every carried tensor).
    Subclasses implement ``_run_full(codes)`` and ``_run_step(codes, flat_state)``.
    """

    profile_source = "exported profile"

    def __init__(self, cfg: CodecDecoderConfig, samples_per_frame: int, template: DecoderState,
                 full_profile: dict[str, AxisRange], step_profile: dict[str, AxisRange]):
        self.cfg = cfg
        self.samples_per_frame = samples_per_frame
        self.template = template
        self.num_conv, self.num_layers = len(template.conv), len(template.keys)
        # Convs with no left context (kernel 1, kernel == stride) carry [B, C, 0]
        # tensors; zero-size tensors are not graph inputs (TensorRT rejects them).
        self.live = live_state_indices(template)
        self.full_profile, self.step_profile = full_profile, step_profile

    def to(self, *args, **kwargs) -> "DecoderRunner":
        return self

    def eval(self) -> "DecoderRunner":
        return self

    def _check(self, codes: torch.Tensor) -> None:
        if codes.dim() != 3 or codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"expected codes [B, {self.cfg.num_quantizers}, T], got {tuple(codes.shape)}")
        if codes.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"codes must be integer, got {codes.dtype}")

    def init_state(self, batch: int, device=None, dtype=None) -> DecoderState:
        t = self.template
        dev = device if device is not None else t.position.device
        dt = dtype if dtype is not None else t.keys[0].dtype
        grow = lambda x, d: x.to(dev, d).expand(batch, *x.shape[1:]).clone()  # noqa: E731
        return DecoderState(conv=[grow(x, dt) for x in t.conv], keys=[grow(x, dt) for x in t.keys],
                            values=[grow(x, dt) for x in t.values], position=grow(t.position, torch.int64))

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        """Full decode codes [B, G, T] -> wav [B, T * samples_per_frame]; batches over the profile are split."""
        self._check(codes)
        if not self.full_profile:
            raise FileNotFoundError("the artifacts have no decoder_full graph: export it (streamvox export)")
        B, _, T = codes.shape
        # Frames are not split here: a split full decode is what decode_step is for.
        check_axes("decoder_full", {"frames": T}, self.full_profile, self.profile_source)
        step = self.full_profile["batch"].max
        return torch.cat([self._run_full(codes[i:i + step].long()) for i in range(0, B, step)])

    forward = __call__

    def decode_step(self, codes: torch.Tensor, state: DecoderState) -> tuple[torch.Tensor, DecoderState]:
        """Streaming decode like CodecDecoder.decode_step; the input state is left untouched.

        Rows beyond the profile's max batch and frames beyond its max chunk are split:
        rows are independent, and consecutive steps with carried state concatenate to
        one longer step."""
        self._check(codes)
        if codes.shape[0] != state.batch:
            raise ValueError(f"codes batch {codes.shape[0]} != state batch {state.batch}")
        flat = flatten_state(state)
        bmax, tmax = self.step_profile["batch"].max, self.step_profile["frames"].max
        wavs, states = [], []
        for b0 in range(0, codes.shape[0], bmax):
            rows = [x[b0:b0 + bmax] for x in flat]
            pieces = []
            for t0 in range(0, codes.shape[2], tmax):
                chunk = codes[b0:b0 + bmax, :, t0:t0 + tmax]
                check_axes("decoder_step", {"batch": chunk.shape[0], "frames": chunk.shape[2]}, self.step_profile,
                           self.profile_source)
                wav, live = self._run_step(chunk.long(), [rows[i] for i in self.live])
                rows = list(rows)
                for i, x in zip(self.live, live):
                    rows[i] = x
                pieces.append(wav)
            wavs.append(torch.cat(pieces, dim=1))
            states.append(rows)
        out_flat = [torch.cat([s[i] for s in states]) for i in range(len(flat))] if len(states) > 1 else states[0]
        return torch.cat(wavs), unflatten_state(out_flat, self.num_conv, self.num_layers)

    def _run_full(self, codes: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _run_step(self, codes: torch.Tensor, live: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """codes [b, G, t] int64 and the live state tensors (order of ``self.live``) ->
        (wav [b, t * samples_per_frame], the next live state tensors)."""
        raise NotImplementedError
