"""The composition root: builds a node's parts from its config and runs its rounds.

One round: draw prompts -> generate (engine) -> reward (our verifier) -> sign and publish the
batch (gossip) -> collect peers' batches for the round -> admit them (intake) -> one GRPO step
with truncated importance weights over own and foreign samples (trainer) -> sparse delta into
the engine (sync) -> a ``RoundReport``. Only this module and the CLI build network, disk and
model objects; every part takes them as arguments.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from hivespec.node.config import NodeConfig, node_home
from hivespec.node.engine import GenerationRequest, SamplingParams, TorchEngine
from hivespec.node.gossip import Gossip
from hivespec.node.identity import load_or_create_identity
from hivespec.node.intake import Admission, Intake
from hivespec.node.model import configure_threads, load_model, load_tokenizer, model_fingerprint
from hivespec.node.store import RolloutStore, StoredRollout
from hivespec.node.sync import WeightSync
from hivespec.node.tasks.source import TaskSource
from hivespec.node.trainer import OWN, Trainer, TrainSample
from hivespec.protocol.envelope import Kind, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.rollout import Rollout, RolloutBatch, encode_batch

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


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

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Pending:
    """An admitted foreign rollout waiting to be trained on."""

    author: str
    round: int
    rollout: Rollout


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
        engine: TorchEngine,
        sync: WeightSync,
        tasks: TaskSource,
        intake: Intake,
        fingerprint: str,
    ) -> None:
        self.config = config
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
        stop = tokenizer.eos_token_id
        self.sampling = SamplingParams(
            temperature=config.rollout.temperature,
            top_p=config.rollout.top_p,
            max_new_tokens=config.rollout.max_completion_length,
            stop_token_ids=(stop,) if stop is not None else (),
        )

    def run(self, on_report: Callable[[RoundReport], None] | None = None) -> list[RoundReport]:
        """Run ``config.rounds`` rounds (forever when 0)."""
        reports = []
        round_index = 0
        while self.config.rounds == 0 or round_index < self.config.rounds:
            report = self.run_round(round_index)
            reports.append(report)
            if on_report is not None:
                on_report(report)
            round_index += 1
        return reports

    def run_round(self, round_index: int) -> RoundReport:
        """One full round; see the module docstring."""
        timings: dict[str, float] = {}
        started = time.perf_counter()
        own = self._rollouts(round_index)
        tokens_generated = sum(len(r.completion_ids) for r in own)
        timings["rollout"] = time.perf_counter() - started

        mark = time.perf_counter()
        self._publish(round_index, own)
        admissions = self._collect(round_index)
        timings["gossip"] = time.perf_counter() - mark

        mark = time.perf_counter()
        foreign = self._select_foreign(round_index, len(own))
        step = self.trainer.step(self._train_samples(own, foreign))
        timings["train"] = time.perf_counter() - mark

        mark = time.perf_counter()
        sync_stats, _ = self.sync.sync(step.version)
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
            engine_mismatch=self.sync.mismatched_elements(),
            tokens_generated=tokens_generated,
            seconds={k: round(v, 3) for k, v in timings.items()},
        )

    def _rollouts(self, round_index: int) -> list[Rollout]:
        cfg = self.config.rollout
        tasks = self.tasks.prompts(seed=self.seed, round=round_index, count=cfg.prompts_per_round)
        seed = derive_seed(self.seed, "sampling", round_index)
        requests, owners = [], []
        for group, task in enumerate(tasks):
            prompt_ids = tuple(self.tasks.chat_prompt_ids(self.tokenizer, task))
            for i in range(cfg.num_generations):
                requests.append(GenerationRequest(prompt_ids=prompt_ids, seed=seed, sample_index=group * cfg.num_generations + i))
                owners.append(task)
        samples = self.engine.generate(requests, self.sampling)
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
        self.gossip.publish(round_index, seal(self.identity, Kind.ROLLOUTS, self._seq, encode_batch(batch)))
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

    def _collect(self, round_index: int) -> list[Admission]:
        """Admit peers' batches: stragglers of the previous round, then this round's (waiting)."""
        swarm = self.config.swarm
        fetched = []
        if round_index > 0:
            fetched += self.gossip.fetch_round(round_index - 1, timeout=min(5.0, swarm.round_timeout))
        fetched += self.gossip.wait_for_round(round_index, peers=swarm.expected_peers, timeout=swarm.round_timeout)
        admissions = []
        for item in fetched:
            admission = self.intake.admit(item.author_peer_id, item.body, current_round=round_index)
            admissions.append(admission)
            if admission.outcome == "accept":
                self._pending.extend(_Pending(admission.author, round_index, r) for r in admission.rollouts)
        return admissions

    def _select_foreign(self, round_index: int, own_count: int) -> list[_Pending]:
        """SAPO-style mix: at most ``foreign_fraction`` of the step, whole groups, round-robin over peers."""
        window = self.config.train.staleness_rounds
        self._pending = [p for p in self._pending if p.round >= round_index - window]
        fraction = self.config.train.foreign_fraction
        budget = int(own_count * fraction / (1.0 - fraction)) if fraction > 0 else 0
        groups: dict[str, dict[str, list[_Pending]]] = defaultdict(lambda: defaultdict(list))
        for item in self._pending:
            groups[item.author][item.rollout.prompt_id].append(item)
        queues = {author: list(by_prompt.values()) for author, by_prompt in groups.items()}
        chosen: list[_Pending] = []
        while len(chosen) < budget and any(queues.values()):
            for author in sorted(queues):
                if queues[author] and len(chosen) < budget:
                    chosen.extend(queues[author].pop(0))
        taken = {id(p) for p in chosen}
        self._pending = [p for p in self._pending if id(p) not in taken]
        return chosen

    def _train_samples(self, own: Sequence[Rollout], foreign: Sequence[_Pending]) -> list[TrainSample]:
        samples = [_to_train_sample(r, OWN) for r in own]
        samples += [_to_train_sample(p.rollout, p.author) for p in foreign]
        return samples

    def close(self) -> None:
        self.gossip.shutdown()
        self.store.close()


def _to_train_sample(rollout: Rollout, source: str) -> TrainSample:
    return TrainSample(
        prompt_ids=rollout.prompt_ids.tolist(),
        completion_ids=rollout.completion_ids.tolist(),
        behaviour_logprobs=rollout.behaviour_logprobs.tolist(),
        reward=rollout.reward,
        group=rollout.prompt_id,
        source=source,
    )


def build_node(config: NodeConfig, *, local_nodes: int = 1) -> Node:
    """Build every part of a node from its config (loads the model, starts gossip)."""
    threads = configure_threads(config.model.threads, local_nodes=local_nodes)
    home = node_home(config)
    home.mkdir(parents=True, exist_ok=True)
    identity = load_or_create_identity(home / "identity.key")
    log.info("node %s (%s), %d torch threads, home %s", identity.name, identity.peer_id, threads, home)

    tokenizer = load_tokenizer(config.model.name)
    trainer_model = load_model(config.model.name, dtype=_DTYPES[config.model.train_dtype], device=config.model.device)
    engine_model = copy.deepcopy(trainer_model).to(_DTYPES[config.model.engine_dtype]).eval()
    for p in engine_model.parameters():
        p.requires_grad_(False)
    trainer_model.requires_grad_(True)
    fingerprint = model_fingerprint(trainer_model.config, tokenizer)
    engine = TorchEngine(engine_model, max_batch_size=config.rollout.max_batch_size)
    sync = WeightSync(trainer_model, engine.sync_parameters())
    autocast = torch.bfloat16 if config.model.autocast and config.model.train_dtype == "float32" else None
    trainer = Trainer(
        trainer_model,
        learning_rate=config.train.learning_rate,
        weight_decay=config.train.weight_decay,
        max_grad_norm=config.train.max_grad_norm,
        tis_clip=config.train.tis_clip,
        micro_batch_size=config.train.micro_batch_size,
        temperature=config.rollout.temperature,
        autocast_dtype=autocast,
    )
    tasks = TaskSource.from_config(config.tasks)
    store = RolloutStore(home / "rollouts.sqlite")
    intake = Intake(
        fingerprint=fingerprint,
        vocab_size=trainer_model.config.vocab_size,
        tasks=tasks,
        tokenizer=tokenizer,
        store=store,
        staleness_rounds=config.train.staleness_rounds,
    )
    gossip = Gossip(
        identity,
        swarm=config.swarm.swarm,
        host=config.swarm.host,
        port=config.swarm.port,
        initial_peers=config.swarm.initial_peers,
    )
    gossip.start()
    return Node(
        config,
        identity=identity,
        gossip=gossip,
        store=store,
        tokenizer=tokenizer,
        trainer=trainer,
        engine=engine,
        sync=sync,
        tasks=tasks,
        intake=intake,
        fingerprint=fingerprint,
    )
