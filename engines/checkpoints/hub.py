"""Model names -> local checkpoint directories.

A model is named either by a local path (a Qwen3-TTS directory or a streamvox weights file,
used as it is) or by a Hugging Face repo id with an optional revision,
``ORG/NAME[@REVISION]`` (e.g. ``Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice@main``), which is
fetched into the standard Hugging Face cache by ``huggingface_hub`` and loaded from there:

    from engines.checkpoints.hub import resolve, resolve_model
    path = resolve_model("Qwen/Qwen3-TTS-12Hz-0.6B-Base")    # Path of the cached snapshot
    served = resolve(None)    # the default model, or Served(None, None): random weights, logged

Everything the Hugging Face tools honour applies: ``HF_HOME`` / ``HF_HUB_CACHE`` (where),
``HF_TOKEN`` (gated or private repos), ``HF_HUB_OFFLINE=1`` (cache only), ``HF_ENDPOINT``
(a mirror), ``HF_HUB_ETAG_TIMEOUT``. Only the files the loaders of this package read are
fetched (:data:`ALLOW_PATTERNS`), never a release's extras. A connection dropped mid-file is
resumed with a Range request by huggingface_hub itself.

Errors a user can cause or fix (unknown id, gated repo, no network, offline with nothing
cached) are :class:`ModelUnavailable`, whose message is one line that says what to do.

``huggingface_hub`` is imported inside the functions: ``streamvox --help`` and a server on a
local directory never pay for it.
"""

from __future__ import annotations

import functools
import logging
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("streamvox.hub")

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
"""What `serve` and `synthesize` load when no model is named."""

RANDOM = "random"
"""``--model random``: no checkpoint, the built-in preset on random weights (no hub look-up)."""

DEFAULT_PROBE_SECONDS = 3.0
"""How long the unnamed default may wait for the hub before the server starts on random
weights instead. The whole look-up is bounded, DNS included, so an unreachable, refusing or
blackholed hub costs at most this at start-up."""

# What engines/checkpoints reads from a release directory, and nothing else: a release also
# carries README/.gitattributes, preprocessor configs, sometimes other formats.
ALLOW_PATTERNS: tuple[str, ...] = (
    "config.json",                                    # qwen3_tts.read_configs, load_talker, qwen3_voice
    "generation_config.json",                         # TalkerGenerationConfig.from_dir
    "model.safetensors",                              # files.SafetensorsFiles (talker, speaker encoder)
    "model.safetensors.index.json",                   # ... sharded
    "model-*-of-*.safetensors",
    "vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json",   # qwen3_text.QwenTextTokenizer
    "speech_tokenizer/config.json",                   # decoder / encoder configs
    "speech_tokenizer/model.safetensors",             # decoder.*, encoder.*
    "speech_tokenizer/model.safetensors.index.json",
    "speech_tokenizer/model-*-of-*.safetensors",
    "streamvox.safetensors",                          # trained DiT side, when a repo ships one
)

# Without these two a directory is not a Qwen3-TTS 12 Hz release (whatever else it holds).
_REQUIRED = ("config.json", "speech_tokenizer/config.json")
_TTS_RELEASE = "a Qwen3-TTS 12 Hz release"
_TTS_HINT = "the Qwen/Qwen3-TTS-12Hz-* models are"

# ORG/NAME[@REVISION]; the hub's own validation (length, "--", "..") runs on top.
_MODEL_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^\s@]+))?$")


class ModelUnavailable(ValueError):
    """A named model cannot be had; the message is one line saying why and what to do."""


@dataclass(frozen=True)
class ModelId:
    repo_id: str
    revision: str | None = None  # None: the repo's default branch (main)

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class Served:
    """What a server or synthesizer runs: ``path`` None = the built-in preset on random
    weights; ``name`` is the model as named (a hub id or the path given), for clients."""

    path: Path | None
    name: str | None


def parse_model_id(name: str) -> ModelId | None:
    """``ORG/NAME[@REVISION]`` -> ModelId; None when ``name`` does not have that shape."""
    match = _MODEL_ID.match(name.strip())
    if not match:
        return None
    return ModelId(match["repo"], match["revision"])


