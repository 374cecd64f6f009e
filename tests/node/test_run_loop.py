"""Node.run's loop on the tiny digit model (no mocks): what it keeps and reports, for a node run for days."""

from __future__ import annotations

import logging

import pytest
from test_resume import make_digit_model

from hivespec.node.config import load_config


@pytest.mark.timeout(600)
def test_a_node_returns_only_the_reports_it_is_asked_to_keep(tmp_path):
    """Every report goes to on_report as it is made; the returned list holds the last `keep` (none from the command line)."""
    from hivespec.node.build import build_node

    model = make_digit_model(tmp_path / "digit-model")
    config = load_config("tiny", overrides={
        "home": str(tmp_path / "home"), "name": "keeper", "model.name": str(model), "rounds": "3", "seed": "7",
        "swarm.swarm": "test-keep", "swarm.expected_peers": "0", "swarm.bootstrap_timeout": "0", "status.enabled": "false",
        "checkpoint.every_rounds": "0", "checkpoint.at_exit": "false", "checkpoint.resume": "false",
        "speculation.enabled": "false", "rollout.prompts_per_round": "2",
    })
    node = build_node(config)
    seen = []
    try:
        kept = node.run(seen.append, keep=1)
        assert [r.round for r in seen] == [0, 1, 2] and kept == seen[-1:]
    finally:
        node.close()


@pytest.mark.timeout(600)
def test_checkpoint_dir_with_a_tilde_is_in_the_user_s_home(tmp_path, monkeypatch):
    """checkpoint.dir: ~/ckpts was checked (and sized by the doctor) in the user's home, but the node wrote its checkpoints
    to a folder named '~' in whatever folder it was started from: a resume from elsewhere found none."""
    from hivespec.node.build import build_node

    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.chdir(tmp_path)
    config = load_config("tiny", overrides={
        "home": str(tmp_path / "home"), "model.name": str(make_digit_model(tmp_path / "digit-model")), "rounds": "1",
        "swarm.swarm": "test-tilde", "swarm.bootstrap_timeout": "0", "status.enabled": "false",
        "checkpoint.dir": "~/ckpts", "speculation.enabled": "false", "model.attention": "sdpa", "train.share_prompts": "false",
    })
    node = build_node(config)
    try:
        assert node.checkpoints.directory == tmp_path / "user" / "ckpts"
        node.run()
    finally:
        node.close()
    assert (tmp_path / "user" / "ckpts").is_dir() and [p.name for p in (tmp_path / "user" / "ckpts").iterdir()]
    assert not (tmp_path / "~").exists()



@pytest.mark.timeout(600)
def test_a_node_resumed_past_its_rounds_says_why_none_runs(tmp_path, caplog):
    """`hivespec join --rounds 1` run again in its home resumes at round 1: nothing runs, as rounds counts from the first,
    but only the rows' header said anything (then the node lingered and exited 0, as if it had trained)."""
    from hivespec.node.build import build_node

    config = load_config("tiny", overrides={
        "home": str(tmp_path / "home"), "model.name": str(make_digit_model(tmp_path / "digit-model")), "rounds": "1",
        "swarm.swarm": "test-rounds-done", "swarm.bootstrap_timeout": "0", "status.enabled": "false",
        "speculation.enabled": "false", "model.attention": "sdpa", "train.share_prompts": "false",
    })
    for run in range(2):
        node = build_node(config)
        try:
            with caplog.at_level(logging.WARNING, logger="hivespec.node.runtime"):
                assert len(node.run()) == 1 - run
        finally:
            node.close()
    assert caplog.text.count("resumed at round 1: the 1 rounds asked for (rounds counts from the first) are done") == 1


@pytest.mark.timeout(600)
def test_a_round_whose_every_prompt_was_skipped_publishes_nothing(tmp_path, caplog):
    """A user's task file of long questions only: every prompt is skipped as too long for the model, and the round had
    published an empty batch, which took a slot of each peer's fetch and was ignored there."""
    import json

    from hivespec.node.build import build_node

    (tmp_path / "tasks.jsonl").write_text(json.dumps({"question": "word " * 2100, "answer": 1}) + "\n")
    config = load_config("tiny", overrides={
        "home": str(tmp_path / "home"), "model.name": "tiny", "rounds": "1", "swarm.swarm": "test-all-skipped",
        "swarm.bootstrap_timeout": "0", "status.enabled": "false", "checkpoint.every_rounds": "0", "checkpoint.at_exit": "false",
        "checkpoint.resume": "false", "speculation.enabled": "false", "rollout.prompts_per_round": "2",
        "tasks.mix": "[{family: jsonl}]", "tasks.jsonl_path": str(tmp_path / "tasks.jsonl"),
    })
    node = build_node(config)
    try:
        with caplog.at_level(logging.WARNING, logger="hivespec.node.exchange"):
            [report] = node.run()
        assert report.rollouts.made == 0 and node.gossip.stats()["published"] == 0
        assert "round 0: no own rollouts (every prompt was skipped): nothing published" in caplog.text
    finally:
        node.close()


@pytest.mark.timeout(600)
def test_two_nodes_with_one_checkpoint_dir_are_refused(tmp_path):
    """Two `hivespec join` with their own homes and one checkpoint.dir: the second had resumed from the first's
    checkpoint (another identity's weights, a pool its journal lacks), and the two pruned each other's saves."""
    from hivespec.node.build import HomeInUse, build_node

    def config(home):
        return load_config("tiny", overrides={
            "home": str(tmp_path / home), "model.name": "tiny", "rounds": "1", "swarm.swarm": "test-one-ckpt-dir",
            "swarm.bootstrap_timeout": "0", "status.enabled": "false", "checkpoint.dir": str(tmp_path / "ckpts"),
            "speculation.enabled": "false", "model.attention": "sdpa", "train.share_prompts": "false",
        })

    first = build_node(config("a"))
    try:
        with pytest.raises(HomeInUse, match=r"checkpoint.dir '.*ckpts' is in use by another running hivespec node; two nodes saving there"):
            build_node(config("b"))
    finally:
        first.close()
    build_node(config("b")).close()  # once the first has stopped, the folder is free again
    assert not [p for p in (tmp_path / "ckpts").iterdir() if not p.name.startswith("ckpt-")]  # the lock leaves no file
