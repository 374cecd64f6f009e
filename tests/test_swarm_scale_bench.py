"""The scale bench's supply bound: what k_fill could have been with every published batch in sight."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # the bench folder only; the repo root stays off sys.path

import swarm_scale


def test_fill_ceiling_takes_one_an_author_then_their_further_batches():
    """A reader beside two authors, one of them loud: each step takes K = 4 as the sampling does (one an author, then
    further batches where that leaves slots), each batch once; only the reader's steps fall in the window."""
    assert swarm_scale.K == 4
    loud = {"index": 1, "steps": [{"t": float(t), "publish_s": 0.1} for t in (1, 2, 3)]}
    quiet = {"index": 2, "steps": [{"t": 1.0, "publish_s": 0.1}]}
    reader = {"index": 0, "steps": [{"t": 10.0, "publish_s": 0.1}, {"t": 20.0, "publish_s": 0.1}]}
    # At 10 s: one of each author's and the loud one's two more (4 of K); at 20 s nothing is left that the reader has
    # not taken (its own batches are never counted). 4 batches in 2 steps of K = 4.
    assert swarm_scale._fill_ceiling([loud, quiet, reader], measure_from=5.0, until=30.0) == 0.5
    # A batch older than MAX_AGE_S at the step's start is out of reach.
    late = {"index": 0, "steps": [{"t": 3.0 + swarm_scale.MAX_AGE_S + 1.0, "publish_s": 0.1}]}
    assert swarm_scale._fill_ceiling([loud, quiet, late], measure_from=5.0, until=1e9) == 0.0
