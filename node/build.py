"""The composition root: builds a training node, a follower and a bootstrap peer from their config.

Every process that joins a swarm gets its gossip from `make_gossip(config.swarm, ...)`, so
`hivespec join`, `hivespec follow` and `hivespec bootstrap` honour the same swarm settings: the
private swarm (allowlist and secret), relays and NAT, announce addresses, the peers file and
the peer cache, and the libp2p key kept in the home folder (a stable peer id across restarts).
Each process holds its home's lock, so two processes never share one identity.

This module owns the order parts are built in (home and identity, tasks, model, precision,
engine, trainer, store, checkpoint, speculation, intake, gossip, supervision); each part reads
its own config section through its `from_config`. It runs nothing: the round loop is
`runtime.Node`, a follower's poll loop `weights.follower.follow`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from hivespec.node.config import ConfigError, InputError, NodeConfig, SwarmConfig
from hivespec.node.file_lock import FolderLock
from hivespec.node.heldout_probe import HeldoutProbe
from hivespec.node.identity_file import load_or_create_identity
from hivespec.node.inputs import check_home
from hivespec.node.model import attention
from hivespec.node.model.engine import TorchEngine
from hivespec.node.model.footprint import shape_of
from hivespec.node.model.loader import configure_threads, load_model, load_tokenizer, model_fingerprint
from hivespec.node.model.precision import (
    DTYPES,
    PrecisionPlan,
    default_cache_path,
    follower_engine_dtype,
    resolve_node_precision,
)
from hivespec.node.model.vllm_engine import VllmEngine, build_vllm_engine, require_vllm
from hivespec.node.runtime import Node, PhaseListener
from hivespec.node.speculation.policy import CurveCalibration, LengthAwarePolicy, build_speculation
from hivespec.node.speculation.trace import TraceWriter
from hivespec.node.supervise import MicroBatchFit, Watchdog
from hivespec.node.swarm.bootstrap import (
    CACHE_FILE,
    P2P_KEY_FILE,
    HomeLock,
    IdentityInUse,
    PeerCache,
    bootstrap_candidates,
)
from hivespec.node.swarm.gossip import Gossip
from hivespec.node.swarm.peers import PeerScores
from hivespec.node.swarm.private_files import check_member, load_private_swarm
from hivespec.node.swarm.supervisor import GossipSupervisor
from hivespec.node.tasks.source import TaskSource
from hivespec.node.trackers import RoundTrackers
from hivespec.node.training.checkpoint import CheckpointError, CheckpointManager, check_fingerprint
from hivespec.node.training.intake import Intake
from hivespec.node.training.store import RolloutStore
from hivespec.node.training.trainer import Trainer
from hivespec.node.weights.follower import Follower
from hivespec.node.weights.publisher import PolicyPublisher
from hivespec.node.weights.sync import EngineWeights, WeightSync
from hivespec.protocol.errors import UserError
from hivespec.protocol.identity import Identity
from hivespec.protocol.private import PrivateSwarm

log = logging.getLogger(__name__)


# ----- the swarm, the same way for every process -------------------------------------------


@dataclass
class GossipFactory:
    """Builds and starts this process's `Gossip`, the same way on every call.

    The supervisor calls it again to rebuild a gossip whose p2pd died: same identity, addresses,
    bootstrap candidates and private swarm; the peer cache is re-read, so peers learned since
    start are dialled too. Raises `GossipError` when the gossip cannot start (port taken,
    `require_peers` and nobody reachable).
    """

    swarm: SwarmConfig
    identity: Identity
    home: Path
    private: PrivateSwarm | None
    bootstrap: list[tuple[str, str]]
    peers: PeerScores | None = None
    require_peers: bool | None = None

    def __call__(self) -> Gossip:
        gossip = Gossip(
            self.identity,
            self.swarm,
            bootstrap=self.bootstrap,
            peer_cache=PeerCache.load(self.home / CACHE_FILE),
            # A stable libp2p peer id: peers' bootstrap addresses and caches stay valid across restarts.
            p2p_identity_path=str(self.home / P2P_KEY_FILE),
            private=self.private,
            peers=self.peers,
            require_peers=self.require_peers,
        )
        gossip.start()
        return gossip


def make_gossip(
    swarm: SwarmConfig,
    identity: Identity,
    home: Path,
    *,
    peers: PeerScores | None = None,
    require_peers: bool | None = None,
) -> GossipFactory:
    """Read what the `swarm` section points at (private swarm files, peers file, peer cache) and return the gossip factory.

    Raises ValueError naming the fix when the private swarm's files are inconsistent or
    unreadable (`inputs.check_swarm_inputs` reports the same before anything heavy starts).
    """
    private = load_private_swarm(swarm.swarm, allowlist_file=swarm.private.allowlist_file, secret_file=swarm.private.secret_file)
    bootstrap = bootstrap_candidates(
        swarm.initial_peers,
        peers_file=Path(swarm.peers_file).expanduser() if swarm.peers_file else None,
        cache=PeerCache.load(home / CACHE_FILE),
    )
    return GossipFactory(swarm, identity, home, private, bootstrap, peers=peers, require_peers=require_peers)


class HomeInUse(IdentityInUse, UserError):
    """Another running node holds this home (its identity): the user's to fix, one line, exit status 3.

    Still an `IdentityInUse` for callers that catch that; its own exit status lets a script tell
    "already running" from other mistakes (a supervisor need not start a second copy).
    """

    exit_status = 3


def claim_home(config: NodeConfig) -> tuple[Path, HomeLock, Identity]:
    """The node's home folder, its lock and its identity.

    Raises `HomeInUse` if another process holds the home, `InputError` when the home is a file or
    cannot be created, `KeyFileError` for a bad key file.
    """
    home = check_home(config)
    try:
        lock = HomeLock(home)
    except IdentityInUse as exc:
        raise HomeInUse(str(exc)) from None
    try:
        identity = load_or_create_identity(home / "identity.key")
    except BaseException:
        lock.close()
        raise
    return home, lock, identity


def claim_checkpoints(config: NodeConfig, home: Path) -> FolderLock:
    """A lock on the node's checkpoint folder (``checkpoint.dir``, else <home>/checkpoints) while the node runs.

    Two nodes with their own homes and one checkpoint.dir had resumed from each other's checkpoints,
    pruned them and removed each other's saves in progress as leftovers; the second is refused with
    `HomeInUse` naming the folder.
    """
    folder = config.checkpoint.folder(home)
    try:
        return FolderLock(folder)
    except BlockingIOError:
        raise HomeInUse(
            f"checkpoint.dir {str(folder)!r} is in use by another running hivespec node; two nodes saving there would "
            "resume from and prune each other's checkpoints. Give each node its own checkpoint.dir, or leave it unset "
            "(<home>/checkpoints)") from None


# ----- a bootstrap peer and a follower ------------------------------------------------------


@dataclass
class BootstrapPeer:
    """A DHT-only peer (no model, no training) that others bootstrap from."""

    identity: Identity
    gossip: Gossip
    private: PrivateSwarm | None


@contextmanager
def open_bootstrap_peer(config: NodeConfig) -> Iterator[BootstrapPeer]:
    """Start a bootstrap peer; shut its gossip down and release its home when the block ends.

    Raises `HomeInUse` (another process holds the home) or `GossipError` (it cannot start).
    """
    home, lock, identity = claim_home(config)
    try:
        # The first bootstrap peer of a swarm has nobody to reach: it never requires peers.
        factory = make_gossip(config.swarm, identity, home, require_peers=False)
        check_member(factory.private, identity, config.swarm)
        gossip = factory()
        try:
            yield BootstrapPeer(identity, gossip, factory.private)
        finally:
            gossip.shutdown()
    finally:
        lock.close()


@contextmanager
def open_follower(config: NodeConfig, leader: str) -> Iterator[Follower]:
    """`hivespec follow`: load the base checkpoint and join the swarm to mirror `leader`; tear both down after the block.

    Builds its engine copy the way a leader does (config.model loaded in fp32, cast to
    config.model.engine_dtype). Raises `HomeInUse` or `GossipError` as a node does.
    """
    configure_threads(config.model.threads)
    home, lock, identity = claim_home(config)
    try:
        factory = make_gossip(config.swarm, identity, home)
        check_member(factory.private, identity, config.swarm, leader=leader)  # before the model loads
        model = load_model(
            config.model.name, dtype=torch.float32, device=config.model.device,
            revision=config.model.revision, trust_remote_code=config.model.trust_remote_code,
        )
        model = model.to(follower_engine_dtype(config, model.config)).eval()
        engine = EngineWeights(TorchEngine(model).sync_parameters())
        gossip = factory()
        try:
            yield Follower(gossip, engine, leader, fetch_timeout=config.sync.fetch_timeout, max_lag=config.sync.max_lag)
        finally:
            gossip.shutdown()
    finally:
        lock.close()


# ----- a training node ----------------------------------------------------------------------


def _trace_writer(config: NodeConfig, identity: Identity) -> TraceWriter:
    """The rollout trace writer for ``speculation.trace_file``, its meta line naming the run's settings."""
    assert config.speculation.trace_file is not None
    rollout = config.rollout
    return TraceWriter(
        config.speculation.trace_file,
        meta={
            "node": config.name or identity.name, "author": identity.peer_id, "model": config.model.name,
            "engine_dtype": config.model.engine_dtype, "temperature": rollout.temperature, "top_p": rollout.top_p,
            "max_new_tokens": rollout.max_completion_length, "num_generations": rollout.num_generations,
            "prompts_per_round": rollout.prompts_per_round,
        },
    )


