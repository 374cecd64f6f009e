"""What one round did: `RoundReport`, nested from each subsystem's own stats record, and its printed row.

A report holds the records the parts of a round already produce, as they produced them (the way
vLLM nests `SpecDecodingStats` inside `SchedulerStats`): the trainer's `StepStats`, the sync's
`SyncStats`, the engine's `SpeculationStats`, intake's `AdmissionTally`, plus the round's own
rollouts (`RolloutStats`), the swarm's state (`SwarmStats`) and supervision counters
(`SupervisionStats`). Nothing here computes a statistic twice.

`RoundReport.to_dict` is the JSON "round" event (`hivespec join --events`): a flat object whose
keys are `EVENT_FIELDS`, read by the demo, the bench scripts and the tests. It is a stable
shape; a field added to a record reaches it only when named here. `format_report_line` prints
one fixed-width row from that dict (the CLI and the demo print the same table).

Imports nothing heavy at run time (the record types are named for type checkers only), so the
demo's parent process can format rows without torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hivespec.node.model.engine import SpeculationStats
    from hivespec.node.training.intake import AdmissionTally
    from hivespec.node.training.trainer import StepStats
    from hivespec.node.weights.sync import SyncStats

__all__ = [
    "EVENT_FIELDS", "REPORT_HEADER", "RolloutStats", "RoundReport", "SupervisionStats", "SwarmStats",
    "format_bytes", "format_report_line",
]


@dataclass(frozen=True)
class RolloutStats:
    """The node's own rollouts of the round."""

    made: int
    tokens_generated: int
    reward_mean: float  # 0.0 when none were made

    @classmethod
    def of(cls, completion_lengths: Iterable[int], rewards: Iterable[float]) -> RolloutStats:
        values = list(rewards)
        return cls(made=len(values), tokens_generated=sum(completion_lengths), reward_mean=float(np.mean(values)) if values else 0.0)


@dataclass(frozen=True)
class SwarmStats:
    """The swarm as this node saw it at the end of the round: gossip's status and the peer score table."""

    solo: bool = False  # no DHT peer known: training alone, bootstrap retried in the background
    reachability: str = "unknown"  # reachable / unreachable / relayed / unknown (a peer's dial-back test)
    known_peers: int = 0  # peers in the DHT routing table
    scores: Mapping[str, Mapping] = field(default_factory=dict)  # peer id -> PeerScores row ("score", "graylisted", ...)

    @classmethod
    def of(cls, gossip_status: Mapping, scores: Mapping[str, Mapping] | None) -> SwarmStats:
        """From `Gossip.status()` and `PeerScores.snapshot()` (None: the node keeps no scores)."""
        return cls(
            solo=gossip_status["solo"],
            reachability=gossip_status["reachability"],
            known_peers=gossip_status["known_peers"],
            scores=dict(scores or {}),
        )

    @property
    def graylisted(self) -> int:
        """Peers whose score is below the graylist threshold (their records are skipped)."""
        return sum(1 for row in self.scores.values() if row["graylisted"])

    @property
    def peer_scores(self) -> dict[str, float]:
        return {peer: row["score"] for peer, row in self.scores.items()}


@dataclass(frozen=True)
class SupervisionStats:
    oom_retries: int = 0  # out-of-memory splits/retries in this round's generation and training
    gossip_restarts: int = 0  # gossip rebuilds (p2pd died or hung) since the node started
    watchdog_stalls: int = 0  # stalled-loop reports since the node started


