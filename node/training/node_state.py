"""A node's training state as a checkpoint holds it: what a save captures and how a resume puts it back.

The state is the trainer's weights, optimizer and RNGs (checkpoint.py's snapshot), the policy
and sync versions, the round to run next, the rollout journal's marks, the foreign pool and the
registered providers' JSON state (the speculation policy's adaptive counters). The engine's
weights and the drafter are not saved: a resume recasts the engine from the trainer
(`WeightSync.reset`) and the drafter is rebuilt from the journal (node/speculation/feed.py).

Owns no loop and no network: the round loop (node/runtime.py) decides when to save.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hivespec.node.training.checkpoint import (
    Checkpoint,
    CheckpointManager,
    RoundStart,
    StateProvider,
    check_fingerprint,
    node_meta,
    restore_training,
    training_snapshot,
)
from hivespec.node.training.foreign_pool import ForeignPool

if TYPE_CHECKING:
    from hivespec.node.swarm.peers import PeerScores
    from hivespec.node.training.store import RolloutStore
    from hivespec.node.training.trainer import Trainer
    from hivespec.node.weights.sync import WeightSync

log = logging.getLogger(__name__)


class EngineReload(Protocol):
    """What a resume tells the engine after its weights were rewritten in place (`TorchEngine.weights_updated`)."""

    def weights_updated(self, tensors: object) -> None: ...


class NodeState:
    """Saves and restores one node's training state through `checkpoints` (None: checkpoints are off).

    `providers` is the node's own dict of named `StateProvider`s: entries added later are saved too.
    """

    def __init__(
        self,
        checkpoints: CheckpointManager | None,
        *,
        trainer: Trainer,
        sync: WeightSync,
        engine: EngineReload,
        store: RolloutStore,
        pool: ForeignPool,
        providers: dict[str, StateProvider],
        fingerprint: str,
        seed: int,
        peer_scores: PeerScores | None = None,
    ) -> None:
        self.checkpoints = checkpoints
        self.trainer = trainer
        self.sync = sync
        self.engine = engine
        self.store = store
        self.pool = pool
        self.providers = providers
        self.fingerprint = fingerprint
        self.seed = seed
        self.peer_scores = peer_scores

    def at(self, round_index: int) -> RoundStart:
        """What a checkpoint records besides the tensors, as of now, resuming at `round_index` (cheap: no tensors)."""
        return RoundStart(
            round=round_index,
            journal_rowid=self.store.journal_high_water(),
            pending=tuple(ForeignPool.entries(self.pool.pending)),
            providers={name: provider.state_dict() for name, provider in self.providers.items()},
        )

    def save(self, start: RoundStart) -> Path | None:
        """Save the trainer's state now with `start`'s marks; the new checkpoint's path (None: checkpoints are off).

        Raises CheckpointError when the save fails (the previous checkpoint is kept). Peer scores
        are flushed too; they are never rolled back (they judge peers, not training).
        """
        if self.checkpoints is None:
            return None
        meta = node_meta(start, policy_version=self.trainer.version, sync_version=self.sync.version, fingerprint=self.fingerprint,
                         seed=self.seed, replay_marks=self.store.replay_high_water())
        if self.peer_scores is not None:
            self.peer_scores.save()
        return self.checkpoints.save(training_snapshot(self.trainer.model, self.trainer.optimizer, meta))

    def restore(self, checkpoint: Checkpoint) -> None:
        """Put back weights, optimizer, RNGs, versions, providers' state and the foreign pool; recast the engine.

        Raises CheckpointError when `checkpoint` was made for another model or tokenizer. The round
        to run next is `checkpoint.next_round`.
        """
        check_fingerprint(checkpoint, self.fingerprint)
        meta = checkpoint.meta
        restore_training(checkpoint, self.trainer.model, self.trainer.optimizer)
        self.trainer.version = int(meta["policy_version"])
        self.sync.reset(int(meta["sync_version"]))  # the engine equals the trainer cast to its dtype after every sync
        self.engine.weights_updated(None)
        for name, state in meta.get("providers", {}).items():
            if name in self.providers:
                self.providers[name].load_state_dict(state)
        self.pool.restore(meta["pending"], int(meta["journal_rowid"]), self.store)
        behind = {a: s for a, s in meta.get("replay_marks", {}).items() if self.store.replay_high_water().get(a, -1) < s}
        if behind:
            log.warning("the rollout journal is older than checkpoint %s (replay marks of %d author(s) missing)",
                        checkpoint.path.name, len(behind))
