"""Peers whose engines sample in different dtypes still train on each other's rollouts.

Two real nodes on loopback (tiny model, real hivemind, SQLite, signatures): one samples from a
float32 engine, the other from a bfloat16 one. Each must accept the other's rollouts and train on
them; the importance weights absorb the engine numerics (each rollout carries its own engine's
behaviour log-probs), so few tokens are masked and the weights stay finite and near 1.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest
import torch

from hivespec.node.config import load_config


@pytest.mark.timeout(400)
def test_float32_and_bfloat16_engines_train_on_each_others_rollouts(tmp_path: Path) -> None:
    from hivespec.node.build import build_node

    def node(name: str, engine_dtype: str, peers: list[str]):
        config = load_config("tiny", overrides={
            "home": str(tmp_path / name), "name": name, "swarm.swarm": "test-mixed-precision", "swarm.expected_peers": "1",
            "swarm.round_timeout": "60", "swarm.bootstrap_timeout": "10", "status.enabled": "false",
            "checkpoint.every_rounds": "0", "checkpoint.at_exit": "false", "checkpoint.resume": "false",
            "speculation.enabled": "false", "model.engine_dtype": engine_dtype, "swarm.initial_peers": json.dumps(peers),
            # The tiny model's groups mostly share one reward (no gradient): run them anyway, for the weights' statistics.
            "train.flat_sample_stats": "true",
        }, environ={})
        return build_node(config)

    first = node("fp32", "float32", [])
    second = node("bf16", "bfloat16", first.gossip.visible_maddrs)
    nodes = [first, second]
    try:
        assert first.precision.engine.label == "float32" and second.precision.engine.label == "bfloat16"
        assert {t.dtype for t in first.engine.sync_parameters().values()} == {torch.float32}
        assert {t.dtype for t in second.engine.sync_parameters().values()} == {torch.bfloat16}
        reports: list[list] = [[], []]
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                for round_index in range(2):
                    reports[i].append(nodes[i].run_round(round_index))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert not errors, errors
        for me, rounds in zip(nodes, reports, strict=True):
            assert len(rounds) == 2, me.name
            assert all(r.admissions.rejected == 0 and r.engine_mismatch == 0 for r in rounds), me.name
            assert sum(r.admissions.accepted for r in rounds) > 0, f"{me.name} accepted no rollouts from the other dtype"
            trained = [r for r in rounds if r.train.foreign_samples > 0]
            assert trained, f"{me.name} never trained on a foreign rollout"
            for report in trained:
                assert math.isfinite(report.train.loss)
                foreign = report.train.foreign
                assert foreign is not None and foreign.tokens > 0
                # Other-dtype numerics are a small correction, not a reason to drop the data.
                assert foreign.kept_fraction >= 0.5, (me.name, foreign)
                assert 0.5 <= foreign.mean_weight <= 2.0, (me.name, foreign)
    finally:
        for n in nodes:
            n.close()
