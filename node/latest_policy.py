"""The node's latest policy, kept where `hivespec export` finds it: ``<home>/policy.json`` and its weights.

When a run ends (the rounds are done, or a stop ended the loop), `keep_node_policy(node)` writes
``<home>/policy.json``, a `PolicyRecord`: what the policy is (policy version = optimizer steps,
rounds run, the engine's policy hash as round events report it) and where it came from (model,
revision and resolved hub commit, fingerprint, task mix, sampling and training settings, swarm,
node name and peer id), and which file holds its weights:

- the newest checkpoint's ``model.safetensors`` when that checkpoint holds exactly the trainer's
  weights now (``checkpoint.at_exit``, or a save after the last round): nothing is written twice;
- else ``<home>/policy/model.safetensors``: the trainer's master weights alone (no optimizer,
  no RNGs), which is what a node with full checkpoints off (the demo preset) keeps.

Both files are written to a temp name, fsynced and renamed, the record last, so a reader never
sees a record naming weights that are not complete; the record carries the weights file's sha256,
which `hivespec export` checks before it trusts the file. A failed write (disk full) is logged
and costs only the export: the run's result is not touched.

Owns no loop. `hivespec join` calls `keep_node_policy` once `Node.run` has returned (node/cli.py,
with and without the dashboard). Its natural home is the end of `Node.run` itself (node/runtime.py,
after the at-exit checkpoint, before `self.status.finished()`), where every embedding of `Node`
would get it; the runtime is another engineer's file, so the CLI calls it until then.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hivespec.node.config import NodeConfig, node_home
from hivespec.node.training.checkpoint import MODEL_FILE, CorruptCheckpoint, list_checkpoints, model_tensors, verify_checkpoint

log = logging.getLogger(__name__)

RECORD_FILE = "policy.json"
WEIGHTS_DIR = "policy"
FORMAT = "hivespec-policy"
FORMAT_VERSION = 1
_HASH_CHUNK = 4 * 1024 * 1024


@dataclass(frozen=True)
class PolicyRecord:
    """What a node's latest policy is, where it came from, and the file that holds its weights."""

    node: str
    peer_id: str
    swarm: str
    model: str  # model.name as configured: the embedded name, "tiny", a local folder or a hub id
    revision: str | None  # model.revision as configured
    commit: str | None  # the hub commit the model resolved to (None: not a hub model)
    fingerprint: str  # model_fingerprint of the base model and tokenizer
    policy_version: int  # optimizer steps taken (the trainer's version)
    rounds: int  # rounds this node completed
    policy_hash: str  # hex state hash of the engine weights after the last sync (round events' policy_hash)
    weights: str  # the safetensors file holding the master weights, relative to the home when inside it
    weights_sha256: str  # sha256 of that file
    train_dtype: str
    tasks: list[dict[str, Any]] = field(default_factory=list)  # tasks.mix entries as configured
    heldout_fraction: float = 0.0
    rollout: dict[str, Any] = field(default_factory=dict)  # the sampling settings the policy trained on
    train: dict[str, Any] = field(default_factory=dict)  # learning rate, foreign share, importance sampling settings
    saved_at: float = 0.0
    hivespec_version: str = ""

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, **dataclasses.asdict(self)}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PolicyRecord:
        """Parse a record; ValueError naming what is wrong."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} record")
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format version {data.get('format_version')!r}, this hivespec reads {FORMAT_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise ValueError(f"incomplete record: {exc}") from None

    def weights_path(self, home: Path) -> Path:
        path = Path(self.weights)
        return path if path.is_absolute() else home / path


def read_record(home: Path) -> PolicyRecord | None:
    """The record in ``home`` (None when there is none); ValueError when it is unreadable."""
    path = home / RECORD_FILE
    if not path.is_file():
        return None
    try:
        return PolicyRecord.from_json(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is unreadable ({exc})") from None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def keep_node_policy(node: Any) -> Path | None:
    """Keep ``node``'s current policy where `hivespec export` finds it; the record's path, None when writing failed.

    ``node`` is a `runtime.Node` (read: config, name, identity, fingerprint, trainer, sync,
    next_round, checkpoints; not imported here, so the runtime can import this module). `Node.run` calls
    it once the round loop has ended (after any checkpoint at exit), from the thread that ran
    the rounds: it reads the trainer's weights.
    """
    config: NodeConfig = node.config
    model = node.trainer.model
    facts = PolicyRecord(
        node=node.name,
        peer_id=node.identity.peer_id,
        swarm=config.swarm.swarm,
        model=config.model.name,
        revision=config.model.revision,
        commit=getattr(model.config, "_commit_hash", None) or None,
        fingerprint=node.fingerprint,
        policy_version=int(node.trainer.version),
        rounds=int(node.next_round),
        policy_hash=node.sync.engine.hash.hex(),
        weights="",
        weights_sha256="",
        train_dtype=config.model.train_dtype,
        tasks=recorded_mix(config.tasks),
        heldout_fraction=config.tasks.heldout_fraction,
        rollout=dataclasses.asdict(config.rollout),
        train={key: getattr(config.train, key) for key in (
            "learning_rate", "foreign_fraction", "importance_sampling", "tis_clip", "tis_mask", "ppo_epochs", "kl_coef")},
    )
    checkpoints = node.checkpoints.directory if getattr(node, "checkpoints", None) is not None else None
    return keep_latest_policy(node_home(config), facts, model_tensors(model), checkpoints=checkpoints)


def recorded_mix(tasks: Any) -> list[dict[str, Any]]:
    """``tasks.mix`` as a policy record keeps it: a jsonl entry that read ``tasks.jsonl_path`` names that file (its absolute
    path), so `hivespec eval` asks the held-out questions of the file the policy trained on without the config."""
    mix = [dataclasses.asdict(entry) for entry in tasks.mix]
    if tasks.jsonl_path is not None:
        path = str(Path(tasks.jsonl_path).expanduser().resolve())
        mix = [{**entry, "name": path} if entry["family"] == "jsonl" and entry["name"] is None else entry for entry in mix]
    return mix


def keep_latest_policy(
    home: Path, facts: PolicyRecord, tensors: Mapping[str, torch.Tensor], *, checkpoints: Path | None = None
) -> Path | None:
    """Write ``<home>/policy.json`` for ``facts`` with weights ``tensors``; the record's path, None when writing failed.

    ``tensors`` are the master weights by name (`checkpoint.model_tensors`). When the newest
    checkpoint in ``checkpoints`` holds exactly these tensors the record names its file;
    otherwise they are written to ``<home>/policy/model.safetensors``.
    """
    try:
        weights, digest = _checkpoint_holding(checkpoints, tensors) if checkpoints is not None else (None, "")
        if weights is None:
            weights, digest = _write_weights(home / WEIGHTS_DIR, tensors)
        relative = weights.relative_to(home) if weights.is_relative_to(home) else weights
        record = dataclasses.replace(facts, weights=str(relative), weights_sha256=digest, saved_at=time.time(),
                                     hivespec_version=hivespec_version())
        path = home / RECORD_FILE
        _write_atomic(path, record.to_json().encode())
    except (OSError, SafetensorError) as exc:
        log.error("could not keep the latest policy in %s (%s); `hivespec export` will find only older checkpoints", home, exc)
        return None
    log.info("latest policy (version %d, %d rounds) kept: %s", record.policy_version, record.rounds, weights)
    return path


def _checkpoint_holding(directory: Path, tensors: Mapping[str, torch.Tensor]) -> tuple[Path | None, str]:
    """The newest checkpoint's weights file and sha256 if it holds exactly ``tensors``, else (None, "")."""
    found = list_checkpoints(directory)
    if not found:
        return None, ""
    newest = found[-1]
    try:
        manifest = verify_checkpoint(newest)
    except CorruptCheckpoint as exc:
        log.debug("newest checkpoint %s is unusable (%s)", newest, exc)
        return None, ""
    entry = manifest["files"].get(MODEL_FILE)
    if not entry:
        return None, ""
    with safe_open(str(newest / MODEL_FILE), framework="pt") as saved:
        if set(saved.keys()) != set(tensors):
            return None, ""
        for name, tensor in tensors.items():  # bit-exact, so a version number that happens to match is not enough
            other = saved.get_tensor(name)
            if other.dtype != tensor.dtype or other.shape != tensor.shape or not torch.equal(other.view(torch.uint8), tensor.view(torch.uint8)):
                return None, ""
    return newest / MODEL_FILE, str(entry["sha256"])


def _write_weights(folder: Path, tensors: Mapping[str, torch.Tensor]) -> tuple[Path, str]:
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / MODEL_FILE
    tmp = folder / f".{MODEL_FILE}.{os.getpid()}.tmp"
    try:
        save_file(dict(tensors), str(tmp), metadata={"format": FORMAT})
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        digest = file_sha256(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final, digest


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hivespec_version() -> str:
    """The installed hivespec's version ("unknown" outside an install)."""
    try:
        return metadata.version("hivespec")
    except metadata.PackageNotFoundError:
        return "unknown"
