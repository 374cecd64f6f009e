"""RoundReport: nested from the parts' own records, flat and stable as a JSON event, and what the status board makes of it."""

import dataclasses
import json
import sys

import numpy as np

from hivespec.kernels.importance import ImportanceStats
from hivespec.node.model.engine import SpeculationStats
from hivespec.node.report import (
    EVENT_FIELDS,
    REPORT_HEADER,
    RolloutStats,
    RoundReport,
    SupervisionStats,
    SwarmStats,
    format_report_line,
)
from hivespec.node.status.board import BoardSources, NodeFacts, RunControl, StatusBoard
from hivespec.node.swarm.peers import PeerScores
from hivespec.node.training.intake import Admission, AdmissionTally
from hivespec.node.training.store import RolloutStore
from hivespec.node.training.trainer import OWN, StepStats
from hivespec.node.weights.sync import SyncStats
from hivespec.protocol.rollout import Rollout
from hivespec.protocol.status import decode_status, encode_status


def _rollout(prompt: str, reward: float) -> Rollout:
    return Rollout(prompt, 0, 0, np.zeros(2, np.uint32), np.zeros(3, np.uint32), np.zeros(3, np.float32), reward, "stop")


def _importance(mean: float) -> ImportanceStats:
    return ImportanceStats(tokens=12, kept_fraction=0.75, masked_fraction=0.25, vetoed_fraction=0.0,
                           truncated_fraction=0.1, mean_weight=mean, max_weight=2.0, ess_fraction=0.6)


def _report() -> RoundReport:
    admissions = [
        Admission("accept", "ok", author="peer-a", rollouts=(_rollout("p", 1.0), _rollout("p", 0.0)), policy_version=3),
        Admission("reject", "reward_mismatch", author="peer-b"),
        Admission("ignore", "stale", author="peer-c"),
    ]
    step = StepStats(
        version=4, samples=6, foreign_samples=2, trained_samples=6, tokens=18, kept_tokens=14, loss=0.25, grad_norm=1.0,
        reward_mean=0.5, own=_importance(1.0), foreign=_importance(0.9), seconds=0.1,
        sources={OWN: _importance(1.0), "peer-a": _importance(0.9)}, clip_fraction=0.0, kl=None,
        source_samples={OWN: 4, "peer-a": 2}, foreign_trained_samples=1, micro_batch_size=3,
    )
    spec = SpeculationStats(sequences=4, tokens=30, target_forwards=20, drafted=12, accepted=9, draft_seconds=0.01234)
    sync = SyncStats(version=4, changed=10, elements=1000, delta_bytes=120, dense_bytes=2000, chunks=1, seconds=0.01)
    scores = PeerScores()
    scores.record("peer-a", "accept")
    scores.record("peer-b", "reject", "reward_mismatch")
    return RoundReport(
        node="node-0", round=7,
        rollouts=RolloutStats.of([3, 3, 3, 3], [1.0, 0.0, 1.0, 1.0]),
        admissions=AdmissionTally.of(admissions),
        train=step, sync=sync, speculation=spec,
        swarm=SwarmStats.of({"solo": False, "reachability": "reachable", "known_peers": 2}, scores.snapshot()),
        supervision=SupervisionStats(oom_retries=1),
        delta_published=True, policy_hash="ab" * 32, seconds={"round": 1.5, "rollout": 1.0},
    )


def test_the_round_event_is_flat_and_keeps_its_field_names():
    event = _report().to_dict()
    assert tuple(event) == EVENT_FIELDS
    assert json.loads(json.dumps(event)) == event  # plain JSON: no dataclass or numpy value leaks out
    assert (event["made"], event["tokens_generated"], event["reward_mean"]) == (4, 12, 0.75)
    assert (event["received"], event["accepted"], event["rejected"], event["ignored"]) == (3, 2, 1, 1)
    assert event["foreign_reward_mean"] == 0.5 and event["foreign_used"] == 2 and event["policy_version"] == 4
    assert event["foreign_trained"] == 1  # of the 2 foreign samples, the one with a gradient
    assert event["importance_by_source"]["own"]["samples"] == 4 and event["importance_by_source"]["peer-a"]["samples"] == 2
    assert event["importance_foreign"]["mean_weight"] == 0.9 and event["foreign_weight_max"] == 2.0
    assert (event["spec_acceptance"], event["spec_tokens_per_forward"], event["spec_draft_seconds"]) == (0.75, 1.5, 0.0123)
    assert event["delta_density"] == 0.01 and event["delta_chunks"] == 1 and event["delta_published"] is True
    assert event["graylisted_peers"] == sum(row["graylisted"] for row in _report().swarm.scores.values())
    assert set(event["peer_scores"]) == {"peer-a", "peer-b"}
    assert event["micro_batch_size"] == 3  # what the step trained in (less than the config's where memory was short)


def test_a_round_without_peers_or_drafts_reports_none_not_zero():
    report = _report()
    quiet = RoundReport(
        node="solo", round=0, rollouts=RolloutStats.of([], []), admissions=AdmissionTally.of([]),
        train=StepStats(version=1, samples=0, foreign_samples=0, trained_samples=0, tokens=0, kept_tokens=0, loss=0.0,
                        grad_norm=0.0, reward_mean=0.0, own=None, foreign=None, seconds=0.0),
        sync=report.sync, speculation=SpeculationStats(), swarm=SwarmStats(), supervision=SupervisionStats(),
    )
    event = quiet.to_dict()
    assert event["reward_mean"] == 0.0 and event["foreign_reward_mean"] is None
    assert event["spec_acceptance"] is None and event["spec_tokens_per_forward"] is None
    assert event["own_weight_mean"] is None and event["importance_foreign"] is None and event["importance_by_source"] == {}
    line = format_report_line(event)
    assert line.split()[:2] == ["0", "solo"] and " - " in line


