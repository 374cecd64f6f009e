"""Node telemetry: what the round loop reports, turned into status snapshots (protocol's schema).

`StatusBoard` keeps each `RoundReport`, every admission (per-peer tallies) and the phase, and
builds a `StatusSnapshot` on demand. It never holds the node: it is given `NodeFacts` (what does
not change while the node runs) and `BoardSources`, narrow read-only views of the live parts
(gossip's counters and swarm state, the peer scores, intake's counters, the store's counts, the
trainer's version), each a callable its owner answers under its own lock or as a copy.
`RunControl` is the pause/resume/stop switch the round loop checks between rounds; `LogBuffer`
keeps the node's recent WARNING-or-worse records. `node/status/server.py` serves all of it.

Nothing here blocks the round loop: the loop only appends to in-memory buffers under a lock held
for microseconds; snapshots are built in the server's threads (and cached for a fraction of a
second, so several dashboards cost what one does).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from hivespec.node.process_memory import peak_resident_mb, resident_mb
from hivespec.protocol.codec import safe_unpack
from hivespec.protocol.identity import PUBLIC_KEY_BYTES, peer_id_of, readable_name
from hivespec.protocol.status import (
    STATUS_VERSION,
    GossipStatus,
    HeldoutPoint,
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
    encode_status,
)

if TYPE_CHECKING:
    from hivespec.node.model.precision import PrecisionPlan
    from hivespec.node.report import RoundReport
    from hivespec.node.training.intake import Admission, IntakeCounters

log = logging.getLogger(__name__)

ROUNDS_KEPT = 240  # history in a snapshot: more than any terminal is wide
# Per-peer tallies kept (the least recently seen forgotten past it) and peer rows sent: a node that
# runs for days in a public swarm meets ever new identities, and each would otherwise stay forever.
# 1024 is far more peers than a node hears from in a staleness window, and half the rows a
# snapshot may carry (`protocol.status.MAX_LIST`), so the peer table never makes it undecodable.
PEERS_KEPT = 1024
LOGS_KEPT = 200
LOGS_SENT = 60
SNAPSHOT_CACHE_S = 0.2


class RoundStopped(Exception):
    """A stop request reached a safe point inside a round: the round is abandoned, nothing of it trained.

    Raised by `RunControl.check` from the round's safe points (between decode steps, between
    micro-batches before the optimizer step, while waiting for peers, while calibrating).
    """

    def __init__(self, where: str) -> None:
        super().__init__(f"stopped while {where}")
        self.where = where


class RunControl:
    """Pause/resume/stop for the round loop.

    Pause acts between rounds. Stop acts at the next safe point inside a round too: the round
    loop calls `check` there, which raises `RoundStopped` once a stop was requested.
    """

    def __init__(self) -> None:
        self._runnable = threading.Event()
        self._runnable.set()
        self._stop = threading.Event()

    @property
    def paused(self) -> bool:
        return not self._runnable.is_set() and not self._stop.is_set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def set_paused(self, paused: bool) -> None:
        if paused:
            self._runnable.clear()
        else:
            self._runnable.set()
        log.info("training %s (requested over the status server or the dashboard)", "paused" if paused else "resumed")

    def stop(self) -> None:
        """Leave the loop at the next safe point (see `check`)."""
        self._stop.set()
        self._runnable.set()

    def check(self, where: str) -> None:
        """Raise `RoundStopped(where)` if a stop was requested; `where` says what the round was doing."""
        if self._stop.is_set():
            raise RoundStopped(where)

    def wait_to_run(self) -> bool:
        """Block while paused; True when the next round may start, False when stopping."""
        while not self._runnable.wait(0.5):
            pass
        return not self._stop.is_set()


class LogBuffer(logging.Handler):
    """Ring buffer of the node's WARNING-or-worse log records, for the dashboard's log panel."""

    def __init__(self, capacity: int = LOGS_KEPT) -> None:
        super().__init__(level=logging.WARNING)
        self._lines: deque[LogLine] = deque(maxlen=capacity)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                message += f" ({type(exc).__name__}: {exc})"
            self._lines.append(LogLine(time=record.created, level=record.levelname, logger=record.name, message=message[:500]))
            self.counts[record.levelname] = self.counts.get(record.levelname, 0) + 1
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)

    def recent(self, limit: int = LOGS_SENT) -> list[LogLine]:
        return list(self._lines)[-limit:]


@dataclass
class _PeerTally:
    name: str = ""
    last_seen: float | None = None
    batches: int = 0
    accepted: int = 0
    rejected: int = 0
    ignored: int = 0
    last_reason: str = ""


@dataclass
class _BoardState:
    phase: str = "starting"
    round_started_at: float | None = None
    rounds: deque = field(default_factory=lambda: deque(maxlen=ROUNDS_KEPT))
    heldout: deque = field(default_factory=lambda: deque(maxlen=ROUNDS_KEPT))  # HeldoutPoint per scored round
    last_report: Any = None
    peers: dict[str, _PeerTally] = field(default_factory=dict)
    checkpoint: tuple[str, int, float] | None = None  # (name, round, unix time)
    oom_retries: int = 0


@dataclass(frozen=True)
class NodeFacts:
    """What a snapshot says about the node that does not change while it runs."""

    name: str
    peer_id: str
    swarm: str
    model: str
    device: str
    rounds_target: int
    precision: Mapping[str, str] = field(default_factory=dict)  # NodeInfo's engine_dtype / train_precision fields and reasons
    attention: tuple[str, ...] = ()  # NodeInfo.attention: the node's attention and shared-prompt choices, described
    micro_batch_wanted: int | None = None  # the config's micro batch (a step may take fewer samples at once to fit)

    @staticmethod
    def precision_fields(plan: PrecisionPlan | None) -> dict[str, str]:
        """NodeInfo's engine_dtype and train_precision, each with its reason, from a `PrecisionPlan` (None: {})."""
        if plan is None:
            return {}
        return {
            "engine_dtype": plan.engine.label,
            "engine_dtype_reason": f"{plan.engine.source}: {plan.engine.reason}"[:1000],
            "train_precision": plan.trainer.label,
            "train_precision_reason": f"{plan.trainer.source}: {plan.trainer.reason}"[:1000],
        }