def served_name(name: str | None) -> str | None:
    """The name clients may use for ``name``: a hub id without its revision, else as given."""
    if not name:
        return None
    model = parse_model_id(name)
    return model.repo_id if model and _local_path(name) is None else name


def resolve(name: str | None, *, default: str = DEFAULT_MODEL) -> Served:
    """What to serve for ``--model``: unset = ``default`` from the cache, else fetched, else
    (hub unreachable, offline, unknown...) random weights with one warning line;
    ``random`` = random weights; anything else must resolve (:func:`resolve_model`)."""
    if not name or not name.strip():
        path = resolve_default(default)
        return Served(path, default if path else None)
    if name.strip() == RANDOM:
        return Served(None, None)
    return Served(resolve_model(name), name)


def _local_path(name: str) -> Path | None:
    """``name`` as an existing local path, else None (also for names no file system could hold:
    too long, a NUL; those are then judged as model ids, with one line when they are not)."""
    try:
        local = Path(name).expanduser()
        return local if local.exists() else None
    except (OSError, ValueError):
        return None


def resolve_model(name: str, *, required: tuple[str, ...] = _REQUIRED, release: str = _TTS_RELEASE,
                  hint: str = _TTS_HINT) -> Path:
    """A local path as it is, or a hub id's cached snapshot (fetched when missing or when the
    revision moved). Raises ModelUnavailable (one line) when it cannot be had.
    ``required``: the files without which a snapshot is not ``release`` (another kind of
    model, e.g. the forced aligner, names its own; ``hint`` says which ids are)."""
    kind = (required, release, hint)
    local = _local_path(name)
    if local is not None:
        return local
    model = parse_model_id(name)
    if model is None:
        if name.startswith(("/", ".", "~")):
            raise ModelUnavailable(f"{name}: no such file or directory")
        raise ModelUnavailable(f"{name}: neither a local path nor a Hugging Face model id (ORG/NAME[@REVISION])")
    _check_id(model)
    from huggingface_hub import constants

    if _offline():
        path = _cached(model, required)
        if path is None:
            raise ModelUnavailable(f"{model}: HF_HUB_OFFLINE is set and it is not in the cache "
                                   f"({constants.HF_HUB_CACHE}); fetch it first where the hub is reachable: "
                                   f"streamvox download {model}")
        log.info("%s: from the cache (HF_HUB_OFFLINE): %s", model, path)
        return path
    commit, error = _ask_hub(model, float(constants.HF_HUB_ETAG_TIMEOUT))
    if error is not None:
        if not _is_network(error):
            raise ModelUnavailable(_explain(model, error))
        path = _cached(model, required)
        if path is None:
            raise ModelUnavailable(_explain(model, error))
        log.warning("%s: the hub at %s did not answer (%s); using the cached copy %s",
                    model, constants.ENDPOINT, _short(error), path)
        return path
    return _download(model, commit, kind)


def resolve_default(model_name: str = DEFAULT_MODEL) -> Path | None:
    """The default model's directory, or None (logged once) when it can't be had at once:
    from the cache without any network call, else fetched if the hub answers within
    DEFAULT_PROBE_SECONDS. Never raises for a missing model: the caller serves random weights."""
    model = parse_model_id(model_name)
    assert model is not None, model_name
    fallback = ("serving the built-in preset on RANDOM weights (not speech); name a model with --model "
                "(or --model random to skip this look-up)")
    path = _cached(model)
    if path is not None:
        log.info("no model named: serving the default %s from the cache (%s)", model, path)
        return path
    if _offline():
        log.warning("no model named, HF_HUB_OFFLINE is set and the default %s is not cached: %s", model, fallback)
        return None
    commit, error = _ask_hub(model, DEFAULT_PROBE_SECONDS)
    if error is None:
        try:
            return _download(model, commit)
        except ModelUnavailable as exc:
            log.warning("no model named and the default %s could not be fetched (%s): %s", model,
                        str(exc).removeprefix(f"{model}: "), fallback)
            return None
    reason = _explain(model, error, cached=False).removeprefix(f"{model}: ")
    log.warning("no model named and the default %s is not cached; %s: %s", model, reason, fallback)
    return None