@dataclass(frozen=True)
class RoundReport:
    """What one node did in one round, as the records of the parts that did it.

    `speculation` is the engine's counters for the round's generation (zeros when it never
    drafted); `drafter_rollouts` counts the rollouts the drafter has observed since start-up
    (store replay included). `policy_hash` is the hex state hash of the engine weights after the
    round's sync (a follower's must match); `engine_mismatch` counts engine elements whose bits
    differ from the trainer's cast (0 unless the sync is broken).
    """

    node: str
    round: int
    rollouts: RolloutStats
    admissions: AdmissionTally
    train: StepStats
    sync: SyncStats
    speculation: SpeculationStats
    swarm: SwarmStats
    supervision: SupervisionStats
    delta_published: bool = False  # the delta went out to followers (sync.publish)
    policy_hash: str = ""
    engine_mismatch: int = 0
    drafter_rollouts: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per phase and for the round
    checkpoint: str = ""  # checkpoint saved after this round ("" = none)
    checkpoint_error: str = ""  # why a save after this round failed (the previous checkpoint is kept)
    # Each foreign sample the step took (flat ones only with train.flat_sample_stats): its age (s since its author signed it) and version lag (ours - its author's).
    foreign_ages_s: tuple[float, ...] = ()
    foreign_version_lags: tuple[int, ...] = ()
    # The informative foreign samples the pool had room for when the step fetched (0: it fetched nothing; None: gossip
    # failed before it was asked), and the foreign rollouts left in the pool after the step took its share.
    foreign_room: int | None = None
    foreign_pending: int = 0
    heldout_accuracy: float | None = None  # greedy accuracy on held-out questions after this round (eval.every_rounds), else None
    # This process's resident memory (MB) right after the C heap was trimmed at the end of this round; None when the
    # round ended without a trim (at most one every 30 s). Always taken at that point of the loop, it is the floor a leak raises.
    resident_mb_after_trim: float | None = None
    # The most resident memory (MB) this process has held so far, this round included (None where the OS does not say):
    # what the machine must have free for this node.
    peak_resident_mb: float | None = None

    @property
    def policy_version(self) -> int:
        return self.train.version

    @property
    def importance_by_source(self) -> dict[str, dict]:
        """Importance sampling of the step per source ("own" and each author peer id): an
        ImportanceStats dict plus "samples", those of the source it trained on (with a gradient;
        node/credits.py sums them). With train.importance_sampling off there are no statistics: "samples" alone."""
        counts = self.train.source_samples
        by_source = {source: {**asdict(stats), "samples": counts.get(source, 0)} for source, stats in self.train.sources.items()}
        return by_source | {source: {"samples": samples} for source, samples in counts.items() if source not in by_source}

    @property
    def spec_acceptance(self) -> float | None:
        """Accepted / drafted draft tokens, to 4 places; None when nothing was drafted."""
        spec = self.speculation
        return round(spec.acceptance_rate, 4) if spec.drafted else None

    @property
    def spec_tokens_per_forward(self) -> float | None:
        """Completion tokens per target forward, per sequence (plain decoding: 1.0), to 3 places; None before any forward."""
        spec = self.speculation
        return round(spec.tokens_per_forward, 3) if spec.target_forwards else None

    def to_dict(self) -> dict:
        """The flat JSON "round" event (keys: `EVENT_FIELDS`, in that order)."""
        train, sync, spec, swarm = self.train, self.sync, self.speculation, self.swarm
        own, foreign = train.own, train.foreign
        event = {
            "node": self.node,
            "round": self.round,
            "policy_version": train.version,
            "made": self.rollouts.made,
            "received": self.admissions.received,
            "accepted": self.admissions.accepted,
            "rejected": self.admissions.rejected,
            "ignored": self.admissions.ignored,
            "reward_mean": self.rollouts.reward_mean,
            "foreign_reward_mean": self.admissions.reward_mean,
            "trained_samples": train.trained_samples,
            "foreign_used": train.foreign_samples,
            "foreign_trained": train.foreign_trained_samples,
            "own_weight_mean": own.mean_weight if own else None,
            "foreign_weight_mean": foreign.mean_weight if foreign else None,
            "foreign_weight_max": foreign.max_weight if foreign else None,
            "foreign_kept": foreign.kept_fraction if foreign else None,
            "loss": train.loss,
            "delta_bytes": sync.delta_bytes,
            "dense_bytes": sync.dense_bytes,
            "delta_density": sync.density,
            "engine_mismatch": self.engine_mismatch,
            "tokens_generated": self.rollouts.tokens_generated,
            "seconds": dict(self.seconds),
            "checkpoint": self.checkpoint,
            "checkpoint_error": self.checkpoint_error,
            "oom_retries": self.supervision.oom_retries,
            "gossip_restarts": self.supervision.gossip_restarts,
            "watchdog_stalls": self.supervision.watchdog_stalls,
            "importance_by_source": self.importance_by_source,
            "importance_foreign": asdict(foreign) if foreign else None,
            "kept_tokens": train.kept_tokens,
            "ppo_clip_fraction": train.clip_fraction,
            "kl": train.kl,
            "swarm_solo": swarm.solo,
            "swarm_reachability": swarm.reachability,
            "delta_chunks": sync.chunks,
            "delta_published": self.delta_published,
            "swarm_known_peers": swarm.known_peers,
            "graylisted_peers": swarm.graylisted,
            "peer_scores": swarm.peer_scores,
            "spec_drafted": spec.drafted,
            "spec_accepted": spec.accepted,
            "spec_acceptance": self.spec_acceptance,
            "spec_tokens_per_forward": self.spec_tokens_per_forward,
            "spec_draft_seconds": round(spec.draft_seconds, 4),
            "drafter_rollouts": self.drafter_rollouts,
            "policy_hash": self.policy_hash,
            "foreign_ages_s": [round(a, 1) for a in self.foreign_ages_s],
            "foreign_version_lags": list(self.foreign_version_lags),
            "foreign_room": self.foreign_room,
            "foreign_pending": self.foreign_pending,
            "heldout_accuracy": self.heldout_accuracy,
            "resident_mb_after_trim": self.resident_mb_after_trim,
            "peak_resident_mb": self.peak_resident_mb,
            "micro_batch_size": train.micro_batch_size,
        }
        return event