def test_a_step_without_importance_sampling_still_says_what_each_source_gave():
    """With train.importance_sampling off a step has no per-source statistics, and the event's importance_by_source was
    empty: `hivespec export`'s model card credited every peer, and the node itself, with 0 samples trained on."""
    report = _report()
    plain = dataclasses.replace(report.train, sources={}, source_samples={"own": 4, "peer-a": 2}, own=None, foreign=None)
    event = dataclasses.replace(report, train=plain).to_dict()
    assert event["importance_by_source"] == {"own": {"samples": 4}, "peer-a": {"samples": 2}}


def test_the_printed_row_lines_up_with_its_header():
    line = format_report_line(_report().to_dict())
    assert len(line) == len(REPORT_HEADER)
    assert "120B/2.0KB" in line and line.endswith("1.5s")


def test_the_status_board_reads_the_report_and_its_sources(tmp_path):
    store = RolloutStore(tmp_path / "rollouts.sqlite")
    scores = PeerScores()
    scores.record("peer-a", "accept")
    board = StatusBoard(
        NodeFacts(name="node-0", peer_id="me", swarm="s", model="tiny", device="cpu", rounds_target=9, micro_batch_wanted=8),
        BoardSources(policy_version=lambda: 4, gossip_stats=lambda: {"bytes_in": 10, "bytes_out": 20},
                     peer_scores=scores.snapshot, store_counts=store.counts),
        RunControl(),
    )
    board.round_started(7)
    board.record_round(_report())
    verdict, snapshot = decode_status(encode_status(board.snapshot()))
    store.close()
    assert verdict.ok, verdict
    assert (snapshot.node.name, snapshot.node.round, snapshot.node.policy_version, snapshot.node.phase) == ("node-0", 7, 4, "running")
    point = snapshot.rounds[-1]
    assert (point.made, point.accepted, point.rejected, point.draft_acceptance, point.tokens_per_target_forward) == (4, 2, 1, 0.75, 1.5)
    assert point.gossip_bytes_in == 0 and point.delta_bytes == 120
    assert [s.source for s in snapshot.trainer.sources] == ["own", "foreign", "peer-a"]
    assert snapshot.trainer.foreign_share == 2 / 6 and snapshot.sync.density == 0.01
    assert snapshot.supervision.oom_retries == 1
    assert (snapshot.supervision.micro_batch_size, snapshot.supervision.micro_batch_wanted) == (3, 8)
    if sys.platform.startswith("linux"):  # this process's memory now and its high-water mark (/proc)
        assert 0 < snapshot.supervision.resident_mb <= snapshot.supervision.peak_resident_mb
    assert [p.peer_id for p in snapshot.peers] == ["peer-a"]  # the live score table, not the report's
    assert snapshot.store.total == 0 and snapshot.gossip.bytes_out == 20


def test_the_board_keeps_the_most_recent_peers_and_a_snapshot_stays_decodable(monkeypatch):
    """A node meets ever new identities over days: tallies stop at PEERS_KEPT, the least recently seen go first."""
    from hivespec.node.status import board as board_module

    monkeypatch.setattr(board_module, "PEERS_KEPT", 4)
    scores = PeerScores()
    for peer in ("scored-only-a", "scored-only-b"):
        scores.record(peer, "accept")
    board = StatusBoard(NodeFacts(name="n", peer_id="me", swarm="s", model="tiny", device="cpu", rounds_target=0),
                        BoardSources(policy_version=lambda: 0, peer_scores=scores.snapshot), RunControl())
    for author in ("p0", "p1", "p2", "p3", "p4", "p5", "p1"):  # p1 heard again: it stays
        board.record_admission(Admission("ignore", "stale", author=author), b"")
    assert list(board._state.peers) == ["p3", "p4", "p5", "p1"]
    verdict, snapshot = decode_status(encode_status(board.snapshot()))
    assert verdict.ok, verdict
    assert [p.peer_id for p in snapshot.peers] == ["p1", "p3", "p4", "p5"]  # tallied peers first, at most PEERS_KEPT rows


def test_a_round_loop_ended_by_an_error_reads_as_stopped_not_as_training_on():
    """`join --dashboard` keeps its dashboard up after the rounds' thread fails; the header had gone on saying
    "training round N", whatever the user paused or stopped."""
    from hivespec.dashboard.view import phase_text

    control = RunControl()
    board = StatusBoard(NodeFacts(name="n", peer_id="me", swarm="s", model="tiny", device="cpu", rounds_target=9),
                        BoardSources(policy_version=lambda: 0), control)
    board.round_started(0)
    board.record_round(_report())
    board.round_started(8)
    assert phase_text(board.snapshot()) == ("good", "training round 9/9")
    board.failed()
    control.set_paused(True)
    verdict, snapshot = decode_status(encode_status(board.snapshot()))
    assert verdict.ok, verdict
    assert (snapshot.node.phase, snapshot.node.round_started_at) == ("failed", None)
    level, text = phase_text(snapshot)
    assert level == "bad" and text.startswith("STOPPED by an error after 8 rounds")
