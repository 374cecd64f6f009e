"""Crash-safe checkpoints: everything a node needs to resume exactly where it was.

A checkpoint is one directory ``<dir>/ckpt-<NNNNNN>/`` (the number grows by one per save):

- ``model.safetensors``: the trainer's master weights, by parameter name;
- ``optimizer.safetensors``: the optimizer state flattened to ``<param name>::<key>`` tensors
  (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``);
- ``rng.safetensors``: torch (CPU and every CUDA device), numpy and ``random`` generator states;
- ``manifest.json``, written last: format version, the round to run next, the policy and sync
  versions, the model fingerprint, the optimizer's hyper-parameters, the journal and replay
  high-water marks, the foreign rollouts admitted but not trained on yet (by content hash), the
  state of registered providers (the peer table), and the sha256 and size of every file above.

Nothing is ever pickled: tensors go through safetensors, the rest through JSON. A save writes
into ``.tmp-ckpt-<NNNNNN>/``, fsyncs every file, writes the manifest, fsyncs it and the
directory, renames the directory to its final name and fsyncs the parent: a crash at any point
leaves either the complete new checkpoint or none (the leftover temp directory is removed at
the next start). Older checkpoints are pruned only after the new one is complete, down to
``keep``. Loading walks from the newest checkpoint back and takes the first whose manifest
parses and whose files all have the recorded size and sha256; each one skipped is logged with
its reason, so a torn or corrupted checkpoint costs the rounds since the previous one, never
a crash loop.

The engine's weights are not stored: after every sync they equal the trainer's cast to the
engine dtype bit for bit, so a resume recomputes them. The drafter is rebuilt from the rollout
journal (speculation is lossless, so it never changes outputs).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hivespec.node.faults import fault_point

log = logging.getLogger(__name__)

FORMAT = "hivespec-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_NAME = re.compile(r"^ckpt-(\d{6,})$")
_TMP_PREFIX = ".tmp-ckpt-"
_HASH_CHUNK = 4 * 1024 * 1024
_SEPARATOR = "::"
# Optimizer settings that pick a kernel for this machine (a fused one where the device has it), not hyper-parameters:
# a resumed trainer keeps its own, so a checkpoint resumes with the kernel of the machine it resumes on.
_KERNEL_CHOICES = frozenset({"foreach", "fused", "capturable", "differentiable"})
_SPACE_MARGIN = 1.1  # refuse a save that would leave less than 10 % slack on the disk


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or used; the message says what to do."""


class CorruptCheckpoint(Exception):
    """A checkpoint on disk failed verification; the message is the reason."""


class StateProvider(Protocol):
    """A part of the node with JSON-able state to checkpoint (e.g. the peer table and scores)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass
class Snapshot:
    """A checkpoint's content in memory: named tensors per file, and JSON-able metadata."""

    tensors: dict[str, dict[str, torch.Tensor]]
    meta: dict[str, Any]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for group in self.tensors.values() for t in group.values())


@dataclass
class Checkpoint:
    """A verified checkpoint loaded from disk."""

    path: Path
    meta: dict[str, Any]
    tensors: dict[str, dict[str, torch.Tensor]]

    @property
    def next_round(self) -> int:
        return int(self.meta["next_round"])


# ----- capture and restore ------------------------------------------------------------------


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name; tied weights appear once (safetensors refuses aliases)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    persistent = set(model.state_dict(keep_vars=True))
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name not in persistent or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensors[name] = tensor.detach().cpu().contiguous()
    return tensors


def _optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the order the optimizer's state_dict numbers them."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in name_of:
                raise CheckpointError("the optimizer holds a tensor that is not a parameter of the model; cannot name it")
            names.append(name_of[id(param)])
    return names


def optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer state as named tensors, plus its hyper-parameters and non-tensor state as JSON."""
    names = _optimizer_names(model, optimizer)
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            flat = f"{names[index]}{_SEPARATOR}{key}"
            if isinstance(value, torch.Tensor):
                tensors[flat] = value.detach().cpu().contiguous()
            elif isinstance(value, (int, float, bool)) or value is None:
                scalars[flat] = value
            else:
                raise CheckpointError(f"optimizer state {flat} is a {type(value).__name__}; only tensors and numbers can be saved")
    groups = []
    for group in state["param_groups"]:
        saved = {key: value for key, value in group.items() if key != "params"}
        saved["params"] = [names[index] for index in group["params"]]
        groups.append(saved)
    return tensors, {"param_groups": groups, "scalars": scalars}


def rng_tensors() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every RNG the node could draw from: torch CPU and CUDA, numpy's global, python's ``random``."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda{index}"] = state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, internal, gauss_next = random.getstate()
    tensors["python_state"] = torch.tensor(internal, dtype=torch.int64)
    meta = {
        "numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "gauss_next": gauss_next},
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    return tensors, meta


def restore_rng(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[f"torch_cuda{i}"] for i in range(int(meta.get("cuda_devices", 0)))]
    if cuda and torch.cuda.is_available():
        if torch.cuda.device_count() != len(cuda):
            log.warning("checkpoint has RNG states for %d CUDA devices, this machine has %d: CUDA RNG not restored",
                        len(cuda), torch.cuda.device_count())
        else:
            torch.cuda.set_rng_state_all(cuda)
    np_meta = meta["numpy"]
    np.random.set_state((
        np_meta["kind"], tensors["numpy_keys"].numpy().astype(np.uint32), np_meta["pos"],
        np_meta["has_gauss"], np_meta["cached_gaussian"],
    ))
    py_meta = meta["python"]
    random.setstate((py_meta["version"], tuple(int(v) for v in tensors["python_state"].tolist()), py_meta["gauss_next"]))


def restore_model(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy saved tensors into the model in place; names, shapes and dtypes must match exactly."""
    live = model_tensors(model)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    if set(live) != set(tensors):
        missing, extra = sorted(set(live) - set(tensors)), sorted(set(tensors) - set(live))
        raise CheckpointError(f"checkpoint tensors do not match the model (missing {missing[:3]}, unexpected {extra[:3]}): "
                              "it was made for another model")
    with torch.no_grad():
        for name, saved in tensors.items():
            target = targets[name]
            if target.shape != saved.shape or target.dtype != saved.dtype:
                raise CheckpointError(f"checkpoint tensor {name} is {tuple(saved.shape)} {saved.dtype}, the model's is "
                                      f"{tuple(target.shape)} {target.dtype}: it was made for another model or dtype")
            target.copy_(saved)