# The "round" event's keys, in order: a stable shape (the demo, bench/ and tests read these names).
EVENT_FIELDS = (
    "node", "round", "policy_version", "made", "received", "accepted", "rejected", "ignored", "reward_mean",
    "foreign_reward_mean", "trained_samples", "foreign_used", "foreign_trained", "own_weight_mean", "foreign_weight_mean",
    "foreign_weight_max", "foreign_kept", "loss", "delta_bytes", "dense_bytes", "delta_density", "engine_mismatch",
    "tokens_generated", "seconds", "checkpoint", "checkpoint_error", "oom_retries", "gossip_restarts",
    "watchdog_stalls", "importance_by_source", "importance_foreign", "kept_tokens", "ppo_clip_fraction", "kl",
    "swarm_solo", "swarm_reachability", "delta_chunks", "delta_published", "swarm_known_peers", "graylisted_peers",
    "peer_scores", "spec_drafted", "spec_accepted", "spec_acceptance", "spec_tokens_per_forward",
    "spec_draft_seconds", "drafter_rollouts", "policy_hash", "foreign_ages_s", "foreign_version_lags",
    "foreign_room", "foreign_pending", "heldout_accuracy", "resident_mb_after_trim",
    "peak_resident_mb", "micro_batch_size",
)


def format_bytes(n: float) -> str:
    """123B, 4.5KB, 6.7MB, 8.9GB (decimal units)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}GB"


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


REPORT_HEADER = (
    f"{'rnd':>3} {'node':<16} {'made':>4} {'recv':>4} {'acc':>4} {'rej':>3} {'reward':>6} {'peer_r':>6} "
    f"{'w_own':>5} {'w_peer':>6} {'w_max':>5} {'kept':>4} {'delta / dense':>18} {'time':>6}"
)


def format_report_line(r: Mapping) -> str:
    """One fixed-width row per node per round (see REPORT_HEADER), from a "round" event (`RoundReport.to_dict`)."""
    # A node without followers codes no delta: it shows the share of its engine's weights that changed.
    delta = (f"{format_bytes(r['delta_bytes'])}/{format_bytes(r['dense_bytes'])}" if r["delta_bytes"]
             else f"{r['delta_density']:.1%} changed")
    return (
        f"{r['round']:>3} {r['node'][:16]:<16} {r['made']:>4} {r['received']:>4} {r['accepted']:>4} {r['rejected']:>3} "
        f"{r['reward_mean']:>6.2f} {_fmt(r['foreign_reward_mean']):>6} {_fmt(r['own_weight_mean'], '.3f'):>5} "
        f"{_fmt(r['foreign_weight_mean'], '.3f'):>6} {_fmt(r['foreign_weight_max'], '.2f'):>5} {_fmt(r['foreign_kept'], '.2f'):>4} "
        f"{delta:>18} {r['seconds'].get('round', 0):>5.1f}s"
    )