def _resolve_precision(config: NodeConfig, trainer_model: torch.nn.Module, threads: int) -> tuple[NodeConfig, PrecisionPlan]:
    """Decide model.engine_dtype and model.autocast where they are "auto" (node/model/precision.py).

    Returns the config with both made concrete, so every part built after sees the dtype it runs.
    """
    plan = resolve_node_precision(config, trainer_model, threads=threads)
    log.info("precision: %s", plan.describe())
    return plan.applied_to(config), plan


def _resolve_attention(
    config: NodeConfig, trainer_model: torch.nn.Module, engine_model: torch.nn.Module, threads: int, precision: PrecisionPlan
) -> attention.AttentionPlan:
    """Decide model.attention per role and train.share_prompts (node/model/attention.py); sets the native engine's kernel."""
    plan = attention.resolve_attention(config, trainer_model, engine_model, threads=threads, cache=default_cache_path(),
                                       autocast_dtype=precision.trainer.dtype)
    if plan.engine is not None and plan.engine.eager:
        engine_model.set_attn_implementation("eager")
    log.info("attention: %s", "; ".join(plan.describe()))
    return plan


def _check_completion_length(config: NodeConfig, model_config) -> None:
    """`ConfigError` where rollout.max_completion_length leaves no room for a prompt in the model's positions (the
    engine's ValueError at the first round's first prompt had ended the node in a traceback, after every measurement)."""
    positions = getattr(model_config, "max_position_embeddings", None)
    wanted = config.rollout.max_completion_length
    if isinstance(positions, int) and wanted >= positions:
        raise ConfigError(f"rollout.max_completion_length {wanted} leaves no room for a prompt in the model's {positions} "
                          f"positions ({config.model.name}); set it well below that, e.g. "
                          f"--set rollout.max_completion_length={positions // 2}")


