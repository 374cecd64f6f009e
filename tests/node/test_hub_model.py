"""Models and datasets by Hugging Face id, offline: a local hub cache built here stands in for the hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hivespec.node.hub import HubError, looks_like_repo_id
from hivespec.node.model.loader import (
    TINY_MODEL,
    load_model,
    load_tokenizer,
    model_fingerprint,
    stop_token_ids,
)

REPO = "hivespec-test/tiny-chat"
COMMITS = ("a" * 40, "b" * 40)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache holding REPO at two commits (main -> the second), the tiny model with a generation config."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    tokenizer = load_tokenizer(TINY_MODEL)
    model = load_model(TINY_MODEL, seed=3)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 1]  # an extra end-of-turn token
    for commit in COMMITS:
        snapshot = repo / "snapshots" / commit
        model.save_pretrained(snapshot)
        tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMITS[1])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_model_loads_by_hub_id_from_the_cache(hub_cache: Path) -> None:
    tokenizer = load_tokenizer(REPO)
    model = load_model(REPO)
    reference = load_model(TINY_MODEL, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True))
    assert model.config._commit_hash == COMMITS[1]  # main
    assert tokenizer.chat_template, "the chat template comes from the tokenizer"
    assert stop_token_ids(tokenizer, model.generation_config) == (tokenizer.eos_token_id, 1)
    from hivespec.node.model.footprint import parameter_count

    assert parameter_count(REPO) == sum(p.numel() for p in model.parameters())  # `hivespec doctor` reads the snapshot


def test_the_fingerprint_covers_the_resolved_revision(hub_cache: Path) -> None:
    tokenizer = load_tokenizer(REPO)
    pinned = load_model(REPO, revision=COMMITS[0])
    main = load_model(REPO)
    assert pinned.config._commit_hash == COMMITS[0]
    fingerprints = {model_fingerprint(m.config, tokenizer) for m in (pinned, main)}
    assert len(fingerprints) == 2, "same architecture, other weights: peers must not mix"
    assert model_fingerprint(load_model(REPO, revision=COMMITS[0]).config, tokenizer) == model_fingerprint(pinned.config, tokenizer)
    # Local folders and the tiny preset keep the fingerprint they had (no revision in it).
    tiny = load_model(TINY_MODEL)
    assert getattr(tiny.config, "_commit_hash", None) is None


def test_neither_cached_nor_downloadable_names_the_id_and_cache(hub_cache: Path) -> None:
    with pytest.raises(HubError) as error:
        load_model("hivespec-test/absent-model")
    message = str(error.value)
    assert "hivespec-test/absent-model" in message and str(hub_cache) in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(HubError, match="revision 'v9'"):
        load_tokenizer(REPO, revision="v9")


def test_remote_code_is_refused_unless_trusted(hub_cache: Path) -> None:
    snapshot = hub_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMITS[1]
    config = json.loads((snapshot / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    config["model_type"] = "evil-arch"
    (snapshot / "config.json").write_text(json.dumps(config))
    (snapshot / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(REPO)


def test_repo_id_shape() -> None:
    assert looks_like_repo_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert looks_like_repo_id("HuggingFaceTB/SmolLM2-360M-Instruct")
    for text in ("smollm2-135m-instruct", "tiny", "../etc/passwd", "/abs/path", "a/b/c", "a/../b", ""):
        assert not looks_like_repo_id(text), text