def restore_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
) -> None:
    """Rebuild the optimizer's state_dict from named tensors and load it."""
    names = _optimizer_names(model, optimizer)
    index_of = {name: i for i, name in enumerate(names)}
    live_groups = optimizer.state_dict()["param_groups"]
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(live_groups):
        raise CheckpointError(f"checkpoint has {len(saved_groups)} optimizer groups, the trainer has {len(live_groups)}")
    groups = []
    for saved, live in zip(saved_groups, live_groups):
        if [index_of.get(n) for n in saved["params"]] != live["params"]:
            raise CheckpointError("the optimizer's parameters differ from the checkpoint's: it was made for another model")
        group = dict(live)
        for key, value in saved.items():
            if key != "params" and key not in _KERNEL_CHOICES:
                group[key] = tuple(value) if isinstance(live.get(key), tuple) else value  # JSON turned tuples into lists
        groups.append(group)
    state: dict[int, dict[str, Any]] = {}
    for flat, value in [*tensors.items(), *meta["scalars"].items()]:
        name, _, key = flat.rpartition(_SEPARATOR)
        if name not in index_of:
            raise CheckpointError(f"optimizer state for unknown parameter {name!r}: the checkpoint was made for another model")
        state.setdefault(index_of[name], {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def training_snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: Mapping[str, Any]) -> Snapshot:
    """Model, optimizer and RNG states as a Snapshot; ``meta`` (JSON-able) goes into the manifest."""
    optimizer_state, optimizer_meta = optimizer_tensors(model, optimizer)
    rng_state, rng_meta = rng_tensors()
    return Snapshot(
        tensors={MODEL_FILE: model_tensors(model), OPTIMIZER_FILE: optimizer_state, RNG_FILE: rng_state},
        meta={**meta, "optimizer": optimizer_meta, "rng": rng_meta},
    )


def restore_training(checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint's weights, optimizer state and RNG states into live objects."""
    restore_model(model, checkpoint.tensors[MODEL_FILE])
    restore_optimizer(model, optimizer, checkpoint.tensors[OPTIMIZER_FILE], checkpoint.meta["optimizer"])
    restore_rng(checkpoint.tensors[RNG_FILE], checkpoint.meta["rng"])


@dataclass(frozen=True)
class RoundStart:
    """The state at the start of round `round` that a checkpoint records besides weights and optimizer.

    Captured as each round begins (cheap: ids and small dicts, no tensors), so a stop in the
    middle of the round can save exactly what a save after the previous round would have held.
    """

    round: int  # the round a resume runs next
    journal_rowid: int  # the rollout journal's high-water mark (RolloutStore.journal_high_water)
    pending: tuple[dict, ...]  # foreign rollouts admitted, not trained on: {"author", "round", "hash"} each
    providers: dict[str, Any]  # registered StateProviders' state, by name


def node_meta(
    start: RoundStart, *, policy_version: int, sync_version: int, fingerprint: str, seed: int, replay_marks: Mapping[str, int]
) -> dict[str, Any]:
    """A node checkpoint's manifest metadata: where to resume (`start`) and what must match to resume it."""
    return {
        "next_round": start.round,
        "policy_version": policy_version,
        "sync_version": sync_version,
        "fingerprint": fingerprint,
        "seed": seed,
        "journal_rowid": start.journal_rowid,
        "replay_marks": dict(replay_marks),
        "pending": list(start.pending),
        "providers": start.providers,
        "drafter": "rebuilt from the rollout journal up to journal_rowid",
        # Scores are about peers' behaviour, not training state: never rolled back, only flushed at a save.
        "peers": "kept in peers.json (node/peers.py)",
    }


def check_fingerprint(checkpoint: Checkpoint, fingerprint: str) -> None:
    """Raise CheckpointError unless `checkpoint` was made for the model and tokenizer of `fingerprint`."""
    if checkpoint.meta["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} was made for model fingerprint {checkpoint.meta['fingerprint']}, this config loads "
            f"{fingerprint}: run with --no-resume to start from the initial weights, or use another --home"
        )


# ----- files --------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_and_hash(path: Path) -> tuple[str, int]:
    """fsync a written file and hash what is on disk (read back, not what we meant to write)."""
    digest = hashlib.sha256()
    with path.open("rb+") as f:
        os.fsync(f.fileno())
        f.seek(0)
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
        size = f.tell()
    return digest.hexdigest(), size


def _hash_file(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without the checksum field: catches a flipped digit."""
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_durable(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoint directories in ``directory`` (by name; not verified), oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The manifest of ``path`` if every file it lists is present with its size and sha256; else CorruptCheckpoint."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CorruptCheckpoint(f"{MANIFEST} is missing")
    if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
        raise CorruptCheckpoint(f"{MANIFEST} is over {MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpoint(f"{MANIFEST} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CorruptCheckpoint(f"format version {manifest.get('format_version')!r}, this hivespec reads {FORMAT_VERSION}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CorruptCheckpoint(f"{MANIFEST} lists no files")
    if manifest.get("checksum") != _manifest_checksum(manifest):
        raise CorruptCheckpoint(f"{MANIFEST} does not match its own checksum (edited or damaged)")
    if not isinstance(manifest.get("next_round"), int):
        raise CorruptCheckpoint(f"{MANIFEST} has no integer next_round")
    for filename, entry in files.items():
        file = path / filename
        if not isinstance(entry, dict) or "/" in filename or not file.is_file():
            raise CorruptCheckpoint(f"{filename} is missing")
        if file.stat().st_size != entry.get("bytes"):
            raise CorruptCheckpoint(f"{filename} is {file.stat().st_size} bytes, the manifest says {entry.get('bytes')}")
        digest, _ = _hash_file(file)
        if digest != entry.get("sha256"):
            raise CorruptCheckpoint(f"{filename} has sha256 {digest[:12]}..., the manifest says {str(entry.get('sha256'))[:12]}...")
    return manifest


class CheckpointManager:
    """Saves, prunes and loads the checkpoints in one directory.

    Creating a manager removes temp directories a crashed save left behind. ``keep`` (>= 1) is
    how many complete checkpoints stay on disk after a save.
    """

    def __init__(self, directory: Path | str, *, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the previous checkpoint is the fallback), got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self._unusable: set[str] = set()  # names `load_latest` found unusable: they hold no place among the `keep`
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(f"{_TMP_PREFIX}*"):
            log.warning("removing %s, left by a save that did not finish (the process was killed mid-save)", leftover)
            shutil.rmtree(leftover, ignore_errors=True)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint directories (by name; not verified), oldest first."""
        return list_checkpoints(self.directory)

    def save(self, snapshot: Snapshot) -> Path:
        """Write ``snapshot`` as the next checkpoint; returns its directory.

        Raises CheckpointError when the disk is full or unwritable; the previous checkpoints are
        untouched then and the temp directory is removed.
        """
        existing = self.checkpoints()
        number = int(_NAME.match(existing[-1].name).group(1)) + 1 if existing else 1
        final = self.directory / f"ckpt-{number:06d}"
        tmp = self.directory / f"{_TMP_PREFIX}{number:06d}"
        previous = existing[-1].name if existing else "none"
        need = snapshot.nbytes()
        free = shutil.disk_usage(self.directory).free
        if need * _SPACE_MARGIN > free:
            raise CheckpointError(
                f"not enough disk space for a checkpoint in {self.directory}: it needs ~{need / 1e6:.0f} MB, "
                f"{free / 1e6:.0f} MB are free; the previous checkpoint ({previous}) is kept. Free some space or set "
                "checkpoint.dir to a larger disk."
            )
        started = time.perf_counter()
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            files = {}
            for filename, tensors in snapshot.tensors.items():
                save_file(tensors, str(tmp / filename), metadata={"format": FORMAT})
                digest, size = _fsync_and_hash(tmp / filename)
                files[filename] = {"sha256": digest, "bytes": size}
                fault_point(f"checkpoint.wrote.{filename.split('.')[0]}")
            fault_point("checkpoint.before_manifest")
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "created_at": time.time(),
                **snapshot.meta,
                "files": files,
            }
            manifest["checksum"] = _manifest_checksum(manifest)
            _write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            _fsync_dir(tmp)
            fault_point("checkpoint.before_rename")
            os.rename(tmp, final)
            _fsync_dir(self.directory)
        except (OSError, SafetensorError) as exc:  # safetensors reports a failed write as SafetensorError
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(self.directory).free
            reason = f"{exc.strerror} (errno {exc.errno})" if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise CheckpointError(
                f"could not write checkpoint {final}: {reason}; the previous "
                f"checkpoint ({previous}) is kept. It needs ~{need / 1e6:.0f} MB and {free / 1e6:.0f} MB are free in "
                f"{self.directory}: free some space, raise the file size limit (ulimit -f), or set checkpoint.dir "
                "to a larger disk."
            ) from exc
        fault_point("checkpoint.after_rename")
        self._prune()
        log.info("checkpoint %s saved (%.1f MB, %.2f s)", final.name, need / 1e6, time.perf_counter() - started)
        return final

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints not known unusable: a corrupt one kept in place of the good one before it
        would leave nothing to fall back to if the newest one fails too."""
        complete = self.checkpoints()
        kept = [p for p in complete if p.name not in self._unusable][-self.keep :]
        for old in complete:
            if old not in kept:
                shutil.rmtree(old, ignore_errors=True)

    def verify(self, path: Path) -> dict[str, Any]:
        """The manifest of ``path`` if every file it lists is present with its size and sha256; else CorruptCheckpoint."""
        return verify_checkpoint(path)

    def load(self, path: Path) -> Checkpoint:
        """Verify and load one checkpoint; raises CorruptCheckpoint with the reason."""
        manifest = self.verify(path)
        tensors = {}
        for filename in manifest["files"]:
            try:
                tensors[filename] = load_file(str(path / filename))
            except (SafetensorError, OSError, ValueError) as exc:
                raise CorruptCheckpoint(f"{filename} does not parse as safetensors: {exc}") from None
        return Checkpoint(path=path, meta=manifest, tensors=tensors)

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; each unusable newer one is logged with its reason."""
        candidates = self.checkpoints()
        for path in reversed(candidates):
            try:
                checkpoint = self.load(path)
            except CorruptCheckpoint as exc:
                log.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, exc)
                self._unusable.add(path.name)
                continue
            skipped = len(candidates) - 1 - candidates.index(path)
            if skipped:
                log.warning("resuming from %s after skipping %d newer unusable checkpoint(s)", path.name, skipped)
            return checkpoint
        if candidates:
            log.error("none of the %d checkpoint(s) in %s is usable: starting from the initial weights", len(candidates), self.directory)
        return None