# --------------------------------------------------------------------------- internals

def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _check_id(model: ModelId) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model.repo_id)
    except HFValidationError as exc:
        raise ModelUnavailable(f"{model}: not a valid Hugging Face model id ({_short(exc)})") from None


def _ask_hub(model: ModelId, timeout: float) -> tuple[str | None, BaseException | None]:
    """(the commit the revision points at, None), or (None, why not). Bounded by ``timeout``
    in total: name resolution can hang far past any socket timeout, so the call runs in a
    daemon thread that is abandoned when it overstays."""
    from huggingface_hub import HfApi

    outcome: list[tuple[str | None, BaseException | None]] = []

    def ask() -> None:
        try:
            outcome.append((HfApi().model_info(model.repo_id, revision=model.revision, timeout=timeout).sha, None))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, whatever it is
            outcome.append((None, exc))

    thread = threading.Thread(target=ask, name="streamvox-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        return None, TimeoutError(f"no answer within {timeout:g} s")
    return outcome[0]


def _is_network(error: BaseException) -> bool:
    """No HTTP answer at all (DNS, refused, timeout, dropped), as opposed to the hub saying no.
    Told by the exception's package, so it holds whichever HTTP client huggingface_hub uses."""
    if isinstance(error, (TimeoutError, ConnectionError, socket.gaierror)):
        return True
    return type(error).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3")


def _cached(model: ModelId, required: tuple[str, ...] = _REQUIRED) -> Path | None:
    """The complete cached snapshot of ``model`` at its revision, without touching the network."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(model.repo_id, revision=model.revision, allow_patterns=list(ALLOW_PATTERNS),
                                      local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, partly cached, unreadable: all mean "not here"
        return None
    return path if not _missing(path, required) else None


def _missing(path: Path, required: tuple[str, ...] = _REQUIRED) -> list[str]:
    return [name for name in required if not (path / name).is_file()]


def _download(model: ModelId, commit: str | None = None,
              kind: tuple[tuple[str, ...], str, str] = (_REQUIRED, _TTS_RELEASE, _TTS_HINT)) -> Path:
    """Fetch what is missing of ``model`` (``commit``: where the hub says its revision is)."""
    from huggingface_hub import constants, snapshot_download

    required, release, hint = kind
    cached = _cached(ModelId(model.repo_id, commit), required) if commit else None
    if cached is not None:  # still through snapshot_download below: it records the revision -> commit ref
        log.info("%s: up to date in the cache (%s)", model, cached)
    else:
        log.info("%s: fetching from %s into %s (only the files streamvox loads)", model, constants.ENDPOINT,
                 constants.HF_HUB_CACHE)
    started = time.monotonic()
    try:
        path = Path(snapshot_download(model.repo_id, revision=model.revision, allow_patterns=list(ALLOW_PATTERNS),
                                      tqdm_class=_progress_class(str(model))))
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line
        raise ModelUnavailable(_explain(model, exc)) from None
    missing = _missing(path, required)
    if missing:
        raise ModelUnavailable(f"{model}: not {release} (no {', '.join(missing)}); {hint}")
    if cached is None:
        log.info("%s: ready in %.1f s at %s", model, time.monotonic() - started, path)
    return path


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def _explain(model: ModelId, error: BaseException, cached: bool = True) -> str:
    """One line: what went wrong with ``model`` and what to do about it."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hub = constants.ENDPOINT
    status = _status(error)
    code = f" ({status})" if status else ""
    not_cached = f" and it is not in the cache ({constants.HF_HUB_CACHE})" if cached else ""
    if isinstance(error, GatedRepoError):
        who = "HF_TOKEN's account has no access" if status == 403 else "it needs an access token"
        return (f"{model} is gated on {hub}{code}: {who}; accept its terms at {hub}/{model.repo_id} "
                "and set HF_TOKEN to a token of that account")
    if isinstance(error, RevisionNotFoundError):
        return f"{model}: revision {model.revision or 'main'!r} not found on {hub}{code}"
    if isinstance(error, RepositoryNotFoundError):
        private = "; a private model needs HF_TOKEN" if status == 401 else ""
        return f"{model}: no such model on {hub}{code}: check the id (ORG/NAME[@REVISION]){private}"
    if isinstance(error, HfHubHTTPError):
        if status in (401, 403):
            return f"{model}: {hub} refused access{code}: set HF_TOKEN to a token that can read it"
        return f"{model}: {hub} answered {status or 'an error'} ({_short(error)})"
    cause = error.__cause__ or error.__context__
    if isinstance(error, OfflineModeIsEnabled) or isinstance(cause, OfflineModeIsEnabled):
        return (f"{model}: HF_HUB_OFFLINE is set{not_cached}; fetch it first where the hub is reachable: "
                f"streamvox download {model}")
    if isinstance(error, LocalEntryNotFoundError) and cause is not None:
        error = cause
    if type(error).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 2: an interrupted fetch
        return f"{model}: the cached copy is incomplete and {hub} cannot be reached; run streamvox download {model}"
    if _is_network(error):
        return f"{model}: cannot reach the hub at {hub} ({_short(error)}){not_cached}"
    return f"{model}: download failed ({_short(error)})"


def _short(error: BaseException) -> str:
    """The first line of an error, with its type when the text alone says little."""
    text = (str(error).strip().splitlines() or [""])[0]
    name = type(error).__name__
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{name}: {text}" if text else name


# --------------------------------------------------------------------------- progress

def _progress_class(label: str):
    """huggingface_hub's bars on a terminal (None: its default); log lines otherwise (a file,
    a container's log), where redrawn bars would be noise and lines tell the operator more."""
    if sys.stderr.isatty():
        return None
    return type("StreamvoxDownloadProgress", (_log_progress(),), {"label": label})


class _Discard:
    def write(self, _text: str) -> None:
        pass

    def flush(self) -> None:
        pass


@functools.cache
def _log_progress():
    """The log-line progress class (built on first use: tqdm is only needed for a download)."""
    from tqdm.auto import tqdm  # a dependency of huggingface_hub

    class LogProgress(tqdm):
        """A tqdm that draws nothing and logs its byte count every EVERY_S seconds and once done.

        huggingface_hub creates a files counter and byte counters from this class; only the
        bytes-written counter is logged (the files counter and the bytes-received one, which
        repeats it, are not).
        """

        label = "model"
        EVERY_S = 5.0

        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["file"] = _Discard()
            self._last_log = time.monotonic()  # the first line after EVERY_S: totals grow as files start
            self._done_logged = False
            self._logs = kwargs.get("unit") == "B" and not str(kwargs.get("desc") or "").startswith("Downloading bytes")
            super().__init__(*args, **kwargs)

        def display(self, msg=None, pos=None):  # tqdm's only drawing hook
            if not self._logs or self.n <= 0:
                return True
            now = time.monotonic()
            # huggingface_hub adds each file's size to the total as its download starts (threads, in
            # parallel) and says "incomplete total" meanwhile: a small file done first is not 100 %
            finished = bool(self.total) and self.n >= self.total and "incomplete total" not in str(self.desc or "")
            if finished and self._done_logged:
                return True
            if finished or now - self._last_log >= self.EVERY_S:
                self._last_log = now
                self._done_logged = finished
                total = self.format_sizeof(self.total, "B", 1024) if self.total else "?"
                share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
                rate = self.format_dict.get("rate")
                speed = f" at {self.format_sizeof(rate, 'B/s', 1024)}" if rate else ""
                log.info("%s: downloaded %s of %s%s%s", self.label, self.format_sizeof(self.n, "B", 1024), total,
                         share, speed)
            return True

    return LogProgress


__all__ = ["ALLOW_PATTERNS", "DEFAULT_MODEL", "DEFAULT_PROBE_SECONDS", "RANDOM", "ModelId", "ModelUnavailable",
           "Served", "parse_model_id", "resolve", "resolve_default", "resolve_model", "served_name"]
