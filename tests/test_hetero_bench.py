"""The hetero bench's arithmetic: the fast node's step rate with the answers' length taken out."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # the bench folder only; the repo root stays off sys.path

import hetero_swarm


def test_rate_at_solo_rollout_replaces_only_the_rollout():
    # The 14f0ef4 run on a 2-core EPYC: shared answers shorter (3.82 s of rollout against 4.38 s apart).
    profiles = {"shared": {"rollout": 3.82, "round": 6.42}, "apart": {"rollout": 4.38, "round": 5.23}}
    assert hetero_swarm.rate_at_solo_rollout(profiles) == round(5.23 / (6.42 - 3.82 + 4.38), 3) == 0.749
    # Steps that differ only in their rollout cost nothing by this measure; a phase without steps gives none.
    same = {"shared": {"rollout": 1.0, "round": 3.0}, "apart": {"rollout": 2.0, "round": 4.0}}
    assert hetero_swarm.rate_at_solo_rollout(same) == 1.0
    assert hetero_swarm.rate_at_solo_rollout({"shared": {}, "apart": {"rollout": 2.0, "round": 4.0}}) is None