def _nothing() -> dict:
    return {}


def _no_counters() -> None:
    return None


@dataclass(frozen=True)
class BoardSources:
    """Read-only views of a node's live parts, called from the status server's threads.

    Each returns a copy its owner took under its own lock (peer scores, store counts) or a live
    object the board copies defensively (gossip's counters, intake's counters: a copy racing an
    insert is retried). Any of them may raise while its part is down or being rebuilt; the
    snapshot then shows that part empty.
    """

    policy_version: Callable[[], int]
    gossip_stats: Callable[[], Mapping[str, int]] = _nothing  # Gossip.stats(): bytes in/out, bodies, ...
    swarm_status: Callable[[], Mapping[str, Any]] = _nothing  # Gossip.status(): reachability, solo, private, maddrs
    peer_scores: Callable[[], Mapping[str, Mapping]] = _nothing  # PeerScores.snapshot() by peer id ({} when not kept)
    intake_counters: Callable[[], IntakeCounters | None] = _no_counters  # Intake.counters
    store_counts: Callable[[], Mapping[str, int]] = _nothing  # RolloutStore.counts()


class StatusBoard:
    """What the round loop reports, turned into `StatusSnapshot`s on demand (thread-safe)."""

    def __init__(
        self, facts: NodeFacts, sources: BoardSources, control: RunControl, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.facts = facts
        self.sources = sources
        self.control = control
        self.clock = clock
        self.started_at = clock()
        self.logs = LogBuffer()
        self._lock = threading.Lock()
        self._state = _BoardState()
        self._gossip_mark = (0, 0)
        self._cache: tuple[float, bytes] | None = None

    # ----- called by the round loop ------------------------------------------------------

    def round_started(self, round_index: int) -> None:
        stats = _gossip_stats(self.sources)
        with self._lock:
            self._state.phase = "running"
            self._state.round_started_at = self.clock()
            self._gossip_mark = (stats.get("bytes_in", 0), stats.get("bytes_out", 0))

    def record_admission(self, admission: Admission, envelope: bytes) -> None:
        """Count one peer batch's outcome; the peer's readable name comes from its (verified) key."""
        author = admission.author
        if not author:
            return
        with self._lock:
            peers = self._state.peers
            tally = peers.pop(author, None)  # re-inserted last: the dict is ordered by last admission
            if tally is None:
                tally = _PeerTally()
                while len(peers) >= PEERS_KEPT:
                    del peers[next(iter(peers))]
            peers[author] = tally
            tally.last_seen = self.clock()
            tally.batches += 1
            if admission.outcome == "accept":
                tally.accepted += len(admission.rollouts)
            else:
                tally.last_reason = str(admission.reason)
                if admission.outcome == "reject":
                    tally.rejected += 1
                else:
                    tally.ignored += 1
            needs_name = not tally.name
        if needs_name and admission.outcome == "accept":
            name = _author_name(envelope, author)
            if name:
                with self._lock:
                    tally.name = name

    def record_round(self, report: RoundReport) -> None:
        stats = _gossip_stats(self.sources)
        now = self.clock()
        seconds = report.seconds or {}
        rollouts = report.rollouts
        rollout_s, round_s = seconds.get("rollout", 0.0), seconds.get("round", 0.0)
        with self._lock:
            bytes_in0, bytes_out0 = self._gossip_mark
            point = RoundPoint(
                round=report.round,
                finished_at=now,
                policy_version=report.policy_version,
                seconds=round_s,
                rollout_seconds=rollout_s,
                made=rollouts.made,
                accepted=report.admissions.accepted,
                rejected=report.admissions.rejected,
                foreign_used=report.train.foreign_samples,
                reward_mean=rollouts.reward_mean,
                foreign_reward_mean=report.admissions.reward_mean,
                loss=report.train.loss,
                tokens_generated=rollouts.tokens_generated,
                tokens_per_second=rollouts.tokens_generated / rollout_s if rollout_s > 0 else None,
                rollouts_per_minute=60.0 * rollouts.made / round_s if round_s > 0 else None,
                tokens_per_target_forward=report.spec_tokens_per_forward,
                draft_acceptance=report.spec_acceptance,
                gossip_bytes_in=max(0, stats.get("bytes_in", 0) - bytes_in0),
                gossip_bytes_out=max(0, stats.get("bytes_out", 0) - bytes_out0),
                delta_bytes=report.sync.delta_bytes,
                delta_density=report.sync.density,
            )
            self._state.rounds.append(point)
            if report.heldout_accuracy is not None:
                self._state.heldout.append(HeldoutPoint(round=report.round, accuracy=report.heldout_accuracy))
            self._state.last_report = report
            self._state.oom_retries += report.supervision.oom_retries
            if report.checkpoint:
                self._state.checkpoint = (report.checkpoint, report.round, now)
            self._state.round_started_at = None
            self._state.phase = "between"
            self._cache = None

    def finished(self) -> None:
        with self._lock:
            self._state.phase = "done"
            self._state.round_started_at = None
            self._cache = None

    def failed(self) -> None:
        """The round loop ended with an error (logged by the caller): no round runs any more, though the process lives on."""
        with self._lock:
            self._state.phase = "failed"
            self._state.round_started_at = None
            self._cache = None

    # ----- snapshots ---------------------------------------------------------------------

    def snapshot(self) -> StatusSnapshot:
        """A consistent snapshot of the node now; safe to call from any thread."""
        facts, sources = self.facts, self.sources
        now = self.clock()
        with self._lock:
            state = self._state
            rounds = list(state.rounds)
            heldout = list(state.heldout)
            report = state.last_report
            tallies = dict(state.peers)
            phase, round_started_at = state.phase, state.round_started_at
            checkpoint, oom_retries = state.checkpoint, state.oom_retries
        scores = _peer_scores(sources) or {p: {"score": v} for p, v in (report.swarm.peer_scores if report is not None else {}).items()}
        # The peers heard from most recently, then scored ones never tallied, at most PEERS_KEPT rows.
        shown = list(reversed(tallies))[:PEERS_KEPT]
        shown += [p for p in scores if p not in tallies][: PEERS_KEPT - len(shown)]
        peers = [_peer_row(peer_id, tallies.get(peer_id, _PeerTally()), scores.get(peer_id, {})) for peer_id in sorted(shown)]
        swarm = _gossip_swarm_status(sources)
        control = self.control
        ended = phase in ("done", "failed")  # no round runs any more: a pause or stop request changes nothing
        if control.stopping and not ended:
            phase = "stopping"
        elif control.paused and not ended:
            phase = "pausing" if round_started_at is not None else "paused"
        elif phase == "between":
            phase = "running"
        maddrs = swarm.get("maddrs")
        if not isinstance(maddrs, list):
            maddrs = []
        if not swarm and report is not None:  # gossip down or being rebuilt: what the last round saw
            swarm = {"reachability": report.swarm.reachability, "solo": report.swarm.solo}
        reachability = swarm.get("reachability")
        info = NodeInfo(
            name=facts.name,
            peer_id=facts.peer_id,
            swarm=facts.swarm,
            model=facts.model,
            device=facts.device,
            policy_version=sources.policy_version(),
            round=report.round if report is not None else -1,
            rounds_target=facts.rounds_target,
            phase=phase,
            paused=control.paused,
            started_at=self.started_at,
            uptime_s=max(0.0, now - self.started_at),
            round_started_at=round_started_at,
            maddrs=[str(m) for m in maddrs[:8]],
            reachability=reachability if isinstance(reachability, str) and reachability != "unknown" else None,
            checkpoint=checkpoint[0] if checkpoint else None,
            checkpoint_round=checkpoint[1] if checkpoint else None,
            checkpoint_at=checkpoint[2] if checkpoint else None,
            solo=swarm["solo"] if isinstance(swarm.get("solo"), bool) else None,
            private=swarm["private"] if isinstance(swarm.get("private"), bool) else None,
            **facts.precision,
            attention=[choice[:500] for choice in facts.attention[:4]],
        )
        supervision = SupervisionStatus(
            oom_retries=oom_retries,
            gossip_restarts=report.supervision.gossip_restarts if report is not None else None,
            watchdog_stalls=report.supervision.watchdog_stalls if report is not None else None,
            resident_mb=resident_mb(),
            peak_resident_mb=peak_resident_mb(),
            micro_batch_size=(report.train.micro_batch_size or None) if report is not None else None,
            micro_batch_wanted=facts.micro_batch_wanted,
        )
        return StatusSnapshot(
            version=STATUS_VERSION,
            time=now,
            node=info,
            peers=sorted(peers, key=lambda p: (p.name or p.peer_id)),
            rounds=rounds,
            heldout=heldout,
            trainer=_trainer_status(report),
            sync=_sync_status(report),
            gossip=_gossip_status(_gossip_stats(sources)),
            intake=_intake_status(sources),
            store=_store_status(sources),
            supervision=supervision,
            logs=self.logs.recent(),
        )

    def snapshot_bytes(self) -> bytes:
        """`encode_status(snapshot())`, cached for `SNAPSHOT_CACHE_S` (dashboards poll at 2-4 Hz)."""
        now = time.monotonic()
        cached = self._cache
        if cached is not None and now - cached[0] < SNAPSHOT_CACHE_S:
            return cached[1]
        data = encode_status(self.snapshot())
        self._cache = (now, data)
        return data


def _peer_row(peer_id: str, tally: _PeerTally, score: dict) -> PeerRow:
    value, graylisted = score.get("score"), score.get("graylisted")
    return PeerRow(
        peer_id=peer_id,
        name=tally.name,
        last_seen=tally.last_seen,
        batches=tally.batches,
        accepted=tally.accepted,
        rejected=tally.rejected,
        ignored=tally.ignored,
        last_reason=tally.last_reason,
        score=float(value) if isinstance(value, (int, float)) else None,
        graylisted=graylisted if isinstance(graylisted, bool) else None,
    )


def _author_name(envelope: bytes, author: str) -> str:
    """The readable name of an envelope's author key, if it matches the admitted author id."""
    verdict, obj = safe_unpack(envelope, max_size=len(envelope), max_depth=2)
    if not verdict.ok or not isinstance(obj, dict):
        return ""
    key = obj.get("author")
    if not isinstance(key, bytes) or len(key) != PUBLIC_KEY_BYTES or peer_id_of(key) != author:
        return ""
    return readable_name(key)


def _gossip_stats(sources: BoardSources) -> dict[str, int]:
    # stats() copies counters the gossip thread updates; a copy racing an insert can raise.
    for _ in range(3):
        try:
            return dict(sources.gossip_stats())
        except RuntimeError:
            continue
        except Exception:
            log.debug("gossip.stats() failed", exc_info=True)
            return {}
    return {}


def _gossip_swarm_status(sources: BoardSources) -> dict[str, Any]:
    """gossip.status(): reachability, solo, private, maddrs; {} while gossip is down."""
    try:
        return dict(sources.swarm_status())
    except Exception:  # noqa: BLE001 - gossip not started yet, shut down, or being rebuilt
        return {}


def _peer_scores(sources: BoardSources) -> dict[str, dict]:
    """Per-peer gossip scores by peer id, when the node keeps them."""
    try:
        return dict(sources.peer_scores())
    except Exception:
        log.debug("peer scores unavailable", exc_info=True)
        return {}


def _gossip_status(stats: dict[str, int]) -> GossipStatus:
    ints = {k: int(v) for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    named = ("bytes_in", "bytes_out", "bodies_fetched", "bodies_served", "published", "known_peers", "bad_records", "fetch_failures")
    return GossipStatus(**{k: ints.get(k, 0) for k in named}, counters=ints)


def _intake_status(sources: BoardSources) -> IntakeStatus:
    counters = sources.intake_counters()
    if counters is None:
        return IntakeStatus()
    for _ in range(3):
        try:
            return IntakeStatus(
                accepted_rollouts=counters.accepted_rollouts,
                outcomes={str(k): int(v) for k, v in dict(counters.outcomes).items()},
                reasons={str(k): int(v) for k, v in dict(counters.reasons).items()},
            )
        except RuntimeError:  # the round thread inserted a key while we copied
            continue
    return IntakeStatus(accepted_rollouts=counters.accepted_rollouts)


def _store_status(sources: BoardSources) -> StoreStatus:
    try:
        counts = sources.store_counts()
    except Exception:  # noqa: BLE001 - store closed at shutdown
        return StoreStatus()
    return StoreStatus(own=counts.get("own", 0), foreign=counts.get("foreign", 0), total=counts.get("total", 0))


def _trainer_status(report: RoundReport | None) -> TrainerStatus:
    if report is None:
        return TrainerStatus()
    step = report.train
    by_source = report.importance_by_source
    own = step.trained_samples - step.foreign_samples
    sources = [_source_stats("own", by_source["own"]) if "own" in by_source
               else SourceStats(source="own", samples=own, mean_weight=step.own.mean_weight if step.own else None)]
    if step.foreign:
        sources.append(_source_stats("foreign", {**asdict(step.foreign), "samples": step.foreign_samples}))
    elif step.foreign_samples:
        sources.append(SourceStats(source="foreign", samples=step.foreign_samples))
    sources += [_source_stats(peer, stats) for peer, stats in sorted(by_source.items()) if peer != "own"]
    return TrainerStatus(
        step_round=report.round,
        trained_samples=step.trained_samples,
        foreign_used=step.foreign_samples,
        foreign_share=step.foreign_samples / step.trained_samples if step.trained_samples else None,
        loss=step.loss,
        kl=step.kl,
        ppo_clip_fraction=step.clip_fraction,
        sources=sources,
    )


def _source_stats(source: str, stats: dict) -> SourceStats:
    """SourceStats from an ImportanceStats dict (plus "samples"); other keys are ignored."""

    def number(key: str) -> float | None:
        value = stats.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    samples = stats.get("samples")
    return SourceStats(
        source=source,
        samples=samples if isinstance(samples, int) else None,
        kept_fraction=number("kept_fraction"),
        truncated_fraction=number("truncated_fraction"),
        masked_fraction=number("masked_fraction"),
        vetoed_fraction=number("vetoed_fraction"),
        ess_fraction=number("ess_fraction"),
        mean_weight=number("mean_weight"),
        max_weight=number("max_weight"),
    )


def _sync_status(report: RoundReport | None) -> SyncStatus:
    if report is None:
        return SyncStatus()
    return SyncStatus(
        delta_bytes=report.sync.delta_bytes,
        dense_bytes=report.sync.dense_bytes,
        density=report.sync.density,
        engine_mismatch=report.engine_mismatch,
    )
