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


def _step(samples: int, round_s: float) -> dict:
    # Training costs 0.2 s plus 1.0 s a sample; a step that trained syncs in 0.3 s, one that did not skips the sync.
    return {"trained_samples": samples, "seconds": {"train": 0.2 + 1.0 * samples, "sync": 0.3 if samples else 0.0,
                                                    "round": round_s}}


def test_rate_ceiling_adds_one_sample_and_the_syncs_a_solo_step_skips_to_the_share_target_of_steps():
    apart = [_step(0, 4.0), _step(2, 6.0)]  # half the solo steps train nothing (a flat 1x2 group) and skip the sync
    shared = [_step(2, 7.0), _step(4, 9.0)]
    # Per trained sample 1.0 s (fitted over both phases), the sync 0.3 s in the half of solo steps that skipped it.
    assert hetero_swarm.rate_ceiling(shared, apart) == round(5.0 / (5.0 + 0.9 * (1.0 + 0.5 * 0.3)), 3) == 0.829
    assert hetero_swarm.rate_ceiling(shared, apart, share=0.0) == 1.0  # no share target: nothing caps it
    # A fit needs two trained-sample counts; a ceiling needs solo steps.
    assert hetero_swarm.rate_ceiling([_step(2, 7.0)], [_step(2, 6.0)]) is None
    assert hetero_swarm.rate_ceiling(shared, []) is None


# A stand-in for `hivespec join` that the harness drives the same way: a ready event, a round event every 0.1 s, and
# on SIGTERM it notes when (CLOCK_MONOTONIC is the machine's, the same in every process) and takes a second to exit, as
# a slow node finishing its round does.
_STEPPING_NODE = r'''
import json, signal, sys, time
from pathlib import Path
home = Path(sys.argv[1])
events = (home / "events.jsonl").open("a")
def emit(event):
    events.write(json.dumps(event) + "\n")
    events.flush()
def stop(*_):
    (home / "sigterm").write_text(repr(time.monotonic()))
    time.sleep(1.0)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
emit({"event": "ready", "maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/x"]})
for i in range(10**6):
    time.sleep(0.1)
    emit({"event": "round", "round": i, "foreign_trained": 0})
'''


class _SteppingNode(hetero_swarm.PublicNode):
    def command(self, initial_peers: list[str]) -> list[str]:
        return [sys.executable, "-c", _STEPPING_NODE, str(self.home)]


def test_a_phase_window_ends_where_its_steps_were_watched_not_after_the_nodes_stopped(tmp_path, monkeypatch):
    # The window's seconds divide the steps per minute: stopping the three nodes (up to 30 s each while a slow node
    # finishes its round) counted as seconds in which no step could be counted, and cut the rate by a random share.
    monkeypatch.setattr(hetero_swarm, "PublicNode", _SteppingNode)
    phase = hetero_swarm.run_phase(tmp_path, 0.02, shared=True, fast_sets=[])
    stopped = [float(path.read_text()) for path in (tmp_path / "shared").glob("*/sigterm")]
    assert len(stopped) == 3 and phase["arrivals"]["fast"]
    assert phase["end"] <= min(stopped)


def test_foreign_version_lag_is_the_distance_either_way():
    # Versions count each node's own steps: the fast node takes a slow node's samples 40 versions behind, the slow nodes
    # take the fast node's 40 ahead and each other's level. The signed lags' median was 0 and their p95 saw one side.
    fast = [{"foreign_ages_s": [3.0, 5.0], "foreign_version_lags": [40, 40]}]
    slow = [{"foreign_ages_s": [20.0] * 4, "foreign_version_lags": [-40, -40, 0, 0]}]
    mix = hetero_swarm.foreign_mix({"fast": fast, "slow-0": slow, "slow-1": slow})
    assert mix["foreign_version_lag"] == {"median": 40.0, "p95": 40.0, "samples": 10, "ahead_share": 0.4}
    assert mix["foreign_age_s"] == {"median": 20.0, "p95": 20.0, "samples": 10}
    assert hetero_swarm.foreign_mix({"fast": [], "slow-0": []})["foreign_version_lag"]["median"] is None
