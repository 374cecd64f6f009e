"""The round loop: one `Node` and its rounds. `build.py` builds the node's parts; this module runs them.

One round: draw prompts -> generate (engine) -> reward (our verifier) -> sign and publish the
batch (gossip) -> collect peers' batches for the round -> admit them (intake) -> one GRPO step
with truncated importance weights over own and foreign samples (trainer) -> sparse delta into
the engine (sync) -> a ``RoundReport``. Every part comes in built, as an argument of `Node`
(only the status server is started here, on request: `serve_status`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from hivespec.node.config import NodeConfig, node_home
from hivespec.node.model.engine import GenerationRequest, SamplingParams, SpeculationStats, TorchEngine
from hivespec.node.model.loader import stop_token_ids
from hivespec.node.model.precision import PrecisionPlan
from hivespec.node.model.vllm_engine import VllmEngine
from hivespec.node.speculation.policy import CurveCalibration
from hivespec.node.speculation.trace import TraceRecord, TraceWriter
from hivespec.node.status.board import RoundStopped, RunControl, StatusBoard
from hivespec.node.status.server import StatusServer, remove_status_file, write_status_file
from hivespec.node.supervise import Watchdog, generate_splitting_on_oom, train_step_with_oom_retry
from hivespec.node.swarm.bootstrap import HomeLock
from hivespec.node.swarm.gossip import Fetched, Gossip, GossipError
from hivespec.node.swarm.peers import PeerScores
from hivespec.node.swarm.supervisor import GossipSupervisor
from hivespec.node.tasks.source import TaskSource
from hivespec.node.training.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    StateProvider,
    restore_training,
    training_snapshot,
)
from hivespec.node.training.intake import Admission, Intake
from hivespec.node.training.store import RolloutStore, StoredRollout
from hivespec.node.training.trainer import OWN, StepStats, Trainer, TrainSample
from hivespec.node.weights.publisher import PolicyPublisher
from hivespec.node.weights.sync import WeightSync
from hivespec.protocol.envelope import Kind, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.rollout import Rollout, RolloutBatch, decode_rollout, encode_batch, rollout_content_hash

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0  # at most one progress report per phase this often (the demo prints every 10 s)

# What a node is doing, for people: `Node.on_phase(phase, detail)` hears these (see `Node.phase`).
PhaseListener = Callable[[str, str], None]


@dataclass(frozen=True)
class RoundReport:
    """What one node did in one round; printed by the CLI and the demo, one JSON line each."""

    node: str
    round: int
    policy_version: int
    made: int
    received: int
    accepted: int
    rejected: int
    ignored: int
    reward_mean: float
    foreign_reward_mean: float | None
    trained_samples: int
    foreign_used: int
    own_weight_mean: float | None
    foreign_weight_mean: float | None
    foreign_weight_max: float | None
    foreign_kept: float | None
    loss: float
    delta_bytes: int
    dense_bytes: int
    delta_density: float
    engine_mismatch: int
    tokens_generated: int
    seconds: dict[str, float] = field(default_factory=dict)
    checkpoint: str = ""  # checkpoint saved after this round ("" = none)
    checkpoint_error: str = ""  # why a save after this round failed (the previous checkpoint is kept)
    oom_retries: int = 0  # out-of-memory splits/retries in this round's generation and training
    gossip_restarts: int = 0  # gossip rebuilds (p2pd died or hung) since the node started
    watchdog_stalls: int = 0  # stalled-loop reports since the node started
    # Importance sampling of this round's step, per source: "own" and each author peer id, each an
    # ImportanceStats dict (tokens, kept/masked/vetoed/truncated fractions, mean/max weight,
    # ess_fraction) plus "samples"; importance_foreign aggregates every peer. Empty / None when
    # train.importance_sampling is off.
    importance_by_source: dict[str, dict] = field(default_factory=dict)
    importance_foreign: dict | None = None
    kept_tokens: int = 0  # the loss's denominator: completion tokens of trained samples the filters kept
    ppo_clip_fraction: float = 0.0  # kept tokens whose PPO ratio was clipped (only with train.ppo_epochs > 1)
    kl: float | None = None  # mean k3 KL to the behaviour policy per kept token (train.kl_coef > 0)
    swarm_solo: bool = False  # no DHT peer known: training alone, bootstrap retried in the background
    swarm_reachability: str = "unknown"  # reachable / unreachable / relayed / unknown (a peer's dial-back test)
    delta_chunks: int = 0  # chunks of this round's weight delta (each one gossip body under the 4 MiB cap)
    delta_published: bool = False  # the delta went out to followers (sync.publish)
    swarm_known_peers: int = 0  # peers in the DHT routing table
    graylisted_peers: int = 0  # peers whose score is below the graylist threshold (their records are skipped)
    peer_scores: dict[str, float] = field(default_factory=dict)  # gossipsub-style score per peer id (node/swarm/peers.py)
    # Speculative rollouts this round (zeros / None when speculation is off or never drafted):
    spec_drafted: int = 0  # draft tokens verified by the target
    spec_accepted: int = 0  # of which accepted (each accepted token saves one target forward)
    spec_acceptance: float | None = None  # spec_accepted / spec_drafted
    spec_tokens_per_forward: float | None = None  # completion tokens per target forward, per sequence (plain = 1.0)
    spec_draft_seconds: float = 0.0  # wall time spent drafting
    drafter_rollouts: int = 0  # rollouts the drafter has observed since start-up (store replay included)
    policy_hash: str = ""  # hex state_hash of the engine weights after this round's sync (a follower's must match)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _RoundStart:
    """What a checkpoint needs of the state at a round's start, for a stop in the middle of it."""

    round: int
    journal_rowid: int
    pending: tuple[_Pending, ...]
    providers: dict


