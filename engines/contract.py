"""The engine <-> service contract: everything that crosses the thread boundary.

The asyncio service builds a :class:`SynthesisRequest`, calls
``engine.submit(request, deliver)`` and gets a :class:`RequestHandle` back at once.
The engine's worker thread (the only thread that touches tensors) later calls
``deliver(chunk)`` with :class:`AudioChunk` objects, in order, ending with exactly one
chunk whose ``is_final`` is true (carrying ``error`` when the request failed).

Rules both sides rely on:

* ``deliver`` runs on the worker thread. It must be thread-safe and must not block;
  the service wraps it with ``loop.call_soon_threadsafe``.
* ``submit`` never blocks. It raises :class:`InvalidRequest` (bad parameters, say
  which field) or :class:`EngineOverloaded` (admission queue full) synchronously.
* ``handle.cancel()`` may be called from any thread, any number of times. The worker
  frees the request's slot at its next tick and then delivers one final chunk with
  ``error == "cancelled"``.
* ``handle.pause()`` / ``handle.resume()`` implement back-pressure: while paused the
  worker starts no new chunk for the request (a chunk already being denoised finishes).
* An exception inside one request's computation fails that request only.
* Word timestamps (``request.timestamps`` with an aligner loaded,
  ``capabilities.timestamps``): the request's last audio arrives in a chunk that is not
  final; the final chunk follows once the engine has aligned the request's text with all
  its audio, empty, carrying :class:`Alignment`. Alignment runs behind audio: the engine
  never aligns while a realtime request waits for its first audio.

This module is frozen: add optional fields with defaults, never rename or remove.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Protocol

import numpy as np

SAMPLE_RATE = 24_000
"""Output sample rate of every engine (Qwen3-TTS 12 Hz codec)."""

SAMPLES_PER_FRAME = 1920
"""PCM samples per codec frame (80 ms at 24 kHz)."""


class Priority(str, enum.Enum):
    """Scheduling class: realtime streams are always served before batch work."""

    REALTIME = "realtime"
    BATCH = "batch"


class EngineError(Exception):
    """Base class for errors the engine reports synchronously from ``submit``."""


class InvalidRequest(EngineError, ValueError):
    """A request parameter is out of range; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class EngineOverloaded(EngineError):
    """The admission queue is full; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str = "engine admission queue is full", retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailable(EngineError):
    """The engine is not running (not started yet, stopping, or its worker died)."""


@dataclass(frozen=True)
class SynthesisRequest:
    """One utterance (or text block) to synthesize.

    ``text`` may hold several sentences; the engine splits long text at clause
    boundaries itself. ``steps`` / ``guidance_scale`` drive the DiT source and are
    ignored by the talker source. ``seed`` fully determines every random draw the
    request makes (initial noise, sampling), independent of what shares a batch.
    """

    id: str
    text: str
    voice: str = "default"
    seed: int | None = 0  # None: the engine picks (talker: random per request; DiT: 0)
    steps: int = 8
    guidance_scale: float = 2.0
    speed: float = 1.0
    priority: Priority = Priority.REALTIME
    language: str = "Auto"
    # Sampling. ``None`` = the model's default: the talker's is its checkpoint's
    # generation_config.json; the DiT's code predictor decodes greedily. ``temperature`` 0 or
    # ``greedy`` True = greedy decoding (talker and code predictor both).
    greedy: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None  # talker: over the generated code-0 ids
    max_new_tokens: int | None = None  # talker: at most max_new_tokens - 1 frames (official counting)
    initial_codec_chunk_frames: int | None = None  # frames before the first PCM (None: the pipeline's)
    # Talker task and voice prompt (vllm-omni's field names). ``None`` = what the
    # checkpoint's release does: Base clones (``clone`` required), VoiceDesign follows
    # ``instructions`` (required), CustomVoice speaks a preset ``voice`` (instructions on 1.7B).
    task_type: str | None = None  # "CustomVoice" | "VoiceDesign" | "Base"
    instructions: str | None = None
    clone: "VoiceClone | None" = None
    non_streaming_mode: bool | None = None  # None: the release's default (Base False, others True)

    prompt_ids: tuple[int, ...] | None = None
    """The tokenized text (the pipeline's tokenizer), set by ``plan``; None: not tokenized yet
    (or a pipeline without a text prompt of token ids)."""

    budget: "FrameBudget | None" = None
    """The most frames it may take, planned once from its text (``plan``: the service's request plan
    sets it); ``submit`` checks it against what the pipeline allows and admission uses it as it is.
    None: not planned yet (``submit`` plans it), or a pipeline that plans its own frames (the DiT)."""

    # Fairness: who asked, for identity-fair slot ordering (core/scheduler.py).
    # The service sets the API key digest or the client address; "" = no identity (FIFO).
    tenant: str = ""
    # Talker prompt-prefix cache namespace (engines/models/prefix_cache.py): K/V of a prompt
    # prefix is shared only between requests with the same owner. None = ``tenant``. A cloned
    # voice (``clone``) with an empty owner is never cached. The service sets the API key's
    # digest for saved voices, and may set "" for built-in speakers so every key shares them.
    prefix_owner: str | None = None

    timestamps: bool = False
    """Word timestamps wanted: the final chunk carries the :class:`Alignment` of the request's
    text with its audio (only where ``capabilities.timestamps``; otherwise ignored, no times)."""

    # --- live text: the text is still arriving; ``text`` is then unused ---
    text_feed: "TextFeed | None" = None
    """Talker pipeline only: the utterance starts speaking from the first committed text
    tokens and consumes later ones as they arrive (streaming-text mode)."""


class FrameBudget(NamedTuple):
    """The most frames one utterance may take, planned once from its own text before it is
    submitted (the talker: engines/pipelines/talker/budget.py) and carried by its request."""

    frames: int  # the most frames it may take
    bound: str  # what sets ``frames``: "budget" (its text's), "max_new_tokens" (- 1) or "max_seq_len"
    text_frames: int | None = None  # its text's own budget whatever caps it (None: live text, or an exact cap)


@dataclass(frozen=True)
class VoiceClone:
    """A reference voice for a Base checkpoint, its features already computed (once per voice:
    ``engine.voice_features`` caches them by content; saved voices store them).

    ``ref_codes`` None = x-vector-only cloning; otherwise in-context cloning with ``ref_text``,
    the transcript of the reference audio."""

    xvector: np.ndarray  # [D] float32: takes the speaker's place in the prompt
    ref_codes: np.ndarray | None = None  # [T, G] int64 speech-tokenizer codes of the reference
    ref_text: str | None = None
    key: str = ""  # content hash of the reference (cache key, logs)

    @property
    def in_context(self) -> bool:
        return self.ref_codes is not None



class TextFeed:
    """The text of a live utterance, arriving in deltas. Thread-safe.

    The service ``append``s deltas and finally calls ``finish``; the worker ``read``s
    them. ``on_change`` (set by the engine) wakes the worker when text arrives."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: list[str] = []
        self._finished = False
        self.chars = 0
        self.on_change: Callable[[], None] | None = None

    def append(self, text: str) -> None:
        with self._lock:
            if self._finished:
                raise ValueError("text after the end of the utterance's text")
            self._parts.append(text)
            self.chars += len(text)
        if self.on_change is not None:
            self.on_change()

    def finish(self) -> None:
        with self._lock:
            self._finished = True
        if self.on_change is not None:
            self.on_change()

    @property
    def finished(self) -> bool:
        return self._finished

    def read(self, start: int) -> tuple[str, int, bool]:
        """-> (text of the deltas from index ``start`` on, the next start, whether the text is
        complete). Not destructive: a re-submitted utterance reads the same feed again."""
        with self._lock:
            return "".join(self._parts[start:]), len(self._parts), self._finished


@dataclass(frozen=True)
class ChunkTiming:
    """For latency accounting: when the chunk's request was submitted (``time.monotonic()``)."""

    submitted_at: float


@dataclass(frozen=True)
class AudioChunk:
    """A piece of a request's audio, delivered in ``index`` order.

    ``pcm`` is float32 mono in [-1, 1] (possibly empty, e.g. on a final error chunk).
    ``frames_total`` is the engine's current estimate of the request's frame count;
    it is exact for the DiT source once the request is admitted and an upper bound
    for the autoregressive talker until ``is_final``.
    """

    request_id: str
    index: int
    pcm: np.ndarray
    sample_rate: int
    frames_done: int
    frames_total: int
    is_final: bool
    error: str | None = None
    timing: ChunkTiming | None = None
    text: str | None = None
    """The text span this chunk voices, when the engine knows it (first chunk of a clause)."""


    alignment: "Alignment | None" = None
    """Final chunk of a request that asked for ``timestamps``, when it could be aligned."""

    truncated: str | None = None
    """Final chunk of a talker utterance that ended before EOS, and why: ``budget`` (its frame
    budget from its text), ``max_new_tokens``, ``max_seq_len`` (its stream's positions) or
    ``loop`` (its code 0 repeated one pattern: the runaway guard). None: it ended by itself."""


@dataclass(frozen=True)
class WordTimestamp:
    """One unit the aligner timed: a word (space-separated scripts) or a character (CJK), with
    its span ``[char_start, char_end)`` in :attr:`Alignment.text` (punctuation is between units)."""

    text: str
    start_ms: float
    end_ms: float
    char_start: int
    char_end: int


@dataclass(frozen=True)
class Alignment:
    """The word times of one finished piece (a request's text with all its audio).

    Times are milliseconds from the start of the request's audio as the engine produced it
    (before any time stretch the service applies), non-decreasing, within
    ``[0, duration_ms]``. ``words`` is empty when there was nothing to time (no words, or
    no audio): never invented times."""

    text: str
    language: str
    duration_ms: float
    words: tuple[WordTimestamp, ...]

    def scaled(self, factor: float, offset_ms: float = 0.0) -> "Alignment":
        """Times x ``factor`` + ``offset_ms`` (a time stretch, the piece's place in a stream)."""
        return Alignment(self.text, self.language, self.duration_ms * factor, tuple(
            WordTimestamp(w.text, w.start_ms * factor + offset_ms, w.end_ms * factor + offset_ms,
                          w.char_start, w.char_end) for w in self.words))


Deliver = Callable[[AudioChunk], None]


class RequestHandle:
    """The service's grip on a submitted request. Thread-safe."""

    def __init__(self, request: SynthesisRequest):
        self.request = request
        self.submitted_at = time.monotonic()
        self._cancelled = threading.Event()
        self._paused = threading.Event()
        self._done = threading.Event()

    @property
    def request_id(self) -> str:
        return self.request.id

    def cancel(self) -> None:
        """Ask the worker to stop this request; its slot is freed at the next tick."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def pause(self) -> None:
        """Back-pressure: start no new chunk for this request until ``resume``."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def mark_done(self) -> None:
        """Called by the engine after the final chunk was delivered."""
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block (a non-loop thread only) until the final chunk was delivered."""
        return self._done.wait(timeout)


@dataclass(frozen=True)
class TickReport:
    """What one worker tick did; passed to tick listeners (metrics)."""

    batch_rows: int
    """Rows in the tick's model forward (2n under fused CFG)."""
    seconds: float


@dataclass(frozen=True)
class EngineCapabilities:
    """What the loaded model can do: the one description the service reads (never the engine's
    internals). Built once by the engine; identical for the engine's lifetime."""

    pipeline: str
    """``dit`` (a streamvox DiT preset) or ``talker`` (a Qwen3-TTS checkpoint)."""
    task_type: str | None
    """The Qwen3-TTS release: ``CustomVoice`` | ``VoiceDesign`` | ``Base``; None for the DiT."""
    voices: tuple[str, ...]
    voice_aliases: Mapping[str, str]
    preset_voices: bool
    """A ``voice`` name picks a preset speaker; False: the voice comes with the request
    (Base: reference audio, VoiceDesign: instructions)."""
    languages: tuple[str, ...] | None
    """The ``language`` values the model knows; None: it reads any language (no field)."""
    honoured_fields: frozenset[str]
    """The :class:`SynthesisRequest` fields that change this model's output. A field outside it is
    ignored, except ``speed``, which such a model refuses (the service time-stretches instead)."""
    max_slots: int
    """Requests batched together at most."""
    max_new_tokens: int | None = None
    """The talker's default cap per request (it emits at most ``max_new_tokens - 1`` frames); None
    when the pipeline plans its frames from the text (the DiT)."""
    sampling_defaults: Mapping[str, float | int | bool] | None = None
    """What a request without sampling fields gets (the talker checkpoint's generation_config.json
    for code 0): ``greedy``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``; None when
    the pipeline does not sample (the DiT)."""
    instructions: bool = False
    """``instructions`` change the voice (a VoiceDesign release, a 1.7B CustomVoice)."""
    voice_cloning: bool = False
    """``clone`` (reference audio) is served: a Base release."""
    live_text: bool = False
    """``text_feed`` (text still arriving) is served."""
    random_components: tuple[str, ...] = ()
    """Components running on random (untrained) weights; empty when all are trained."""
    timestamps: bool = False
    """Word timestamps are served (an aligner is loaded): ``SynthesisRequest.timestamps``."""
    timestamp_languages: tuple[str, ...] = ()
    """The languages the aligner times (lower case); empty without an aligner."""
    aligner: str | None = None
    """The loaded aligner (a directory or model id); None: no timestamps."""
    title: str = ""
    """How people name the pipeline (``DiT``); empty: "<pipeline> pipeline"."""
    named_by_preset: bool = False
    """The model is its preset's sizes, a checkpoint at most a part of it (the DiT: its denoiser on
    random or streamvox weights): people name it by pipeline and preset, never by the checkpoint."""

    def honours(self, field_name: str) -> bool:
        return field_name in self.honoured_fields


@dataclass(frozen=True)
class EngineInfo:
    """Static description of a loaded engine, for ``/v1/models`` and the CLI."""

    model: str
    preset: str
    source: str
    device: str
    dtype: str
    sample_rate: int
    voices: tuple[str, ...]
    voice_aliases: Mapping[str, str]
    random_components: tuple[str, ...]
    """Components running on random (untrained) weights; empty when all are trained."""
    max_queue: int
    max_slots: int | None = None
    """Requests the engine batches together at most; None if unknown."""
    backend: str | None = None
    """The runtime of the DiT and codec decoder (torch | onnxruntime | tensorrt); None if not recorded."""
    latent_dim: int | None = None
    num_code_groups: int | None = None
    batch_ceiling: int | None = None
    warmup_rtf: float | None = None
    """Wall seconds per audio second of a request alone after the warm-up (CPU start only: the speed
    one stream can expect); None otherwise."""
    quantize: str = "none"
    """The talker's and code predictor's weights: ``none`` (the dtype's own), ``int8``, ``int4`` or
    ``int8-int4p``."""
    codec_dtype: str | None = None
    """The codec decoder's precision (``float32`` / ``bfloat16``); None if not recorded."""
    threads: str | None = None
    """CPU: the talker's and the codec decoder's threads and where the decoder runs
    (``talker 1, codec 1 (a process)``); None elsewhere."""

    @property
    def pipeline(self) -> str:
        """The pipeline behind the engine: ``dit`` or ``talker`` (its latent ``source``)."""
        return self.source

    @property
    def slots(self) -> int | None:
        """Requests the engine batches together at most; None if unknown."""
        return self.max_slots


@dataclass(frozen=True)
class EngineStats:
    """A point-in-time snapshot, cheap to take from any thread."""

    alive: bool
    ready: bool
    queue_depth: int
    active_requests: int
    active_slots: int
    ticks: int
    error: str | None = None


class ReferenceFeatures(Protocol):
    """What ``voice_features`` returns (engines/checkpoints/qwen3_voice.py VoiceFeatures)."""

    xvector: np.ndarray  # [D] float32
    codes: np.ndarray  # [T, G] int64 speech-tokenizer codes


class PlannedWork(NamedTuple):
    """What one request will ask of the engine, known before any of it runs (no model call)."""

    audio_frames: int  # codec frames the vocoder decodes (80 ms each): the same cost whatever made them
    model_steps: int  # the latent model's work, in ``step_unit``
    step_unit: str  # "DiT frame-steps" (frames x denoising steps) or "talker steps" (one per frame)


class SynthesisEngine(Protocol):
    """What the service needs from an engine (see :mod:`engines.core.engine`)."""

    info: EngineInfo
    capabilities: EngineCapabilities

    def start(self) -> None:
        """Load, warm up and start the worker thread; returns when ready."""

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything, stop the worker thread and release the device."""

    def validate(self, request: SynthesisRequest, complete: bool = True) -> SynthesisRequest:
        """The request checked against the loaded model (voice, language, task, live text, whether
        its prompt and its frame budget fit), planned (:meth:`plan`) unless it was: what ``submit``
        does first. InvalidRequest naming the field.
        ``complete=False``: the fields present only (a WebSocket ``session.config``): nothing that
        a later field may bring (reference audio, instructions) is required, no text tokenized."""

    def submit(self, request: SynthesisRequest, deliver: Deliver) -> RequestHandle:
        """Check a request once (:meth:`validate`) and queue it; never blocks.
        Raises InvalidRequest / EngineOverloaded / EngineUnavailable."""

    def voice_features(self, audio: np.ndarray) -> ReferenceFeatures:
        """x-vector and reference codes of float32 mono 24 kHz audio (``capabilities.voice_cloning``);
        blocking (call it off the event loop); InvalidRequest when the model cannot clone."""

    def planned_work(self, request: SynthesisRequest) -> PlannedWork:
        """What ``request`` will cost (vocoder frames, model steps), without running the model:
        the service's work limits are checked on it before any engine time is spent."""

    def plan(self, request: SynthesisRequest) -> SynthesisRequest:
        """``request`` planned as this engine runs it, nothing else checked: its text tokenized
        (``prompt_ids``) and its frame budget (``budget``), each unless it carries them (a pipeline
        that plans its own frames, the DiT, sets neither). The service plans every utterance so
        and submits it as planned: a text is tokenized, and its budget counted, once."""

    def stage_seconds(self) -> dict[str, float]:
        """Worker wall seconds per loop stage since start, and the codec decoder's own (``decode``)
        (metrics)."""

    def kv_cache_stats(self) -> dict[str, float]:
        """The KV pool's figures (talker); empty when the pipeline has none."""

    def graph_captures_after_start(self) -> int:
        """CUDA graphs captured after start, on first use (metrics; serving keeps it at 0)."""

    def stats(self) -> EngineStats: ...

    def add_tick_listener(self, listener: Callable[[TickReport], None]) -> None:
        """Call ``listener`` on the worker thread after every tick (keep it cheap)."""

    def resolve_voice(self, name: str) -> str:
        """Canonical voice name for ``name`` (aliases allowed); InvalidRequest if unknown."""
