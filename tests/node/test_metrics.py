"""`/metrics`: the status snapshot written by prometheus_client, read back by prometheus_client's own text parser."""

from __future__ import annotations

import math
import urllib.request
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from hivespec.node.status.board import RunControl
from hivespec.node.status.server import METRICS_CONTENT_TYPE, StatusServer, prometheus_text
from hivespec.protocol.status import (
    STATUS_VERSION,
    GossipStatus,
    IntakeStatus,
    NodeInfo,
    PeerRow,
    RoundPoint,
    SourceStats,
    StatusSnapshot,
    StoreStatus,
    SyncStatus,
    TrainerStatus,
)

# Every metric name /metrics served before prometheus_client wrote it (versions_behind is a follower's: absent here).
NAMES = {
    "info", "uptime_seconds", "round", "policy_version", "paused", "peers_seen", "known_peers", "gossip_bytes_total",
    "gossip_bodies_total", "intake_batches_total", "intake_reasons_total", "accepted_rollouts_total", "store_rollouts",
    "peer_batches_total", "peer_accepted_rollouts_total", "peer_rejected_batches_total", "reward_mean", "foreign_reward_mean",
    "loss", "round_seconds", "tokens_per_second", "tokens_per_target_forward", "delta_bytes", "delta_density", "foreign_share",
    "tis_kept_fraction", "tis_truncated_fraction", "tis_masked_fraction", "tis_ess_fraction", "tis_mean_weight",
    "tis_max_weight", "engine_mismatch_elements", "log_records_total",
}


def _snapshot() -> StatusSnapshot:
    return StatusSnapshot(
        version=STATUS_VERSION,
        time=1000.0,
        node=NodeInfo(name='odd "name"\\with\nnewline', peer_id="hs00", swarm="demo", model="tiny", policy_version=3, round=2,
                      uptime_s=12.5),
        peers=[PeerRow(peer_id="hs01", name="swift-otter", batches=3, accepted=24, rejected=1)],
        rounds=[RoundPoint(round=2, finished_at=999.0, seconds=4.25, reward_mean=0.5, foreign_reward_mean=None, loss=float("nan"),
                           tokens_generated=96, tokens_per_second=24.0, tokens_per_target_forward=1.5, delta_bytes=0,
                           delta_density=0.25)],
        trainer=TrainerStatus(foreign_share=0.5, sources=[
            SourceStats(source="own", kept_fraction=1.0, truncated_fraction=0.0, masked_fraction=0.0, ess_fraction=1.0,
                        mean_weight=1.0, max_weight=1.0),
            SourceStats(source="hs01", kept_fraction=0.75, truncated_fraction=0.125, masked_fraction=0.25, ess_fraction=0.8,
                        mean_weight=0.9, max_weight=2.0)]),
        sync=SyncStatus(engine_mismatch=0),
        gossip=GossipStatus(bytes_in=1_250_000_000_000, bytes_out=7, bodies_fetched=3, bodies_served=2, known_peers=1),
        intake=IntakeStatus(accepted_rollouts=24, outcomes={"accept": 3, "reject": 1}, reasons={"ok": 3, "reward_mismatch": 1}),
        store=StoreStatus(own=24, foreign=24, total=48),
    )


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_parse_with_the_same_names_labels_and_values():
    text = prometheus_text(_snapshot(), {"WARNING": 2, "ERROR": 1})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # prometheus_client names a counter family without its _total suffix; its samples keep it.
    served = {name + ("_total" if f.type == "counter" else "") for name, f in families.items()}
    assert served == {f"hivespec_{n}" for n in NAMES - {"loss", "foreign_reward_mean"}}  # NaN and None in this snapshot
    assert families["hivespec_gossip_bytes"].type == "counter" and families["hivespec_round"].type == "gauge"
    samples = _samples(text)
    assert samples[("hivespec_info", (("model", "tiny"), ("name", 'odd "name"\\with\nnewline'), ("peer_id", "hs00"),
                                      ("role", "trainer"), ("swarm", "demo")))] == 1
    assert samples[("hivespec_gossip_bytes_total", (("direction", "in"),))] == 1_250_000_000_000
    assert samples[("hivespec_intake_batches_total", (("outcome", "reject"),))] == 1
    assert samples[("hivespec_peer_accepted_rollouts_total", (("name", "swift-otter"), ("peer", "hs01")))] == 24
    assert samples[("hivespec_tis_max_weight", (("source", "hs01"),))] == 2.0
    assert samples[("hivespec_log_records_total", (("level", "ERROR"),))] == 1
    assert samples[("hivespec_round_seconds", ())] == 4.25 and samples[("hivespec_round", ())] == 2
    # Missing and non-finite values are left out, never written as NaN.
    assert "hivespec_loss" not in families and "hivespec_foreign_reward_mean" not in families
    assert all(math.isfinite(v) for v in samples.values())
    assert sum(line.startswith("# TYPE hivespec_round ") for line in text.splitlines()) == 1


def test_a_node_before_its_first_round_serves_identity_and_counters_only():
    snapshot = _snapshot()
    snapshot.rounds.clear()
    names = {f.name for f in text_string_to_metric_families(prometheus_text(snapshot))}
    assert "hivespec_info" in names and "hivespec_reward_mean" not in names and "hivespec_log_records" not in names


def test_the_status_server_serves_them_over_loopback():
    board = SimpleNamespace(snapshot=_snapshot, snapshot_bytes=lambda: b"{}", logs=SimpleNamespace(counts={"WARNING": 1}))
    server = StatusServer(board, RunControl(), port=0)
    try:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
            assert response.headers["Content-Type"] == METRICS_CONTENT_TYPE
            text = response.read().decode()
    finally:
        server.close()
    assert _samples(text)[("hivespec_log_records_total", (("level", "WARNING"),))] == 1
