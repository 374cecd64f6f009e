"""`hivespec export`: a node's policy as a save_pretrained folder with a model card, and where nodes keep it.

The end-to-end test runs a real solo node (gossip included) for three rounds on the tiny model
that sometimes answers right (test_resume's digit model, so the optimizer really steps), with
full checkpoints off as in the demo preset, keeps its policy as a run's end does, exports it with
the CLI and reloads the folder with plain transformers in a fresh process: float32 logits equal
the trainer's bit for bit. The rest builds homes and checkpoints by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_resume import make_digit_model

from hivespec.node.config import InputError, load_config
from hivespec.node.credits import peer_credits
from hivespec.node.export import checkpoint_policy, export_policy, find_policy
from hivespec.node.hub import HubError, push_folder
from hivespec.node.latest_policy import RECORD_FILE, PolicyRecord, keep_latest_policy, read_record
from hivespec.node.model.loader import load_model, load_tokenizer, model_fingerprint
from hivespec.node.training.checkpoint import (
    MODEL_FILE,
    CheckpointManager,
    RoundStart,
    model_tensors,
    node_meta,
    training_snapshot,
)
from hivespec.node.training.store import RolloutStore, StoredRollout

RELOAD = """
import sys, torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(1)
folder, inputs, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
AutoTokenizer.from_pretrained(folder)
with torch.no_grad():
    save_file({"logits": model(input_ids=load_file(inputs)["ids"]).logits.contiguous()}, out)
