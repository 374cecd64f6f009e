"""Following a leader's policy through its published deltas, and the leader's side that publishes them.

A leader (a node with `sync.publish` on) publishes, after every step, over gossip:
- "delta": the chunks of the step's delta (the very bytes its own engine applied), chunk i of
  the delta producing version v at slot `delta_slot(v, i)`;
- "snapshot": every `snapshot_every` versions, the cumulative delta from the base checkpoint
  (version 0, which every node loads) to the current weights, chunked the same way. A snapshot
  is a delta like any other, so it is as sparse as the run has been and needs no new format;
- "head" (slot 0): the latest version, its weights hash and the latest snapshot's version.

A follower loads the same base checkpoint, keeps a copy of its bits, and on every `poll` reads
the leader's head, then fetches and applies the missing versions in order (chunks that arrive
early, or out of order, wait in a buffer). When a version cannot be had (dropped, evicted) or it
is more than `max_lag` versions behind, it restores the base bits and applies the latest
snapshot, then continues with the deltas after it. Every delta is validated in full against the
follower's exact weights (base hash) before a single write, and the result must hash to what
the leader promised; a node joining late catches up the same way. Only bodies signed by the
leader's key are used.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hivespec.node.config import NodeConfig, node_home
from hivespec.node.identity_file import load_or_create_identity
from hivespec.node.model.engine import TorchEngine
from hivespec.node.model.loader import configure_threads, load_model
from hivespec.node.model.precision import follower_engine_dtype
from hivespec.node.swarm.gossip import Gossip
from hivespec.node.weights.sync import EngineWeights
from hivespec.protocol.delta import (
    PolicyHead,
    TensorBits,
    TensorDelta,
    WeightDelta,
    decode_head,
    encode_head,
    read_header,
)
from hivespec.protocol.delta_encode import encode_delta
from hivespec.protocol.envelope import Kind, open_envelope, seal
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


def _base_state(engine: EngineWeights, bits: Mapping[str, np.ndarray]) -> dict[str, TensorBits]:
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
        delta = cumulative_delta(_base_state(self.engine, self.base_bits), self.base_hash, self.base_version, self.engine)
        chunks = encode_delta(delta, _base_state(self.engine, self.base_bits), limits=self.limits)
        for i, chunk in enumerate(chunks):
            self._publish(SNAPSHOT_TOPIC, delta_slot(delta.version, i), chunk)
        self.snapshot_version = delta.version
        log.info("published snapshot of version %d: %d chunks, %d bytes", delta.version, len(chunks), sum(map(len, chunks)))
        return len(chunks)

    def publish_head(self) -> None:
        head = PolicyHead(self.engine.version, self.engine.hash, self.snapshot_version)
        self._publish(HEAD_TOPIC, HEAD_SLOT, encode_head(head))


@dataclass
class FollowReport:
    """What one `Follower.poll` did."""

    version: int
    leader_version: int | None
    applied: list[int] = field(default_factory=list)
    snapshot: int | None = None
    rejected: list[str] = field(default_factory=list)
    delta_bytes: int = 0
    seconds: float = 0.0

    @property
    def behind(self) -> int:
        return 0 if self.leader_version is None else max(0, self.leader_version - self.version)


class Follower:
    """Mirrors `leader`'s policy into `engine` (loaded from the base checkpoint) from its published deltas."""

    def __init__(
        self,
        gossip: Gossip,
        engine: EngineWeights,
        leader: str,
        *,
        fetch_timeout: float = 5.0,
        max_lag: int = 16,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.gossip, self.engine, self.leader = gossip, engine, leader
        self.fetch_timeout, self.max_lag = fetch_timeout, max_lag
        # Deltas are fetched while their gossip records live; accept envelopes that old.
        self._envelope_limits = dataclasses.replace(limits, max_clock_skew_s=limits.max_clock_skew_s + gossip.record_ttl)
        self.base_version, self.base_hash = engine.version, engine.hash
        self.base_bits = engine.snapshot_bits()
        self.head: PolicyHead | None = None
        self._chunks: dict[tuple[str, int], dict[int, bytes]] = {}
        self._failed_snapshots: set[int] = set()

    def poll(self) -> FollowReport:
        """Read the leader's head and catch up to it as far as the published bodies allow."""
        started = time.perf_counter()
        report = FollowReport(self.engine.version, None)
        self._read_head()
        head = self.head
        if head is not None:
            report.leader_version = head.version
            if head.version - self.engine.version > self.max_lag:
                self._try_snapshot(head, report)
            while self.engine.version < head.version:
                version = self.engine.version + 1
                chunks = self._fetch(DELTA_TOPIC, version)
                if chunks is None:
                    if not self._try_snapshot(head, report):
                        break
                    continue
                verdict, _ = self.engine.apply_chunks(chunks)
                self._chunks.pop((DELTA_TOPIC, version), None)
                if not verdict.ok:
                    report.rejected.append(f"delta {version}: {verdict}")
                    log.warning("delta to version %d from %s rejected: %s", version, self.leader, verdict)
                    if not self._try_snapshot(head, report):
                        break
                    continue
                report.applied.append(version)
                report.delta_bytes += sum(map(len, chunks))
        self._drop_old()
        report.version = self.engine.version
        report.seconds = time.perf_counter() - started
        return report

    def _read_head(self) -> None:
        for item in self.gossip.fetch_round(HEAD_SLOT, timeout=self.fetch_timeout, topic=HEAD_TOPIC):
            body = self._open(item.author_peer_id, item.body)
            if body is None:
                continue
            verdict, head = decode_head(body)
            if not verdict.ok or head is None:
                log.debug("bad head from %s: %s", self.leader, verdict)
                continue
            if self.head is None or head.version > self.head.version:
                self.head = head

    def _try_snapshot(self, head: PolicyHead, report: FollowReport) -> bool:
        """Restore the base and apply the leader's latest snapshot, if it is ahead of us."""
        version = head.snapshot
        if version <= self.engine.version or version in self._failed_snapshots:
            return False
        chunks = self._fetch(SNAPSHOT_TOPIC, version)
        if chunks is None:
            return False
        verdict, delta = self.engine.decode(chunks, base=_base_state(self.engine, self.base_bits), base_hash=self.base_hash)
        self._chunks.pop((SNAPSHOT_TOPIC, version), None)
        if verdict.ok and delta is not None:
            self.engine.restore(self.base_bits, version=self.base_version, digest=self.base_hash)
            verdict = self.engine.apply(delta)
        if not verdict.ok:
            self._failed_snapshots.add(version)
            report.rejected.append(f"snapshot {version}: {verdict}")
            log.warning("snapshot of version %d from %s rejected: %s", version, self.leader, verdict)
            return False
        report.snapshot = version
        report.delta_bytes += sum(map(len, chunks))
        return True

    def _fetch(self, topic: str, version: int) -> list[bytes] | None:
        """All chunks of the leader's delta (or snapshot) producing `version`, or None if some are missing."""
        have = self._chunks.setdefault((topic, version), {})
        if 0 not in have:
            self._fetch_slot(topic, version, 0)
        if 0 not in have:
            return None
        _, header = read_header(have[0])
        for i in range(1, header.chunks):
            if i not in have:
                self._fetch_slot(topic, version, i)
        if len(have) < header.chunks:
            return None
        return [have[i] for i in range(header.chunks)]

    def _fetch_slot(self, topic: str, version: int, chunk: int) -> None:
        for item in self.gossip.fetch_round(delta_slot(version, chunk), timeout=self.fetch_timeout, topic=topic):
            body = self._open(item.author_peer_id, item.body)
            if body is None:
                continue
            verdict, header = read_header(body)
            if not verdict.ok or header is None or (header.version, header.chunk) != (version, chunk):
                log.debug("%s slot (%d, %d) from %s holds a bad chunk: %s", topic, version, chunk, self.leader, verdict)
                continue
            self._chunks.setdefault((topic, version), {})[chunk] = body

    def _open(self, author: str, data: bytes) -> bytes | None:
        if author != self.leader:
            return None
        verdict, envelope = open_envelope(data, limits=self._envelope_limits, expected_kind=Kind.DELTA)
        if not verdict.ok or envelope is None or envelope.peer_id != self.leader:
            log.debug("envelope from %s rejected: %s", author, verdict)
            return None
        return envelope.body

    def _drop_old(self) -> None:
        for key in [k for k in self._chunks if k[1] <= self.engine.version]:
            del self._chunks[key]


def run_follower(
    config: NodeConfig,
    leader: str,
    *,
    until_version: int | None = None,
    on_report: Callable[[FollowReport, Follower], None] | None = None,
) -> Follower:
    """`hivespec follow`: load the base checkpoint, join the swarm and mirror `leader` until `until_version` (or forever).

    Builds its engine copy the way a leader does (config.model loaded in fp32, cast to
    config.model.engine_dtype) and its own gossip; returns the follower after the last poll,
    its gossip shut down.
    """
    configure_threads(config.model.threads)
    home = node_home(config)
    home.mkdir(parents=True, exist_ok=True)
    identity = load_or_create_identity(home / "identity.key")
    model = load_model(
        config.model.name, dtype=torch.float32, device=config.model.device,
        revision=config.model.revision, trust_remote_code=config.model.trust_remote_code,
    )
    dtype = follower_engine_dtype(config, model.config)
    model = model.to(dtype).eval()
    engine = EngineWeights(TorchEngine(model).sync_parameters())
    gossip = Gossip(identity, swarm=config.swarm.swarm, host=config.swarm.host, port=config.swarm.port,
                    initial_peers=config.swarm.initial_peers, record_ttl=config.swarm.record_ttl)
    gossip.start()
    follower = Follower(gossip, engine, leader, fetch_timeout=config.sync.fetch_timeout, max_lag=config.sync.max_lag)
    try:
        while until_version is None or engine.version < until_version:
            report = follower.poll()
            if on_report is not None:
                on_report(report, follower)
            if until_version is not None and engine.version >= until_version:
                break
            time.sleep(config.sync.poll_interval)
    finally:
        gossip.shutdown()
    return follower
