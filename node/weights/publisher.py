"""The leader's side of policy following: publishes each step's delta, periodic snapshots and the head.

A leader (a node with `sync.publish` on) publishes, after every step, over gossip:
- "delta": the chunks of the step's delta (the very bytes its own engine applied), chunk i of
  the delta producing version v at slot `delta_slot(v, i)`;
- "snapshot": every `snapshot_every` versions, the cumulative delta from the base checkpoint
  (version 0, which every node loads) to the current weights, chunked the same way. A snapshot
  is a delta like any other, so it is as sparse as the run has been and needs no new format;
- "head" (slot 0): the latest version, its weights hash and the latest snapshot's version.

`follower.py` is the reading side. Owns the topic names and slots; never decodes a delta.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import numpy as np

from hivespec.node.swarm.gossip import Gossip
from hivespec.node.weights.sync import EngineWeights
from hivespec.protocol.delta import PolicyHead, TensorBits, TensorDelta, WeightDelta, encode_head
from hivespec.protocol.delta_encode import encode_delta
from hivespec.protocol.envelope import Kind, seal
from hivespec.protocol.identity import Identity
from hivespec.protocol.keys import delta_slot
from hivespec.protocol.limits import DEFAULT_LIMITS, Limits

log = logging.getLogger(__name__)

DELTA_TOPIC, SNAPSHOT_TOPIC, HEAD_TOPIC = "delta", "snapshot", "head"
HEAD_SLOT = 0


def cumulative_delta(base: Mapping[str, TensorBits], base_hash: bytes, base_version: int, engine: EngineWeights) -> WeightDelta:
    """The delta from saved base weights to the engine's current ones (a snapshot)."""
    tensors = []
    for name, current in engine.state.items():
        old, new = base[name].bits.reshape(-1), current.bits.reshape(-1)
        indices = np.flatnonzero(old != new)
        if indices.size:
            tensors.append(TensorDelta(name, tuple(current.bits.shape), current.dtype, indices, new[indices].copy()))
    return WeightDelta(base_version, engine.version, base_hash, engine.hash, tuple(tensors))


def base_state(engine: EngineWeights, bits: Mapping[str, np.ndarray]) -> dict[str, TensorBits]:
    return {name: TensorBits(t.dtype, bits[name]) for name, t in engine.state.items()}


class PolicyPublisher:
    """The leader's side: publishes each step's delta chunks, periodic snapshots and the head."""

    def __init__(self, gossip: Gossip, identity: Identity, engine: EngineWeights, *, snapshot_every: int = 8, limits: Limits = DEFAULT_LIMITS) -> None:
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self.gossip, self.identity, self.engine = gossip, identity, engine
        self.snapshot_every = snapshot_every
        self.limits = limits
        self.base_version, self.base_hash = engine.version, engine.hash
        self.base_bits = engine.snapshot_bits()
        self.snapshot_version = engine.version
        self._seq = time.time_ns() // 1000

    def _publish(self, topic: str, slot: int, body: bytes) -> None:
        self._seq += 1
        self.gossip.publish(slot, seal(self.identity, Kind.DELTA, self._seq, body), topic=topic)

    def publish_step(self, version: int, chunks: Sequence[bytes]) -> None:
        """Publish the chunks that took the engine to `version` (already applied), maybe a snapshot, then the head."""
        if version != self.engine.version:
            raise ValueError(f"publish the delta the engine applied last: engine is at {self.engine.version}, got {version}")
        self.publish_delta(version, chunks)
        if version % self.snapshot_every == 0:
            self.publish_snapshot()
        self.publish_head()

    def publish_delta(self, version: int, chunks: Sequence[bytes]) -> None:
        for i, chunk in enumerate(chunks):
            self._publish(DELTA_TOPIC, delta_slot(version, i), chunk)

    def publish_snapshot(self) -> int:
        """Publish the cumulative delta base -> current weights; returns its chunk count."""
        if self.engine.version == self.base_version:
            return 0
        delta = cumulative_delta(base_state(self.engine, self.base_bits), self.base_hash, self.base_version, self.engine)
        chunks = encode_delta(delta, base_state(self.engine, self.base_bits), limits=self.limits)
        for i, chunk in enumerate(chunks):
            self._publish(SNAPSHOT_TOPIC, delta_slot(delta.version, i), chunk)
        self.snapshot_version = delta.version
        log.info("published snapshot of version %d: %d chunks, %d bytes", delta.version, len(chunks), sum(map(len, chunks)))
        return len(chunks)

    def publish_resumed(self) -> None:
        """After the leader resumed from a checkpoint: a snapshot of where it is, and the head. Its followers may hold
        versions past it, of a history it abandoned; they rejoin from this snapshot (`Follower._rejoin`)."""
        self.publish_snapshot()
        self.publish_head()

    def publish_head(self) -> None:
        head = PolicyHead(self.engine.version, self.engine.hash, self.snapshot_version)
        self._publish(HEAD_TOPIC, HEAD_SLOT, encode_head(head))