"""


@pytest.fixture(scope="module")
def digit_model(tmp_path_factory):
    return make_digit_model(tmp_path_factory.mktemp("digit-model"))


@pytest.mark.timeout(600)  # ~10 s: a node with gossip runs three rounds, then a fresh interpreter loads transformers
def test_a_run_keeps_its_policy_and_the_export_reloads_bit_exact_in_plain_transformers(tmp_path, digit_model):
    from hivespec.node.build import build_node

    home, out = tmp_path / "home", tmp_path / "exported"
    config = load_config("tiny", overrides={
        "home": str(home), "name": "exporter", "model.name": str(digit_model), "rounds": "3", "seed": "7",
        "swarm.swarm": "test-export", "swarm.expected_peers": "0", "swarm.bootstrap_timeout": "0", "status.enabled": "false",
        # The demo preset keeps no checkpoints: the node must still keep its policy (weights only).
        "checkpoint.every_rounds": "0", "checkpoint.at_exit": "false", "checkpoint.resume": "false",
        "speculation.enabled": "false", "tasks.mix": "[{family: count, difficulty: 1}]", "rollout.prompts_per_round": "4",
    })
    node = build_node(config)
    try:
        reports = node.run()
        assert node.kept_policy == home / RECORD_FILE  # the end of Node.run keeps it, whoever ran the node
        trainer = node.trainer.model.eval()
        prompt = node.tasks.chat_prompt_ids(node.tokenizer, node.tasks.prompts(seed=1, round=0, count=1)[0])
        ids = torch.tensor([prompt + [11, 12, 13]])
        with torch.no_grad():
            expected = trainer(input_ids=ids).logits
        fingerprint, policy_hash = node.fingerprint, node.sync.engine.hash.hex()
    finally:
        node.close()

    record = read_record(home)
    assert record is not None and record.policy_version == 3 and record.rounds == 3 and record.policy_hash == policy_hash
    assert record.weights == "policy/model.safetensors" and (home / "policy" / MODEL_FILE).is_file()
    assert record.swarm == "test-export" and record.node == "exporter" and record.tasks[0]["family"] == "count"
    assert not (home / "checkpoints").exists() or not any((home / "checkpoints").iterdir())
    start = load_model(str(digit_model))
    trained = load_file(str(home / "policy" / MODEL_FILE))
    assert any(not torch.equal(trained[k], v) for k, v in model_tensors(start).items()), "the optimizer never stepped"
    assert sum(r.train.trained_samples for r in reports) > 0

    from hivespec.node.cli import main

    assert main(["export", "--home", str(home), "--out", str(out)]) == 0  # the `hivespec export` command line
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md",
            "hivespec_policy.json"} <= names
    inputs, logits = tmp_path / "ids.safetensors", tmp_path / "logits.safetensors"
    save_file({"ids": ids}, str(inputs))
    subprocess.run([sys.executable, "-P", "-c", RELOAD, str(out), str(inputs), str(logits)], check=True, timeout=300,
                   env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert torch.equal(load_file(str(logits))["logits"], expected)  # float32: bit for bit

    # `hivespec join --model DIR` loads it, under the fingerprint the node trained with: it joins the same swarm.
    assert model_fingerprint(load_model(str(out)).config, load_tokenizer(str(out))) == fingerprint
    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and "hivespec" in card.data.tags
    assert "| policy version | 3 (optimizer steps taken) |" in card.text and policy_hash in card.text
    assert "test-export" in card.text and "exporter" in card.text and "trained on its own rollouts only" in card.text


# ----- by hand: records, checkpoints, credits, the hub ----------------------------------------------


def _facts(model, tokenizer) -> PolicyRecord:
    return PolicyRecord(node="n0", peer_id="peer-self", swarm="s", model="tiny", revision=None, commit=None,
                        fingerprint=model_fingerprint(model.config, tokenizer), policy_version=3, rounds=3, policy_hash="ab" * 32,
                        weights="", weights_sha256="", train_dtype="float32", tasks=[{"family": "arith", "difficulty": 1, "weight": 1.0}])


@pytest.fixture
def tiny():
    model, tokenizer = load_model("tiny"), load_tokenizer("tiny")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    return model, tokenizer


def _save_checkpoint(directory: Path, model, fingerprint: str, *, version: int, rounds: int) -> Path:
    meta = node_meta(RoundStart(rounds, 0, (), {}), policy_version=version, sync_version=version, fingerprint=fingerprint,
                     seed=0, replay_marks={})
    return CheckpointManager(directory).save(training_snapshot(model, torch.optim.AdamW(model.parameters()), meta))


def test_a_checkpoint_holding_the_same_weights_is_named_not_copied(tmp_path, tiny):
    model, tokenizer = tiny
    home = tmp_path / "home"
    facts = _facts(model, tokenizer)
    saved = _save_checkpoint(home / "checkpoints", model, facts.fingerprint, version=3, rounds=3)
    keep_latest_policy(home, facts, model_tensors(model), checkpoints=home / "checkpoints")
    record = read_record(home)
    assert record.weights == f"checkpoints/{saved.name}/{MODEL_FILE}" and not (home / "policy").exists()
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # trained on after the save: the checkpoint no longer holds these weights
    keep_latest_policy(home, facts, model_tensors(model), checkpoints=home / "checkpoints")
    assert read_record(home).weights == "policy/model.safetensors"
    assert torch.equal(load_file(str(home / "policy" / MODEL_FILE))["model.norm.weight"], model.model.norm.weight)
    assert find_policy(home).weights == home / "policy" / MODEL_FILE


def test_export_takes_a_later_checkpoint_over_an_older_record_and_checks_what_it_reads(tmp_path, tiny):
    model, tokenizer = tiny
    home = tmp_path / "home"
    facts = _facts(model, tokenizer)
    keep_latest_policy(home, facts, model_tensors(model))
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    _save_checkpoint(home / "checkpoints", model, facts.fingerprint, version=5, rounds=5)  # then killed before its record
    source = find_policy(home)
    assert source.origin == "checkpoint ckpt-000001" and source.recorded and source.record.policy_version == 5
    assert source.record.policy_hash == ""  # the record's hash is of version 3
    out = export_policy(source, tmp_path / "out").out
    assert torch.equal(load_file(str(out / "model.safetensors"))["model.norm.weight"], model.model.norm.weight)

    with pytest.raises(InputError, match="not an empty folder"):
        export_policy(source, out)
    (tmp_path / "afile").write_text("")
    with pytest.raises(InputError, match="its folder '.*afile' is a file"):
        export_policy(source, tmp_path / "afile" / "out")
    if Path("/proc/self").is_dir():  # a folder that looks writable (to root) but takes no new entries
        with pytest.raises(InputError, match="--out '/proc/hivespec-export'"):
            export_policy(source, Path("/proc/hivespec-export"))
    policy = home / "policy" / MODEL_FILE
    policy.write_bytes(policy.read_bytes()[:-1] + b" ")
    (home / "checkpoints").rename(tmp_path / "elsewhere")
    with pytest.raises(InputError, match="damaged or was replaced"):
        export_policy(find_policy(home), tmp_path / "out2")
    assert not (tmp_path / "out2").exists() and not list(tmp_path.glob(".out2*"))  # nothing half-written is left
    with pytest.raises(InputError, match="holds no policy"):
        find_policy(tmp_path / "elsewhere")


def test_a_bare_checkpoint_needs_its_base_model_and_the_right_one(tmp_path, tiny):
    model, tokenizer = tiny
    fingerprint = model_fingerprint(model.config, tokenizer)
    saved = _save_checkpoint(tmp_path / "ckpts", model, fingerprint, version=2, rounds=2)
    source = checkpoint_policy(tmp_path / "ckpts")
    assert source.weights == saved / MODEL_FILE and not source.recorded
    with pytest.raises(InputError, match="pass --model"):
        export_policy(source, tmp_path / "out")
    other = tmp_path / "other-model"
    bigger = load_model("tiny")
    bigger.config.rms_norm_eps = 1e-5  # another architecture config: another fingerprint
    bigger.save_pretrained(other)
    tokenizer.save_pretrained(other)
    with pytest.raises(InputError, match="fingerprint"):
        export_policy(source, tmp_path / "out", model=str(other))
    result = export_policy(source, tmp_path / "out", model="tiny", dtype="bfloat16")
    assert load_file(str(result.out / "model.safetensors"))["model.norm.weight"].dtype == torch.bfloat16
    assert "not recorded by the node" in (result.out / "README.md").read_text()


def test_credits_count_accepted_rollouts_per_author_and_trained_samples_per_round(tmp_path):
    home = tmp_path / "home"
    home.mkdir()

    def row(author: str, n: int, own: bool = False) -> StoredRollout:
        return StoredRollout(bytes([n, len(author)]) * 16, author, 0, "p", 0, 1.0, own, 3, b"x", 0.0)

    with RolloutStore(home / "rollouts.sqlite") as store:
        store.add_rollouts([row("peer-a", i) for i in range(5)] + [row("peer-b", 10 + i) for i in range(2)]
                           + [row("self", 20 + i, own=True) for i in range(4)])
    events = [
        {"event": "round", "round": 0, "importance_by_source": {"own": {"samples": 8}, "peer-a": {"samples": 4}}},
        {"event": "round", "round": 1, "importance_by_source": {"own": {"samples": 8}, "peer-a": {"samples": 9}}},
        {"event": "round", "round": 1, "importance_by_source": {"own": {"samples": 8}, "peer-a": {"samples": 2}}},  # re-run
        {"event": "round", "round": 2, "importance_by_source": {"own": {"samples": 8}, "peer-c": {"samples": 1}}},
        {"event": "phase", "phase": "training"},
    ]
    (home / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + "{torn")
    credits = peer_credits(home, rounds=2)
    assert [(p.peer_id, p.accepted, p.trained) for p in credits.peers] == [("peer-a", 5, 6), ("peer-b", 2, 0)]
    assert credits.own_rollouts == 4 and credits.own_trained == 16
    assert peer_credits(home).peers[-1].peer_id == "peer-c"  # round 2 counts without a bound
    (home / "events.jsonl").unlink()
    assert peer_credits(home).peers[0].trained is None  # no events log: unknown, not zero


def test_push_to_hub_uploads_the_folder_and_says_what_is_missing(tmp_path, monkeypatch):
    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create", repo_id, kwargs))

        def upload_folder(self, **kwargs):
            calls.append(("upload", kwargs["repo_id"], kwargs))
            return type("Commit", (), {"commit_url": "https://huggingface.co/alice/p/commit/abc"})()

    assert push_folder(tmp_path, "alice/p", private=True, commit_message="m", api=FakeApi()).endswith("/commit/abc")
    assert calls[0] == ("create", "alice/p", {"repo_type": "model", "private": True, "exist_ok": True})
    assert calls[1][2]["folder_path"] == str(tmp_path) and calls[1][2]["commit_message"] == "m"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored token either
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(HubError, match="no Hugging Face token"):
        push_folder(tmp_path, "alice/p")
    with pytest.raises(HubError, match="not a Hub repo id"):
        push_folder(tmp_path, "no-owner", api=FakeApi())