@dataclass
class _Pending:
    """An admitted foreign rollout waiting to be trained on."""

    author: str
    round: int
    rollout: Rollout
    policy_version: int = -1  # the author's policy version when it sampled (-1: unknown)


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (identical across processes and machines)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Node:
    """One swarm node: engine, trainer, sync, gossip, intake and store, wired together."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        identity: Identity,
        gossip: Gossip,
        store: RolloutStore,
        tokenizer,
        trainer: Trainer,
        engine: TorchEngine | VllmEngine,
        sync: WeightSync,
        tasks: TaskSource,
        intake: Intake,
        fingerprint: str,
        checkpoints: CheckpointManager | None = None,
        watchdog: Watchdog | None = None,
        gossip_supervisor: GossipSupervisor | None = None,
        peer_scores: PeerScores | None = None,
        home_lock: HomeLock | None = None,
        publisher: PolicyPublisher | None = None,
        trace: TraceWriter | None = None,
        precision: PrecisionPlan | None = None,
        calibration: CurveCalibration | None = None,
        on_phase: PhaseListener | None = None,
    ) -> None:
        self.config = config
        self.precision = precision  # what model.engine_dtype / model.autocast "auto" became, and why
        self.calibration = calibration  # the verify-cost curve still to measure (speculation waits for it)
        self.on_phase = on_phase
        self.stop_report = ""  # what a stop in the middle of a round kept and saved, for the CLI to print
        self._round_start: _RoundStart | None = None  # captured as each round begins
        self._saved_state = False  # a checkpoint of the current training state exists (resumed from or saved)
        self._progress_at = 0.0
        self.trace = trace  # speculation.trace_file: what the drafter is fed, for bench/drafter_replay.py
        self.publisher = publisher
        self.peer_scores = peer_scores
        self.home_lock = home_lock
        self.identity = identity
        self.name = config.name or identity.name
        self.gossip = gossip
        self.store = store
        self.tokenizer = tokenizer
        self.trainer = trainer
        self.engine = engine
        self.sync = sync
        self.tasks = tasks
        self.intake = intake
        self.fingerprint = fingerprint
        self.seed = config.seed if config.seed is not None else derive_seed(identity.peer_id)
        self._seq = int(time.time() * 1000)  # monotonic across restarts without a stored counter
        self._pending: list[_Pending] = []
        self.checkpoints = checkpoints
        self.watchdog = watchdog
        self.gossip_supervisor = gossip_supervisor
        self.next_round = 0  # a resume moves it to the checkpoint's round
        self.resumed_from: str | None = None
        # Parts with JSON-able state to checkpoint, by name (e.g. "peers": the peer table and scores).
        self.checkpoint_providers: dict[str, StateProvider] = {}
        self._oom_retries = 0
        self.control = RunControl()  # pause/resume/stop between rounds (dashboard, /control)
        self.status = StatusBoard(self)
        self.status_server: StatusServer | None = None
        self.sampling = SamplingParams(
            temperature=config.rollout.temperature,
            top_p=config.rollout.top_p,
            max_new_tokens=config.rollout.max_completion_length,
            stop_token_ids=stop_token_ids(tokenizer, getattr(getattr(trainer, "model", None), "generation_config", None)),
        )

    def run(self, on_report: Callable[[RoundReport], None] | None = None) -> list[RoundReport]:
        """Run rounds ``next_round`` .. ``config.rounds - 1`` (forever when 0); `control` can pause or stop it between rounds.

        A checkpoint is saved every ``checkpoint.every_rounds`` rounds and when the loop ends.
        """
        reports = []
        self.next_round = self._catch_up(self.next_round)
        saved_at = self.next_round
        stopped: RoundStopped | None = None
        while self.config.rounds == 0 or self.next_round < self.config.rounds:
            if self.watchdog is not None and self.control.paused:
                self.watchdog.forget("round")  # paused on purpose is not a stall
            if not self.control.wait_to_run():
                break
            round_index = self.next_round
            self.status.round_started(round_index)
            self._round_start = self._capture_round_start(round_index)
            try:
                report = self.run_round(round_index)
            except RoundStopped as stop:
                stopped = stop
                break
            self.next_round = round_index + 1
            every = self.config.checkpoint.every_rounds
            if every and self.next_round % every == 0:
                report = self._checkpoint_after(report)
                saved_at = self.next_round
                self._saved_state = True
            self.status.record_round(report)
            reports.append(report)
            if on_report is not None:
                on_report(report)
        if stopped is not None:
            self.stop_report = self._stopped_mid_round(stopped, save=self.config.checkpoint.at_exit and saved_at != self.next_round)
        elif self.config.checkpoint.at_exit and saved_at != self.next_round:
            self.save_checkpoint()
        if self.watchdog is not None:
            self.watchdog.forget("round")
        self.status.finished()
        return reports

    def _capture_round_start(self, round_index: int) -> _RoundStart:
        """The state a stop inside this round checkpoints (cheap: ids and small dicts, no tensors)."""
        return _RoundStart(
            round=round_index,
            journal_rowid=self.store.journal_high_water(),
            pending=tuple(self._pending),
            providers={name: provider.state_dict() for name, provider in self.checkpoint_providers.items()},
        )

    def _stopped_mid_round(self, stop: RoundStopped, *, save: bool) -> str:
        """After a stop inside round `next_round`: keep the journal, save as of the round's start; returns a line for people.

        No optimizer step of the round happened (the trainer's safe points come before it), so
        the weights, optimizer and versions are still those of the last completed round; the
        checkpoint takes the journal mark, pending pool and provider state captured when the
        round began, exactly what a save after the previous round would have held. A resume
        then re-runs the round, as after a crash: what the round journaled (own rollouts,
        admitted foreign ones) is found again, nothing is lost or trained twice.
        """
        round_index = self.next_round
        assert self._round_start is not None and self._round_start.round == round_index
        kept = len(self.store.foreign_after(self._round_start.journal_rowid))
        line = f"stopped in round {round_index} while {stop.where}; nothing of round {round_index} was trained"
        if kept:
            line += f"; its {kept} accepted foreign rollouts are kept in the journal"
        if self.checkpoints is None or not self.config.checkpoint.at_exit:
            return line + "; no checkpoint is configured (checkpoint.at_exit)"
        if not save:
            if self.resumed_from is not None or self._saved_state:
                return line + f"; the last checkpoint already holds this state (resumes at round {round_index})"
            return line + f"; no round has finished yet, so there is nothing to checkpoint (a restart begins at round {round_index})"
        path = self.save_checkpoint(as_of=self._round_start)
        if path is None:
            return line + "; saving a checkpoint failed (see the log)"
        return line + f"; checkpoint {path.name} saved (resumes at round {round_index})"

    def phase(self, phase: str, detail: str = "") -> None:
        """Tell `on_phase` what the node is doing now (loading, calibrating, generating, training, ...)."""
        self._progress_at = time.monotonic()
        if self.on_phase is not None:
            self.on_phase(phase, detail)

    def _progress(self, phase: str, detail: str) -> None:
        """A progress report within a phase, at most every PROGRESS_EVERY_S."""
        if time.monotonic() - self._progress_at >= PROGRESS_EVERY_S:
            self.phase(phase, detail)

    def _catch_up(self, start: int) -> int:
        """The round to run first: `start`, or the swarm's latest round when peers are already past it.

        A node that joins late, or resumes from a checkpoint while the swarm trained on, would
        otherwise replay rounds nobody else is in, waiting out ``round_timeout`` in each. Probes
        the DHT for other peers' records at start + 1, + 2, + 4, ... then bisects: O(log gap)
        small DHT reads, no body is fetched. A solo node (no peers answer) keeps `start`, so a
        solo resume stays bit-identical to an uninterrupted run.
        """
        timeout = min(5.0, self.config.swarm.round_timeout)

        def ahead(round_index: int) -> bool:
            try:
                return bool(self.gossip.announced_by(round_index, timeout=timeout))
            except GossipError:
                return False

        if not ahead(start + 1):
            return start
        low, step = start + 1, 2  # low: a round known to have records
        while ahead(start + step):
            low, step = start + step, step * 2
        high = start + step  # no records here
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if ahead(middle) else (low, middle)
        log.info("the swarm is at round %d; skipping rounds %d..%d", low, start, low - 1)
        return low

    def run_round(self, round_index: int) -> RoundReport:
        """One full round; see the module docstring."""
        timings: dict[str, float] = {}
        started = time.perf_counter()
        oom_before = self._oom_retries
        self._beat("rollout")
        if self.gossip_supervisor is not None:
            self.gossip = self.gossip_supervisor.check()
        spec = SpeculationStats()
        self.phase("generating", f"round {round_index}")
        own = self._rollouts(round_index, spec)
        tokens_generated = sum(len(r.completion_ids) for r in own)
        timings["rollout"] = time.perf_counter() - started

        mark = time.perf_counter()
        self._beat("gossip")
        try:
            self._publish(round_index, own)
            self._calibrate()
            self.phase("waiting for peers", f"round {round_index}")
            admissions = self._collect(round_index)
        except GossipError as exc:  # the supervisor rebuilds gossip at the next round; train solo now
            log.error("round %d: gossip failed (%s); training on own rollouts this round", round_index, exc)
            admissions = []
        timings["gossip"] = time.perf_counter() - mark
        if self.trace is not None:
            self.trace.flush()

        mark = time.perf_counter()
        self._beat("train")
        self.control.check("gossiping")
        self.phase("training", f"round {round_index}")
        foreign = self._select_foreign(round_index, len(own))
        samples = self._train_samples(own, foreign)
        self.trainer.between_micro_batches = lambda done, total: self._train_progress(round_index, done, total)
        try:
            step = train_step_with_oom_retry(self.trainer, samples, on_retry=self._count_oom)
        except RoundStopped:
            self._pending.extend(foreign)  # not trained on: back in the pool as they were
            raise
        finally:
            self.trainer.between_micro_batches = None
        timings["train"] = time.perf_counter() - mark

        mark = time.perf_counter()
        self._beat("sync")
        self.phase("syncing", f"round {round_index}")
        # Only a leader's followers read the coded delta; without them the engine is written directly.
        sync_stats, delta_chunks = self.sync.sync(step.version, encode=self.publisher is not None)
        self.engine.weights_updated(sync_stats.tensors)
        delta_published = self._publish_delta(step.version, delta_chunks)
        timings["sync"] = time.perf_counter() - mark
        timings["round"] = time.perf_counter() - started

        accepted = [a for a in admissions if a.outcome == "accept"]
        foreign_rewards = [r.reward for a in accepted for r in a.rollouts]
        return RoundReport(
            node=self.name,
            round=round_index,
            policy_version=step.version,
            made=len(own),
            received=len(admissions),
            accepted=sum(len(a.rollouts) for a in accepted),
            rejected=sum(1 for a in admissions if a.outcome == "reject"),
            ignored=sum(1 for a in admissions if a.outcome == "ignore"),
            reward_mean=float(np.mean([r.reward for r in own])) if own else 0.0,
            foreign_reward_mean=float(np.mean(foreign_rewards)) if foreign_rewards else None,
            trained_samples=step.trained_samples,
            foreign_used=len(foreign),
            own_weight_mean=step.own.mean_weight if step.own else None,
            foreign_weight_mean=step.foreign.mean_weight if step.foreign else None,
            foreign_weight_max=step.foreign.max_weight if step.foreign else None,
            foreign_kept=step.foreign.kept_fraction if step.foreign else None,
            loss=step.loss,
            delta_bytes=sync_stats.delta_bytes,
            dense_bytes=sync_stats.dense_bytes,
            delta_density=sync_stats.density,
            delta_chunks=sync_stats.chunks,
            delta_published=delta_published,
            policy_hash=self.sync.engine.hash.hex(),
            engine_mismatch=self.sync.mismatched_elements(),
            tokens_generated=tokens_generated,
            seconds={k: round(v, 3) for k, v in timings.items()},
            oom_retries=self._oom_retries - oom_before,
            gossip_restarts=self.gossip_supervisor.restarts if self.gossip_supervisor is not None else 0,
            watchdog_stalls=self.watchdog.stalls() if self.watchdog is not None else 0,
            importance_by_source=_importance_by_source(step, own, foreign),
            importance_foreign=asdict(step.foreign) if step.foreign else None,
            kept_tokens=step.kept_tokens,
            ppo_clip_fraction=step.clip_fraction,
            kl=step.kl,
            **self._swarm_fields(),
            spec_drafted=spec.drafted,
            spec_accepted=spec.accepted,
            spec_acceptance=round(spec.acceptance_rate, 4) if spec.drafted else None,
            spec_tokens_per_forward=round(spec.tokens_per_forward, 3) if spec.target_forwards else None,
            spec_draft_seconds=round(spec.draft_seconds, 4),
            drafter_rollouts=self.engine.drafter.observed if self.engine.drafter is not None else 0,
        )

    def swarm_status(self) -> dict:
        """Gossip's swarm state (solo, reachability, known_peers, joined_via, ...) plus every peer's score row."""
        status = self.gossip.status()
        status["peer_scores"] = self.peer_scores.snapshot() if self.peer_scores is not None else {}
        return status

    def _swarm_fields(self) -> dict:
        status = self.gossip.status()
        scores = self.peer_scores.snapshot() if self.peer_scores is not None else {}
        return {
            "swarm_solo": status["solo"],
            "swarm_reachability": status["reachability"],
            "swarm_known_peers": status["known_peers"],
            "graylisted_peers": sum(1 for row in scores.values() if row["graylisted"]),
            "peer_scores": {peer: row["score"] for peer, row in scores.items()},
        }

    def _calibrate(self) -> None:
        """Measure the verify-cost curve now if it is still missing: the node is about to wait for peers anyway.

        Runs in the round's idle wait, once, right after the node's own batch is out: on the
        round loop's thread, so it competes with no phase of this node, and always in the
        first round, so which rounds decode speculatively does not depend on timing (a resume
        reads the cached curve and drafts from its first round, as the uninterrupted run did).
        """
        if self.calibration is None:
            return
        self.phase("calibrating", "speculation's verify-cost curve (once per machine)")
        started = time.perf_counter()

        def progress(text: str) -> None:
            self.control.check("calibrating")
            self.phase("calibrating", text)

        policy = self.calibration.policy
        curve = self.calibration.run(on_progress=progress)
        self.calibration = None
        paying = [b for b in curve.batches if policy.wants_drafts(b)]
        self.phase("calibrating", f"done in {time.perf_counter() - started:.1f}s; drafting pays at batch sizes {paying or 'none'}")

    def _generation_progress(self, round_index: int, total: int) -> Callable[[int], None]:
        made = 0

        def on_tokens(added: int) -> None:
            nonlocal made
            made += added
            self.control.check(f"generating round {round_index}")
            self._progress("generating", f"round {round_index}: {made} tokens, {total} completions")

        return on_tokens

    def _train_progress(self, round_index: int, done: int, total: int) -> None:
        self.control.check(f"training round {round_index}")
        self._progress("training", f"round {round_index}: micro-batch {done + 1}/{total}")

    def _beat(self, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.beat("round", phase)

    def _count_oom(self, _size: int) -> None:
        self._oom_retries += 1

    def _checkpoint_after(self, report: RoundReport) -> RoundReport:
        self._beat("checkpoint")
        try:
            path = self._save()
        except CheckpointError as exc:
            log.error("checkpoint after round %d failed: %s", report.round, exc)
            return replace(report, checkpoint_error=str(exc))
        return replace(report, checkpoint=path.name if path is not None else "")

    def save_checkpoint(self, *, as_of: _RoundStart | None = None) -> Path | None:
        """Save a checkpoint now (between rounds, or `as_of` a stopped round's start); logs and returns None when it fails or none is configured."""
        try:
            return self._save(as_of)
        except CheckpointError as exc:
            log.error("checkpoint failed: %s", exc)
            return None

    def _save(self, as_of: _RoundStart | None = None) -> Path | None:
        if self.checkpoints is None:
            return None
        pending = as_of.pending if as_of is not None else self._pending
        meta = {
            "next_round": as_of.round if as_of is not None else self.next_round,
            "policy_version": self.trainer.version,
            "sync_version": self.sync.version,
            "fingerprint": self.fingerprint,
            "seed": self.seed,
            "journal_rowid": as_of.journal_rowid if as_of is not None else self.store.journal_high_water(),
            "replay_marks": self.store.replay_high_water(),
            "pending": [
                {"author": p.author, "round": p.round, "hash": rollout_content_hash(p.rollout).hex()} for p in pending
            ],
            "providers": as_of.providers if as_of is not None else {
                name: provider.state_dict() for name, provider in self.checkpoint_providers.items()
            },
            "drafter": "rebuilt from the rollout journal up to journal_rowid",
            # Scores are about peers' behaviour, not training state: never rolled back, only flushed here.
            "peers": "kept in peers.json (node/swarm/peers.py)",
        }
        if self.peer_scores is not None:
            self.peer_scores.save()
        return self.checkpoints.save(training_snapshot(self.trainer.model, self.trainer.optimizer, meta))

    def resume(self, checkpoint: Checkpoint) -> None:
        """Continue from ``checkpoint``: weights, optimizer, RNGs, round, versions, pending foreign rollouts."""
        meta = checkpoint.meta
        if meta["fingerprint"] != self.fingerprint:
            raise CheckpointError(
                f"checkpoint {checkpoint.path} was made for model fingerprint {meta['fingerprint']}, this config loads "
                f"{self.fingerprint}: run with --no-resume to start from the initial weights, or use another --home"
            )
        restore_training(checkpoint, self.trainer.model, self.trainer.optimizer)
        self.trainer.version = int(meta["policy_version"])
        self.sync.reset(int(meta["sync_version"]))  # the engine equals the trainer cast to its dtype after every sync
        self.engine.weights_updated(None)
        self.next_round = checkpoint.next_round
        for name, state in meta.get("providers", {}).items():
            if name in self.checkpoint_providers:
                self.checkpoint_providers[name].load_state_dict(state)
        self._pending = self._restore_pending(meta["pending"], int(meta["journal_rowid"]))
        behind = {a: s for a, s in meta.get("replay_marks", {}).items() if self.store.replay_high_water().get(a, -1) < s}
        if behind:
            log.warning("the rollout journal is older than checkpoint %s (replay marks of %d author(s) missing)",
                        checkpoint.path.name, len(behind))
        self.resumed_from = str(checkpoint.path)
        log.info("resumed from %s: round %d, policy version %d, %d foreign rollouts pending",
                 checkpoint.path, self.next_round, self.trainer.version, len(self._pending))

    def _restore_pending(self, entries: list[dict], journal_rowid: int) -> list[_Pending]:
        """Pending foreign rollouts at the checkpoint, plus those journaled after it (admitted, never trained on)."""
        rows = self.store.get([bytes.fromhex(e["hash"]) for e in entries])
        pending = []
        for entry in entries:
            row = rows.get(bytes.fromhex(entry["hash"]))
            rollout = _decode_row(row.payload) if row is not None else None
            if rollout is not None:
                pending.append(_Pending(entry["author"], int(entry["round"]), rollout))
        for row in self.store.foreign_after(journal_rowid):
            rollout = _decode_row(row.payload)
            if rollout is not None:
                pending.append(_Pending(row.author, row.round, rollout))
        return pending

    def _publish_delta(self, version: int, chunks: list[bytes]) -> bool:
        """A leader offers the delta its engine just applied to followers (see node/weights/follower.py)."""
        if self.publisher is None:
            return False
        self.publisher.gossip = self.gossip  # the supervisor may have rebuilt gossip since
        try:
            self.publisher.publish_step(version, chunks)
        except GossipError as exc:
            log.error("publishing the delta to version %d failed: %s; followers will catch up from a later one", version, exc)
            return False
        return True

    def _rollouts(self, round_index: int, spec: SpeculationStats) -> list[Rollout]:
        cfg = self.config.rollout
        tasks = self.tasks.prompts(seed=self.seed, round=round_index, count=cfg.prompts_per_round)
        seed = derive_seed(self.seed, "sampling", round_index)
        requests, owners = [], []
        for group, task in enumerate(tasks):
            prompt_ids = tuple(self.tasks.chat_prompt_ids(self.tokenizer, task))
            for i in range(cfg.num_generations):
                requests.append(GenerationRequest(prompt_ids=prompt_ids, seed=seed, sample_index=group * cfg.num_generations + i))
                owners.append(task)
        on_tokens = self._generation_progress(round_index, len(requests))
        if isinstance(self.engine, TorchEngine):
            def generate(chunk: list[GenerationRequest]) -> list:
                return self.engine.generate(chunk, self.sampling, stats=spec, on_tokens=on_tokens)
        else:  # vLLM decodes a whole call at once: a stop waits for it
            def generate(chunk: list[GenerationRequest]) -> list:
                return self.engine.generate(chunk, self.sampling, stats=spec)
        samples = generate_splitting_on_oom(generate, requests, on_split=self._count_oom)
        if self.engine.drafter is not None:
            for sample in samples:
                self.engine.drafter.observe(sample.prompt_ids, sample.completion_ids)
        if self.trace is not None:
            self.trace.record(
                TraceRecord(
                    node=self.name, own=True, author=self.identity.peer_id, round=round_index, prompt_key=task.prompt_id,
                    prompt_ids=list(sample.prompt_ids), completion_ids=list(sample.completion_ids),
                    sample_index=request.sample_index, seed=request.seed, policy_version=self.trainer.version,
                    finish_reason=sample.finish_reason,
                )
                for request, task, sample in zip(requests, owners, samples)
            )
        rollouts = []
        for request, task, sample in zip(requests, owners, samples):
            text = self.tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
            rollouts.append(
                Rollout(
                    prompt_id=task.prompt_id,
                    sample_index=request.sample_index,
                    seed=request.seed,
                    prompt_ids=np.asarray(sample.prompt_ids, dtype=np.uint32),
                    completion_ids=np.asarray(sample.completion_ids, dtype=np.uint32),
                    behaviour_logprobs=np.asarray(sample.logprobs, dtype=np.float32),
                    reward=float(self.tasks.reward(task, text)),
                    finish_reason=sample.finish_reason,
                )
            )
        return rollouts

    def _publish(self, round_index: int, rollouts: Sequence[Rollout]) -> None:
        batch = RolloutBatch(
            round=round_index,
            policy_version=self.trainer.version,
            fingerprint=self.fingerprint,
            rollouts=tuple(rollouts),
        )
        self._seq += 1
        body = seal(self.identity, Kind.ROLLOUTS, self._seq, encode_batch(batch))
        now = time.time()
        self.store.add_rollouts(
            [
                StoredRollout.from_rollout(
                    r, author=self.identity.peer_id, round=round_index, policy_version=self.trainer.version,
                    own=True, received_at=now,
                )
                for r in rollouts
            ]
        )
        self.gossip.publish(round_index, body)  # journaled first: a crash here loses nothing we made

    def _collect(self, round_index: int) -> list[Admission]:
        """Admit peers' batches: stragglers of the previous round, then this round's, waiting.

        The wait ends once ``expected_peers`` authors had a batch of this round accepted, or at
        ``round_timeout``. An author whose batches were all refused does not count, so a peer
        sending junk cannot end the wait before the honest peers' batches arrive.
        """
        swarm = self.config.swarm
        admissions = []
        if round_index > 0:
            stragglers = self.gossip.fetch_round(round_index - 1, timeout=min(5.0, swarm.round_timeout))
            admissions += [self._admit(round_index, item) for item in stragglers]
        deadline = time.monotonic() + swarm.round_timeout
        useful: set[str] = set()
        refused: set[str] = set()
        while True:
            self.control.check(f"waiting for peers' round-{round_index} batches")
            left = max(0.0, deadline - time.monotonic())
            self._progress("waiting for peers", f"round {round_index}: {len(useful)}/{swarm.expected_peers} peers' batches, {left:.0f}s left")
            fetched = self.gossip.wait_for_round(
                round_index, peers=swarm.expected_peers + len(refused), timeout=min(1.0, left)  # short: a stop is seen within a second
            )
            for item in fetched:
                admission = self._admit(round_index, item)
                admissions.append(admission)
                (useful if admission.outcome == "accept" else refused).add(item.author_peer_id)
            refused -= useful
            if len(useful) >= swarm.expected_peers or time.monotonic() >= deadline:
                return admissions

    def _admit(self, round_index: int, item: Fetched) -> Admission:
        """Run one fetched body through intake; score its sender, feed the drafter, queue what passed."""
        admission = self.intake.admit(
            item.author_peer_id, item.body, current_round=round_index, current_version=self.trainer.version
        )
        self.status.record_admission(admission, item.body)
        if self.peer_scores is not None:
            self.peer_scores.record(admission.blame(item.holder), admission.outcome, admission.reason)
        if admission.outcome == "accept":
            if self.engine.drafter is not None:  # peers' rollouts of shared prompts feed the drafter too
                for rollout in admission.rollouts:
                    self.engine.drafter.observe(rollout.prompt_ids.tolist(), rollout.completion_ids.tolist())
            if self.trace is not None:
                self.trace.record(
                    TraceRecord(
                        node=self.name, own=False, author=admission.author, round=round_index, prompt_key=r.prompt_id,
                        prompt_ids=r.prompt_ids.tolist(), completion_ids=r.completion_ids.tolist(), sample_index=r.sample_index,
                        seed=r.seed, policy_version=admission.policy_version, finish_reason=r.finish_reason,
                    )
                    for r in admission.rollouts
                )
            self._pending.extend(
                _Pending(admission.author, round_index, r, admission.policy_version) for r in admission.rollouts
            )
        return admission

    def _select_foreign(self, round_index: int, own_count: int) -> list[_Pending]:
        """SAPO-style mix: at most ``foreign_fraction`` of the step, whole groups, balanced over peers.

        Pending rollouts the intake no longer finds fresh (outside its round and policy-version
        windows, `Intake.still_fresh`) are dropped. Each author's groups queue with a reward spread first
        (only those carry a GRPO gradient), then freshest first; authors are served round-robin
        from an order that rotates every round, so no peer id is favoured when the budget runs out.
        """
        fresh = self.intake.still_fresh
        self._pending = [
            p for p in self._pending if fresh(p.round, p.policy_version, current_round=round_index, current_version=self.trainer.version)
        ]
        fraction = self.config.train.foreign_fraction
        budget = int(own_count * fraction / (1.0 - fraction)) if fraction > 0 else 0
        groups: dict[str, dict[str, list[_Pending]]] = defaultdict(lambda: defaultdict(list))
        for item in self._pending:
            groups[item.author][item.rollout.prompt_id].append(item)

        def priority(items: list[_Pending]) -> tuple[bool, int, int]:
            flat = len({i.rollout.reward for i in items}) < 2
            return flat, -max(i.round for i in items), -max(i.policy_version for i in items)

        queues = {author: sorted(by_prompt.values(), key=priority) for author, by_prompt in groups.items()}
        authors = sorted(queues)
        if authors:
            shift = round_index % len(authors)
            authors = authors[shift:] + authors[:shift]
        chosen: list[_Pending] = []
        while len(chosen) < budget and any(queues.values()):
            for author in authors:
                if queues[author] and len(chosen) < budget:
                    chosen.extend(queues[author].pop(0))
        taken = {id(p) for p in chosen}
        self._pending = [p for p in self._pending if id(p) not in taken]
        return chosen

    def _train_samples(self, own: Sequence[Rollout], foreign: Sequence[_Pending]) -> list[TrainSample]:
        samples = [_to_train_sample(r, OWN) for r in own]
        samples += [_to_train_sample(p.rollout, p.author) for p in foreign]
        return samples

    def serve_status(self) -> str | None:
        """Start the status server (``config.status``) and collect WARNING+ logs for it; returns its URL.

        The URL is also written to ``<home>/status.json``, where `hivespec status` and
        `hivespec dash` look for a local node when given no ``--node``.
        """
        if self.status.logs not in logging.getLogger().handlers:
            logging.getLogger().addHandler(self.status.logs)
        cfg = self.config.status
        if not cfg.enabled or self.status_server is not None:
            return self.status_server.url if self.status_server is not None else None
        self.status_server = StatusServer(self.status, self.control, host=cfg.host, port=cfg.port)
        write_status_file(node_home(self.config), self.status_server.url, name=self.name, peer_id=self.identity.peer_id)
        return self.status_server.url

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.status_server is not None:
            self.status_server.close()
            remove_status_file(node_home(self.config), self.status_server.url)
        logging.getLogger().removeHandler(self.status.logs)
        if self.trace is not None:
            self.trace.close()
        self.gossip.shutdown()
        self.store.close()
        if self.peer_scores is not None:
            self.peer_scores.save()
        if self.home_lock is not None:
            self.home_lock.close()


def _decode_row(payload: bytes) -> Rollout | None:
    verdict, rollout = decode_rollout(payload)
    if not verdict.ok:
        log.warning("a journaled rollout does not decode (%s); it is left out of the pending pool", verdict)
    return rollout


def _importance_by_source(step: StepStats, own: Sequence[Rollout], foreign: Sequence[_Pending]) -> dict[str, dict]:
    samples: dict[str, int] = defaultdict(int)
    samples[OWN] = len(own)
    for item in foreign:
        samples[item.author] += 1
    return {source: {**asdict(stats), "samples": samples[source]} for source, stats in step.sources.items()}


def _to_train_sample(rollout: Rollout, source: str) -> TrainSample:
    return TrainSample(
        prompt_ids=rollout.prompt_ids.tolist(),
        completion_ids=rollout.completion_ids.tolist(),
        behaviour_logprobs=rollout.behaviour_logprobs.tolist(),
        reward=rollout.reward,
        group=rollout.prompt_id,
        source=source,
    )
