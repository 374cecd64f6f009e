"""A deterministic snapshot source for dashboard tests: a three-node swarm five rounds in."""

from __future__ import annotations

import io
from dataclasses import replace

from rich.console import Console

from hivespec.dashboard.source import SourceError
from hivespec.protocol.status import (
    STATUS_VERSION,
    GossipStatus,
    IntakeStatus,
    LogLine,
    NodeInfo,
    PeerRow,
    RoundPoint,
    SourceStats,
    StatusSnapshot,
    StoreStatus,
    SupervisionStatus,
    SyncStatus,
    TrainerStatus,
)

T0 = 1_700_000_000.0
PEER_A = "hs0123456789abcdef"
PEER_B = "hsfedcba987654321f"
OWN_ID = "hs00112233445566ff"
REWARDS = [0.25, 0.31, 0.28, 0.44, 0.50, 0.56]
LOSSES = [0.021, 0.018, -0.004, 0.011, 0.007, 0.002]


def make_snapshot(rounds: int = 6, *, paused: bool = False, name: str = "node-0", peer_id: str = OWN_ID,
                  speculation: bool = True) -> StatusSnapshot:
    now = T0 + 60.0 * rounds + 30
    points = [
        RoundPoint(
            round=i, finished_at=T0 + 60.0 * (i + 1), policy_version=i + 1, seconds=50.0 + i, rollout_seconds=30.0,
            made=16, accepted=32, rejected=0, reward_mean=REWARDS[i % len(REWARDS)],
            foreign_reward_mean=REWARDS[i % len(REWARDS)] - 0.05, loss=LOSSES[i % len(LOSSES)],
            tokens_generated=700 + 10 * i, tokens_per_second=(700 + 10 * i) / 30.0,
            rollouts_per_minute=60.0 * 16 / (50.0 + i),
            tokens_per_target_forward=(1.8 + 0.1 * i) if speculation else None,
            draft_acceptance=(0.6 + 0.02 * i) if speculation else None,
            gossip_bytes_in=200_000 + 1000 * i, gossip_bytes_out=190_000 + 500 * i,
            delta_bytes=19_000_000 - 500_000 * i, delta_density=0.07,
        )
        for i in range(rounds)
    ]
    return StatusSnapshot(
        version=STATUS_VERSION,
        time=now,
        node=NodeInfo(
            name=name, peer_id=peer_id, swarm="demo", model="smollm2-135m-instruct", device="cpu",
            reachability="public", policy_version=rounds, round=rounds - 1, rounds_target=10,
            phase="paused" if paused else "running", paused=paused, started_at=T0 - 25, uptime_s=now - T0 + 25,
            engine_dtype="float32", engine_dtype_reason="cached: decode step at batch 16, 1 thread: float32 139 ms, bfloat16 348 ms",
            train_precision="float32", train_precision_reason="cached: forward+backward of 896 tokens: float32 11 s, bfloat16 autocast 215 s",
            attention=["engine attention eager (cached: a decode step of 16 rows over 112 tokens, 1 thread(s): sdpa 74.6 ms, eager 43.9 ms)",
                       "trainer runs a group's prompt once (cached: every row whole 3181 ms, the prompt once 2019 ms)"],
        ),
        peers=[
            PeerRow(peer_id=PEER_A, name="swift-otter-3fa2", last_seen=now - 12, latency_ms=4.0, batches=rounds,
                    accepted=16 * rounds, score=0.98),
            PeerRow(peer_id=PEER_B, name="calm-heron-07b1", last_seen=now - 700, batches=rounds + 1,
                    accepted=16 * (rounds - 1), rejected=1, last_reason="reward_mismatch", score=0.41),
        ],
        rounds=points,
        trainer=TrainerStatus(
            step_round=rounds - 1, trained_samples=32, foreign_used=16, foreign_share=0.5, loss=LOSSES[(rounds - 1) % 6],
            grad_norm=0.42,
            sources=[
                SourceStats(source="own", samples=16, kept_fraction=1.0, truncated_fraction=0.0, masked_fraction=0.0,
                            ess_fraction=0.99, mean_weight=1.001, max_weight=1.04),
                SourceStats(source=PEER_A, samples=16, kept_fraction=0.93, truncated_fraction=0.05, masked_fraction=0.07,
                            ess_fraction=0.81, mean_weight=0.97, max_weight=2.0),
            ],
        ),
        sync=SyncStatus(delta_bytes=16_500_000, dense_bytes=269_000_000, density=0.071, engine_mismatch=0),
        gossip=GossipStatus(bytes_in=1_250_000, bytes_out=1_180_000, bodies_fetched=11, bodies_served=10, published=6,
                            known_peers=2, counters={"bytes_in": 1_250_000}),
        intake=IntakeStatus(accepted_rollouts=16 * (2 * rounds - 1), outcomes={"accept": 2 * rounds - 1, "reject": 1},
                            reasons={"ok": 2 * rounds - 1, "reward_mismatch": 1}),
        store=StoreStatus(own=16 * rounds, foreign=16 * (2 * rounds - 1), total=16 * (3 * rounds - 1)),
        supervision=SupervisionStatus(resident_mb=2839.0, peak_resident_mb=5271.7),
        logs=[LogLine(time=now - 300, level="WARNING", logger="hivespec.node.swarm.gossip", message="fetch from hsfedcba98 timed out"),
              LogLine(time=now - 200, level="ERROR", logger="hivespec.node.training.intake", message="reject envelope: reward_mismatch")],
    )


def crowded(snapshot, peers: int, *, newcomer: bool = False):
    """`snapshot` in a public swarm of `peers` peers, peer i heard from 2i s ago (the fakes' peers count as active for
    165 s: peer 82 is the last), plus, with `newcomer`, one that sent rollouts just now and sorts first."""
    rows = [PeerRow(peer_id=f"hs{i:016x}", name=f"peer-{i:03d}", last_seen=snapshot.time - 2 * i, batches=1, accepted=4, score=0.9)
            for i in range(peers)]
    if newcomer:
        rows.append(PeerRow(peer_id="hs" + "f" * 16, name="aaa-newcomer", last_seen=snapshot.time, batches=1, accepted=4))
    return replace(snapshot, peers=rows)


class FakeSource:
    """Serves `snapshots` in order (the last one repeats); `fail` makes it unreachable, `broken` raises that exception
    as it is (a source's bug); records pause requests."""

    def __init__(self, *snapshots: StatusSnapshot, label: str = "fake:1") -> None:
        self.label = label
        self.snapshots = list(snapshots)
        self.fail: str | None = None
        self.broken: Exception | None = None
        self.pause_requests: list[bool] = []
        self.fetches = 0

    def fetch(self) -> StatusSnapshot:
        if self.fail is not None:
            raise SourceError(self.fail)
        if self.broken is not None:
            raise self.broken
        self.fetches += 1
        snapshot = self.snapshots[0] if len(self.snapshots) == 1 else self.snapshots.pop(0)
        if self.pause_requests:
            paused = self.pause_requests[-1]
            snapshot = replace(snapshot, node=replace(snapshot.node, paused=paused, phase="paused" if paused else "running"))
        return snapshot

    def set_paused(self, paused: bool) -> None:
        self.pause_requests.append(paused)


def screen_text(app) -> str:
    """The app's screen as plain text (what `export_screenshot` draws, without styles)."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()
