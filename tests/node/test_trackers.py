"""report_to: a node's round figures in tensorboard and wandb (offline), read back; real node on the digit model."""

from __future__ import annotations

import importlib.util

import pytest
from test_heldout_probe import _config
from test_resume import make_digit_model

from hivespec.node.config import ConfigError, load_config
from hivespec.node.trackers import round_scalars

needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="tensorboard is not installed (pip install 'hivespec[trackers]')")
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                 reason="wandb is not installed (pip install 'hivespec[trackers]')")


def test_round_scalars_are_the_rows_numbers():
    event = {"node": "n", "round": 3, "reward_mean": 0.5, "made": 8, "foreign_kept": None, "swarm_solo": True,
             "policy_hash": "ab", "seconds": {"rollout": 1.5, "round": 2.0}}
    assert round_scalars(event) == {"reward_mean": 0.5, "made": 8.0, "seconds/rollout": 1.5, "seconds/round": 2.0}


def test_report_to_names_only_known_trackers():
    with pytest.raises(ConfigError, match="report_to names \\['tb'\\]"):
        load_config(None, overrides={"report_to": "[tb]"})
    assert load_config(None).report_to == []


@needs_tensorboard
@needs_wandb
@pytest.mark.timeout(600)
def test_a_node_logs_each_round_to_tensorboard_and_wandb_offline(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hivespec.node.build import build_node

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    model = make_digit_model(tmp_path / "digit-model")
    node = build_node(_config(tmp_path, model, rounds="3", report_to="[tensorboard, wandb]"))
    try:
        reports = node.run()
    finally:
        node.close()
    home = tmp_path / "home"
    events = EventAccumulator(str(home / "tensorboard"))
    events.Reload()
    rewards = events.Scalars("reward_mean")
    assert [e.step for e in rewards] == [0, 1, 2]
    assert [e.value for e in rewards] == pytest.approx([r.rollouts.reward_mean for r in reports])
    assert "seconds/round" in events.Tags()["scalars"]
    runs = list((home / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb")), runs