def build_node(config: NodeConfig, *, local_nodes: int = 1, on_phase: PhaseListener | None = None) -> Node:
    """Build every part of a node from its config (loads the model, starts gossip).

    `on_phase(phase, detail)` hears what it is doing (loading the model, starting gossip) and
    becomes the node's `on_phase`. Speculation's verify-cost curve is not measured here: a node
    without a cached one starts decoding plainly (see `Node._calibrate`).
    """

    def phase(name: str, detail: str = "") -> None:
        if on_phase is not None:
            on_phase(name, detail)

    threads = configure_threads(config.model.threads, local_nodes=local_nodes)
    if config.model.engine == "vllm":
        require_vllm()  # before the model loads and the home is locked
    home, home_lock, identity = claim_home(config)  # HomeInUse if another node runs with this home's identity
    try:
        checkpoint_lock = claim_checkpoints(config, home)  # HomeInUse if another node saves its checkpoints there
    except BaseException:
        home_lock.close()
        raise
    peer_scores = PeerScores(home / "peers.json")
    # A leader serves several delta chunks per version, snapshots and its head.
    try:
        start_gossip = make_gossip(config.swarm, identity, home, peers=peer_scores)
        check_member(start_gossip.private, identity, config.swarm, trains=True)
    except BaseException:
        checkpoint_lock.close()
        home_lock.close()
        raise
    log.info("node %s (%s), %d torch threads, home %s", identity.name, identity.peer_id, threads, home)

    tasks = TaskSource.from_config(config.tasks)  # before the model: a bad task mix fails in seconds
    tasks.check_trainable()
    phase("loading", f"model {config.model.name}")
    source = {"revision": config.model.revision, "trust_remote_code": config.model.trust_remote_code}
    tokenizer = load_tokenizer(config.model.name, **source)
    trainer_model = load_model(config.model.name, dtype=DTYPES[config.model.train_dtype], device=config.model.device, **source)
    _check_completion_length(config, trainer_model.config)
    phase("loading", f"model {config.model.name}: choosing precision (bf16 or float32, measured once per machine)")
    config, precision = _resolve_precision(config, trainer_model, threads)
    engine_model = copy.deepcopy(trainer_model).to(DTYPES[config.model.engine_dtype]).eval().requires_grad_(False)
    trainer_model.requires_grad_(True)
    phase("loading", f"model {config.model.name}: choosing attention (eager or SDPA, a group's prompt once or not: measured once per machine)")
    attention_plan = _resolve_attention(config, trainer_model, engine_model, threads, precision)
    fingerprint = model_fingerprint(trainer_model.config, tokenizer)
    engine: TorchEngine | VllmEngine
    if config.model.engine == "vllm":
        engine = build_vllm_engine(config, engine_model, home=home)
    else:
        engine = TorchEngine.from_config(engine_model, config.rollout)
    sync = WeightSync(trainer_model, engine.sync_parameters())
    trainer = Trainer.from_config(trainer_model, config.train, temperature=config.rollout.temperature, autocast_dtype=precision.trainer.dtype,
                                  eager_attention=attention_plan.trainer.eager, share_prompts=attention_plan.sharing.share)
    trainer.check_logits()  # a model whose forward changes its logits in a way the trainer does not know is refused
    # Better said now than the kernel stopping the node minutes into its first round; a CPU node fits it again before
    # every step (a GPU's device memory is the out-of-memory retry's).
    memory = MicroBatchFit(config, shape_of(trainer_model.config.to_dict(), sum(p.numel() for p in trainer_model.parameters())))
    memory.fit(trainer)
    journal_hours = config.checkpoint.journal_hours
    store = RolloutStore(home / "rollouts.sqlite", keep_seconds=None if journal_hours is None else journal_hours * 3600)
    checkpoints = CheckpointManager(config.checkpoint.folder(home), keep=config.checkpoint.keep)
    checkpoint = checkpoints.load_latest() if config.checkpoint.resume else None
    if checkpoint is not None:
        try:  # the home was trained with another model: the user's --home and --model disagree
            check_fingerprint(checkpoint, fingerprint)
        except CheckpointError as exc:
            raise InputError(str(exc)) from None
    policy: LengthAwarePolicy | None = None
    calibration: CurveCalibration | None = None
    if config.speculation.enabled and isinstance(engine, TorchEngine):  # vLLM's own drafter is set at construction
        drafter, policy, calibration = build_speculation(
            config.speculation, engine, store, model_config=engine_model.config, dtype=config.model.engine_dtype,
            device=config.model.device, max_batch_size=config.rollout.max_batch_size,
            journal_rowid=int(checkpoint.meta["journal_rowid"]) if checkpoint is not None else None,
        )
        engine.set_speculation(drafter, policy)
    intake = Intake.from_config(
        config.train, fingerprint=fingerprint, vocab_size=trainer_model.config.vocab_size, tasks=tasks, tokenizer=tokenizer,
        store=store, private=start_gossip.private,
    )

    phase("starting gossip", f"swarm {config.swarm.swarm!r}")
    gossip = start_gossip()
    supervise = config.supervise
    watchdog = Watchdog(stall_after=supervise.stall_after)
    supervisor = GossipSupervisor(start_gossip, gossip)  # rebuilds a dead gossip from the same factory
    # The probe reads the supervisor's current gossip, so a rebuilt one is watched too.
    watchdog.watch("gossip", supervisor.healthy, every=supervise.gossip_probe_every, stall_after=supervise.stall_after)
    node = Node(
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
        checkpoints=checkpoints,
        watchdog=watchdog,
        gossip_supervisor=supervisor,
        peer_scores=peer_scores,
        home_lock=home_lock,
        checkpoint_lock=checkpoint_lock,
        # Built before any resume: snapshots are deltas from the base checkpoint (version 0).
        publisher=PolicyPublisher(gossip, identity, sync.engine, snapshot_every=config.sync.snapshot_every) if config.sync.publish else None,
        trace=_trace_writer(config, identity) if config.speculation.trace_file else None,
        precision=precision,
        attention=attention_plan.describe(),
        calibration=calibration,
        on_phase=on_phase,
        heldout=HeldoutProbe.from_config(config, tasks, tokenizer,
                                         max_positions=getattr(trainer_model.config, "max_position_embeddings", None)),
        memory=None if config.model.device.startswith("cuda") else memory,
        trackers=RoundTrackers.from_config(config, home),
    )
    if policy is not None:  # its adaptive state is part of a checkpoint
        node.checkpoint_providers["speculation"] = policy
    if checkpoint is not None:
        node.resume(checkpoint)
    watchdog.start()
    return node
