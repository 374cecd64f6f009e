"""The round loop: one `Node` and its rounds (`run`, `run_round`). `build.py` builds the node's parts.

One round, and the module that owns each step:
  1. this round's prompts, their completions, our verifier's rewards   own_rollouts.make_rollouts
  2. own rollouts into the drafter and the trace                        speculation/feed.DrafterFeed
  3. journal, sign and publish our batch                                exchange.RoundExchange.publish
  4. (once) measure speculation's verify-cost curve while peers work    speculation/policy.CurveCalibration
  5. fresh peers' batches (what the pool has room for, at most K): intake, scores, drafter, pool
                                                                       exchange.RoundExchange.collect (ForeignPool.room)
  6. choose the step's foreign samples                                  training/foreign_pool.ForeignPool.select
  7. one GRPO step with importance weights, own and foreign samples     training/trainer.Trainer.step
  8. the trainer's weights into the engine (and to followers)           weights/sync.WeightSync.sync, weights/publisher
  9. the round's report, nested from each part's stats                  report.RoundReport
Between rounds: checkpoints (training/node_state.NodeState), held-out accuracy every
eval.every_rounds (heldout_probe.HeldoutProbe), trackers (report_to: trackers.RoundTrackers), status (status/board.StatusBoard),
pause/stop (status/board.RunControl), phases and heartbeats (progress.RoundProgress). After the
last: the latest policy for `hivespec export` (latest_policy.keep_node_policy). A round is
this node's own step: nodes share no round numbers, so a late or resumed node just goes on, and
takes whatever its peers published recently (`exchange.py`). Every part
comes in built, as an argument of `Node` (only the status server is started here, on request:
`serve_status`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hivespec.node.config import NodeConfig, node_home
from hivespec.node.exchange import RoundExchange
from hivespec.node.file_lock import FolderLock
from hivespec.node.heldout_probe import HeldoutProbe
from hivespec.node.latest_policy import keep_node_policy
from hivespec.node.model.engine import SamplingParams, SpeculationStats, TorchEngine
from hivespec.node.model.loader import stop_token_ids
from hivespec.node.model.precision import PrecisionPlan
from hivespec.node.model.vllm_engine import VllmEngine
from hivespec.node.own_rollouts import derive_seed, make_rollouts
from hivespec.node.process_memory import peak_resident_mb
from hivespec.node.progress import PhaseListener, RoundProgress
from hivespec.node.report import RolloutStats, RoundReport, SupervisionStats, SwarmStats
from hivespec.node.speculation.feed import DrafterFeed
from hivespec.node.speculation.policy import CurveCalibration, where_drafting_pays
from hivespec.node.speculation.trace import TraceWriter
from hivespec.node.status.board import BoardSources, NodeFacts, RoundStopped, RunControl, StatusBoard
from hivespec.node.status.server import StatusServer, remove_status_file, write_status_file
from hivespec.node.supervise import HeapTrimmer, MicroBatchFit, Watchdog, train_step_with_oom_retry
from hivespec.node.swarm.bootstrap import HomeLock
from hivespec.node.swarm.gossip import Gossip, GossipError
from hivespec.node.swarm.peers import PeerScores
from hivespec.node.swarm.supervisor import GossipSupervisor
from hivespec.node.tasks.source import TaskSource
from hivespec.node.trackers import RoundTrackers
from hivespec.node.training.checkpoint import Checkpoint, CheckpointError, CheckpointManager, RoundStart, StateProvider
from hivespec.node.training.foreign_pool import ForeignPool
from hivespec.node.training.intake import AdmissionTally, Intake
from hivespec.node.training.node_state import NodeState
from hivespec.node.training.store import RolloutStore
from hivespec.node.training.trainer import OWN, Trainer, TrainSample
from hivespec.node.weights.publisher import PolicyPublisher
from hivespec.node.weights.sync import WeightSync
from hivespec.protocol.identity import Identity

log = logging.getLogger(__name__)

REPORTS_KEPT = 1024  # reports Node.run returns: every round's for a run of rounds, the last ones for a node run forever


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
        checkpoint_lock: FolderLock | None = None,
        publisher: PolicyPublisher | None = None,
        trace: TraceWriter | None = None,
        precision: PrecisionPlan | None = None,
        attention: tuple[str, ...] = (),
        calibration: CurveCalibration | None = None,
        on_phase: PhaseListener | None = None,
        heldout: HeldoutProbe | None = None,
        trackers: RoundTrackers | None = None,
        memory: MicroBatchFit | None = None,
    ) -> None:
        self.config = config
        self.memory = memory  # fits the micro batch to the memory available before each step (a CPU node's), else None
        self.trackers = trackers  # report_to: each round's figures to tensorboard / wandb, None when none
        self.heldout = heldout  # the held-out accuracy probe (eval.every_rounds), None when off
        self.precision = precision  # what model.engine_dtype / model.autocast "auto" became, and why
        self.attention = attention  # what model.attention and train.share_prompts "auto" became, one line each with why
        self.calibration = calibration  # the verify-cost curve still to measure (speculation waits for it)
        self.stop_report = ""  # what a stop in the middle of a round kept and saved, for the CLI to print
        self._round_start: RoundStart | None = None  # captured as each round begins
        self._saved_state = False  # a checkpoint of the current training state exists (resumed from or saved)
        self.publisher = publisher
        self.peer_scores = peer_scores
        self.home_lock = home_lock
        self.checkpoint_lock = checkpoint_lock  # held while the node runs: one node saves in a checkpoint folder
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
        # Admitted foreign rollouts until a step takes them; the intake says which are still fresh.
        self.pool = ForeignPool(foreign_fraction=config.train.foreign_fraction, still_fresh=intake.still_fresh,
                                take_flat=config.train.flat_sample_stats)
        # Own and accepted rollouts into the drafter and the trace (speculation.trace_file, for bench/drafter_replay.py).
        self.feed = DrafterFeed(engine.drafter, trace, node=self.name)
        self.checkpoints = checkpoints
        self.watchdog = watchdog
        self.gossip_supervisor = gossip_supervisor
        self.next_round = 0  # a resume moves it to the checkpoint's round
        self.kept_policy: Path | None = None  # <home>/policy.json once `run` has kept the latest policy
        self.resumed_from: str | None = None
        # Parts with JSON-able state to checkpoint, by name (e.g. "speculation": the policy's adaptive state).
        self.checkpoint_providers: dict[str, StateProvider] = {}
        self.state = NodeState(checkpoints, trainer=trainer, sync=sync, engine=engine, store=store, pool=self.pool,
                               providers=self.checkpoint_providers, fingerprint=fingerprint, seed=self.seed, peer_scores=peer_scores)
        self._oom_retries = 0
        self._engine_mismatch: int | None = None  # engine elements off the trainer's cast at the last check (after a moving sync)
        self.control = RunControl()  # pause/resume/stop between rounds (dashboard, /control)
        self.progress = RoundProgress(self.control, on_phase=on_phase, watchdog=watchdog)
        self.status = StatusBoard(
            NodeFacts(
                name=self.name, peer_id=identity.peer_id, swarm=config.swarm.swarm, model=config.model.name,
                device=config.model.device, rounds_target=config.rounds, precision=NodeFacts.precision_fields(precision),
                attention=attention, micro_batch_wanted=config.train.micro_batch_size,
            ),
            BoardSources(  # read from the status server's threads; gossip may be rebuilt, so read through the node
                policy_version=lambda: self.trainer.version,
                gossip_stats=lambda: self.gossip.stats(),
                swarm_status=lambda: self.gossip.status(),
                peer_scores=peer_scores.snapshot if peer_scores is not None else dict,
                intake_counters=lambda: self.intake.counters,
                store_counts=store.counts,
            ),
            self.control,
        )
        self.exchange = RoundExchange(
            identity=identity, fingerprint=fingerprint, store=store, intake=intake, pool=self.pool, feed=self.feed,
            swarm=config.swarm, peer_scores=peer_scores, on_admission=self.status.record_admission, check=self.control.check,
            progress=self.progress.progress,
        )
        self.status_server: StatusServer | None = None
        self.sampling = SamplingParams(
            temperature=config.rollout.temperature,
            top_p=config.rollout.top_p,
            max_new_tokens=config.rollout.max_completion_length,
            stop_token_ids=stop_token_ids(tokenizer, getattr(getattr(trainer, "model", None), "generation_config", None)),
        )

    def run(self, on_report: Callable[[RoundReport], None] | None = None, *, keep: int = REPORTS_KEPT) -> list[RoundReport]:
        """Run rounds ``next_round`` .. ``config.rounds - 1`` (forever when 0); `control` can pause or stop it between rounds.

        A checkpoint is saved every ``checkpoint.every_rounds`` rounds and when the loop ends; then
        the node keeps its latest policy for `hivespec export` (`kept_policy`: the record's path,
        None when writing it failed) before the status says finished, however the node was run.
        Returns the last `keep` rounds' reports (a node run for days must not keep every one: each
        goes to `on_report` as it is made, and the command line keeps none).
        """
        reports: deque[RoundReport] = deque(maxlen=keep)
        heap = HeapTrimmer()
        if self.config.rounds and self.next_round >= self.config.rounds:  # else only the rows' header said anything
            log.warning("resumed at round %d: the %d rounds asked for (rounds counts from the first) are done, so none "
                        "runs; raise --rounds, 0 runs forever, --no-resume starts over", self.next_round, self.config.rounds)
        saved_at = self.next_round
        stopped: RoundStopped | None = None
        while self.config.rounds == 0 or self.next_round < self.config.rounds:
            if self.watchdog is not None and self.control.paused:
                self.watchdog.forget("round")  # paused on purpose is not a stall
            if not self.control.wait_to_run():
                break
            round_index = self.next_round
            self.status.round_started(round_index)
            self._round_start = self.state.at(round_index)
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
            if self.heldout is not None and self.heldout.due(self.next_round):
                report = replace(report, heldout_accuracy=self._heldout_accuracy())
            report = replace(report, peak_resident_mb=peak_resident_mb())
            if heap.maybe_trim():
                report = replace(report, resident_mb_after_trim=heap.resident_mb)
            self.status.record_round(report)
            if self.trackers is not None:
                self.trackers.log_round(report.to_dict())
            reports.append(report)
            if on_report is not None:
                on_report(report)
        if stopped is not None:
            self.stop_report = self._stopped_mid_round(stopped, save=self.config.checkpoint.at_exit and saved_at != self.next_round)
        elif self.config.checkpoint.at_exit and saved_at != self.next_round:
            self.save_checkpoint()
        if self.watchdog is not None:
            self.watchdog.forget("round")
        self.kept_policy = keep_node_policy(self)
        if self.trackers is not None:
            self.trackers.close()
        self.status.finished()
        return list(reports)

    def run_round(self, round_index: int) -> RoundReport:
        """One full round; see the module docstring."""
        timings: dict[str, float] = {}
        started = time.perf_counter()
        oom_before = self._oom_retries
        self.progress.beat("rollout")
        if self.gossip_supervisor is not None:
            self.gossip = self.gossip_supervisor.check()
        spec = SpeculationStats()
        self.progress.phase("generating", f"round {round_index}")
        completions = self.config.rollout.prompts_per_round * self.config.rollout.num_generations
        own = make_rollouts(self.engine, self.tasks, self.tokenizer, self.sampling, self.config.rollout, seed=self.seed,
                            round_index=round_index, stats=spec, on_tokens=self.progress.generating(round_index, completions),
                            on_split=self._count_oom,
                            max_positions=getattr(self.trainer.model.config, "max_position_embeddings", None))
        self.feed.feed(own, own=True, author=self.identity.peer_id, round_index=round_index, policy_version=self.trainer.version)
        timings["rollout"] = time.perf_counter() - started

        mark = time.perf_counter()
        self.progress.beat("gossip")
        need = None
        try:
            self.exchange.publish(self.gossip, round_index, own, self.trainer.version)
            self._calibrate()
            need = self.pool.room(len(own), self.trainer.version, now=time.time())
            if self.config.swarm.expected_peers:
                self.progress.phase("waiting for peers", f"round {round_index}")
            else:  # a public node waits for nobody: it fetches what its next step has room for, if anything
                room = f"room for {need} foreign samples" if self.gossip.known_peers() else "no peers known yet"
                self.progress.phase("fetching peers' batches", f"round {round_index}: {room}")
            admissions = self.exchange.collect(self.gossip, round_index, self.trainer.version, need=need)
        except GossipError as exc:  # the supervisor rebuilds gossip at the next round; train solo now
            log.error("round %d: gossip failed (%s); training on own rollouts this round", round_index, exc)
            admissions = []
        timings["gossip"] = time.perf_counter() - mark
        self.feed.flush()

        mark = time.perf_counter()
        self.progress.beat("train")
        self.control.check("gossiping")
        self.progress.phase("training", f"round {round_index}")
        version, now = self.trainer.version, time.time()
        foreign = self.pool.select(round_index, len(own), version, now=now)
        foreign_mix = {"foreign_ages_s": tuple(now - p.born for p in foreign),
                       "foreign_version_lags": tuple(version - p.policy_version for p in foreign),
                       "foreign_room": need, "foreign_pending": len(self.pool)}
        samples = [TrainSample.from_rollout(r, OWN) for r in own] + [TrainSample.from_rollout(p.rollout, p.author, advantage=p.advantage) for p in foreign]
        self.trainer.between_micro_batches = self.progress.training(round_index)
        if self.memory is not None:
            self.memory.fit(self.trainer, samples)
        try:
            step = train_step_with_oom_retry(self.trainer, samples, on_retry=self._count_oom)
        except RoundStopped:
            self.pool.put_back(foreign)  # not trained on: back in the pool as they were
            raise
        finally:
            self.trainer.between_micro_batches = None
        timings["train"] = time.perf_counter() - mark

        mark = time.perf_counter()
        self.progress.beat("sync")
        self.progress.phase("syncing", f"round {round_index}")
        # Only a leader's followers read the coded delta; without them the engine is written directly.
        moved = step.optimizer_steps > 0
        sync_stats, delta_chunks = self.sync.sync(step.version, encode=self.publisher is not None, trainer_moved=moved)
        if moved or self._engine_mismatch is None:
            # An update's sync is checked bit for bit where a kernel or the codec wrote it (positions, a decoded delta);
            # a tensor copied whole from the trainer's cast equals it by that copy (a CPU engine's every tensor: 0.18-0.20 s a
            # round on a 2-core AMD EPYC to compare them again). A step that moved nothing leaves the engine as last checked.
            first = self._engine_mismatch is None
            self._engine_mismatch = self.sync.mismatched_elements(skip=() if first else sync_stats.copied)
        self.engine.weights_updated(sync_stats.tensors)
        delta_published = self._publish_delta(step.version, delta_chunks)
        timings["sync"] = time.perf_counter() - mark
        timings["round"] = time.perf_counter() - started

        return RoundReport(
            node=self.name,
            round=round_index,
            rollouts=RolloutStats.of((len(r.completion_ids) for r in own), (r.reward for r in own)),
            admissions=AdmissionTally.of(admissions),
            train=step,
            sync=sync_stats,
            speculation=spec,
            swarm=SwarmStats.of(self.gossip.status(), self.peer_scores.snapshot() if self.peer_scores is not None else None),
            supervision=SupervisionStats(
                oom_retries=self._oom_retries - oom_before,
                gossip_restarts=self.gossip_supervisor.restarts if self.gossip_supervisor is not None else 0,
                watchdog_stalls=self.watchdog.stalls() if self.watchdog is not None else 0,
            ),
            delta_published=delta_published,
            policy_hash=self.sync.engine.hash.hex(),
            engine_mismatch=self._engine_mismatch,
            drafter_rollouts=self.feed.observed,
            seconds={k: round(v, 3) for k, v in timings.items()},
            **foreign_mix,
        )

    # ----- the round's steps, in order ------------------------------------------------------

    def _calibrate(self) -> None:
        """Measure the verify-cost curve now if it is still missing: the node is about to wait for peers anyway.

        Runs in the round's idle wait, once, right after the node's own batch is out: on the
        round loop's thread, so it competes with no phase of this node, and always in the
        first round, so which rounds decode speculatively does not depend on timing (a resume
        reads the cached curve and drafts from its first round, as the uninterrupted run did).
        """
        if self.calibration is None:
            return
        self.progress.phase("calibrating", "speculation's verify-cost curve (once per machine)")
        started = time.perf_counter()

        def progress(text: str) -> None:
            self.control.check("calibrating")
            self.progress.phase("calibrating", text)

        calibration = self.calibration
        calibration.run(on_progress=progress)
        self.calibration = None
        how = f"done in {time.perf_counter() - started:.1f}s" if calibration.measured else "found ready (another node on this machine measured it)"
        self.progress.phase("calibrating", f"{how}; {where_drafting_pays(calibration.policy)}")

    def _publish_delta(self, version: int, chunks: list[bytes]) -> bool:
        """A leader offers the delta its engine just applied to followers (see node/weights/publisher.py)."""
        if self.publisher is None:
            return False
        self.publisher.gossip = self.gossip  # the supervisor may have rebuilt gossip since
        try:
            self.publisher.publish_step(version, chunks)
        except GossipError as exc:
            log.error("publishing the delta to version %d failed: %s; followers will catch up from a later one", version, exc)
            return False
        return True

    def _heldout_accuracy(self) -> float | None:
        """The trainer's greedy accuracy on the probe's held-out questions (between rounds, on this thread); None when a
        stop request ended the scoring (the round is trained: the loop stops before the next one)."""
        questions = len(self.heldout.questions)
        about = f"held-out accuracy after {self.next_round} rounds"
        self.progress.beat("eval")
        self.progress.phase("evaluating", f"{about}: {questions} questions")

        def on_progress(line: str) -> None:  # every 10 s of scoring: alive, and how far
            self.progress.beat("eval")
            self.progress.phase("evaluating", f"{about}: {line}")

        started = time.perf_counter()
        try:
            accuracy = self.heldout.score(self.trainer.model, on_progress=on_progress,
                                          check_stop=lambda: self.control.check(f"scoring {about}"))
        except RoundStopped:
            log.info("%s: not scored, stopped after %.1f s", about, time.perf_counter() - started)
            return None
        log.info("held-out accuracy after %d rounds: %.3f (%d questions, %.1f s)", self.next_round, accuracy, questions,
                 time.perf_counter() - started)
        return accuracy

    # ----- checkpoints ----------------------------------------------------------------------

    def _checkpoint_after(self, report: RoundReport) -> RoundReport:
        self.progress.beat("checkpoint")
        try:
            path = self.state.save(self.state.at(self.next_round))
        except CheckpointError as exc:
            log.error("checkpoint after round %d failed: %s", report.round, exc)
            return replace(report, checkpoint_error=str(exc))
        return replace(report, checkpoint=path.name if path is not None else "")

    def save_checkpoint(self, *, as_of: RoundStart | None = None) -> Path | None:
        """Save a checkpoint now (between rounds, or `as_of` a stopped round's start); logs and returns None when it fails or none is configured."""
        try:
            return self.state.save(as_of if as_of is not None else self.state.at(self.next_round))
        except CheckpointError as exc:
            log.error("checkpoint failed: %s", exc)
            return None

    def resume(self, checkpoint: Checkpoint) -> None:
        """Continue from ``checkpoint``: weights, optimizer, RNGs, round, versions, pending foreign rollouts."""
        self.state.restore(checkpoint)
        self.next_round = checkpoint.next_round
        self.resumed_from = str(checkpoint.path)
        log.info("resumed from %s: round %d, policy version %d, %d foreign rollouts pending",
                 checkpoint.path, self.next_round, self.trainer.version, len(self.pool))
        if self.publisher is not None:  # followers may hold versions past the checkpoint: show them where we are
            try:
                self.publisher.publish_resumed()
            except GossipError as exc:
                log.warning("could not offer followers a snapshot of the resumed policy (%s); they rejoin at the next one", exc)

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

    # ----- supervision, status, shutdown ---------------------------------------------------

    def _count_oom(self, _size: int) -> None:
        self._oom_retries += 1

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
        self.feed.close()
        self.gossip.shutdown()
        self.store.close()
        if self.peer_scores is not None:
            self.peer_scores.save()
        if self.checkpoint_lock is not None:
            self.checkpoint_lock.close()
        if self.home_lock is not None:
            self.home_lock.close()
