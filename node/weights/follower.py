"""Following a leader's policy through its published deltas (`publisher.py` is the leader's side).

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
from collections.abc import Callable
from dataclasses import dataclass, field

from hivespec.node.swarm.gossip import Gossip
from hivespec.node.weights.publisher import DELTA_TOPIC, HEAD_SLOT, HEAD_TOPIC, SNAPSHOT_TOPIC, base_state
from hivespec.node.weights.sync import EngineWeights
from hivespec.protocol.delta import PolicyHead, decode_head, read_header
from hivespec.protocol.envelope import Envelope, Kind, open_envelope
from hivespec.protocol.errors import UserError
from hivespec.protocol.keys import delta_slot
from hivespec.protocol.limits import DEFAULT_LIMITS, Limits

log = logging.getLogger(__name__)


class LeaderSilent(UserError):
    """No head from the leader within the follower's patience: a wrong peer id, a leader not publishing, no shared peer."""


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
        self._envelope_limits = dataclasses.replace(limits, max_clock_skew_s=limits.max_clock_skew_s + gossip.config.record_ttl)
        self.base_version, self.base_hash = engine.version, engine.hash
        self.base_bits = engine.snapshot_bits()
        self.head: PolicyHead | None = None
        self._head_seq = -1  # the sequence number the head was signed with: the newest signed head is the leader's now
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
            if self._forked(head):
                self._rejoin(head, report)
            elif head.version - self.engine.version > self.max_lag:
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
        for item in self.gossip.fetch_slot(HEAD_SLOT, topic=HEAD_TOPIC, timeout=self.fetch_timeout):
            envelope = self._envelope(item.author_peer_id, item.body)
            if envelope is None:
                continue
            verdict, head = decode_head(envelope.body)
            if not verdict.ok or head is None:
                log.debug("bad head from %s: %s", self.leader, verdict)
                continue
            # The newest signed, not the highest version: a leader resumed from a checkpoint goes back in versions.
            if envelope.seq > self._head_seq:
                self.head, self._head_seq = head, envelope.seq

    def _forked(self, head: PolicyHead) -> bool:
        """The leader's head is behind us, or at our version with other weights: it resumed from a checkpoint, and the
        versions we hold past it are a history it abandoned (its next deltas would fail on our weights every poll)."""
        version = self.engine.version
        return head.version < version or (head.version == version and head.hash != self.engine.hash)

    def _rejoin(self, head: PolicyHead, report: FollowReport) -> None:
        """Back onto the leader's history: its latest snapshot (a resumed leader publishes one), else the base."""
        log.warning("leader %s is at version %d and we at %d of a history it abandoned (it resumed from a checkpoint): "
                    "rejoining from its snapshot of version %d", self.leader, head.version, self.engine.version, head.snapshot)
        self._chunks.clear()  # the abandoned history's chunks share slots with the new one's
        self._failed_snapshots.clear()
        if head.snapshot == self.base_version:
            self.engine.restore(self.base_bits, version=self.base_version, digest=self.base_hash)
            report.snapshot = self.base_version
        else:
            self._try_snapshot(head, report, rejoining=True)

    def _try_snapshot(self, head: PolicyHead, report: FollowReport, *, rejoining: bool = False) -> bool:
        """Restore the base and apply the leader's latest snapshot, if it is ahead of us (or we `rejoin` its history)."""
        version = head.snapshot
        if (version <= self.engine.version and not rejoining) or version in self._failed_snapshots:
            return False
        chunks = self._fetch(SNAPSHOT_TOPIC, version)
        if chunks is None:
            return False
        verdict, delta = self.engine.decode(chunks, base=base_state(self.engine, self.base_bits), base_hash=self.base_hash)
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
        for item in self.gossip.fetch_slot(delta_slot(version, chunk), topic=topic, timeout=self.fetch_timeout):
            body = self._open(item.author_peer_id, item.body)
            if body is None:
                continue
            verdict, header = read_header(body)
            if not verdict.ok or header is None or (header.version, header.chunk) != (version, chunk):
                log.debug("%s slot (%d, %d) from %s holds a bad chunk: %s", topic, version, chunk, self.leader, verdict)
                continue
            self._chunks.setdefault((topic, version), {})[chunk] = body

    def _open(self, author: str, data: bytes) -> bytes | None:
        envelope = self._envelope(author, data)
        return None if envelope is None else envelope.body

    def _envelope(self, author: str, data: bytes) -> Envelope | None:
        if author != self.leader:
            return None
        verdict, envelope = open_envelope(data, limits=self._envelope_limits, expected_kind=Kind.DELTA)
        if not verdict.ok or envelope is None or envelope.peer_id != self.leader:
            log.debug("envelope from %s rejected: %s", author, verdict)
            return None
        return envelope

    def _drop_old(self) -> None:
        for key in [k for k in self._chunks if k[1] <= self.engine.version]:
            del self._chunks[key]


def follow(
    follower: Follower,
    *,
    poll_interval: float,
    until_version: int | None = None,
    on_report: Callable[[FollowReport, Follower], None] | None = None,
    leader_timeout: float | None = None,
) -> Follower:
    """Poll `follower` every `poll_interval` seconds until its engine reaches `until_version` (or forever).

    With `leader_timeout`, raises `LeaderSilent` when no head from the leader has been read that
    many seconds after the start (once one has, the follower waits for the leader's next versions
    as long as it runs).
    """
    started = time.monotonic()
    while until_version is None or follower.engine.version < until_version:
        report = follower.poll()
        if on_report is not None:
            on_report(report, follower)
        if follower.head is None and leader_timeout is not None and time.monotonic() - started >= leader_timeout:
            raise LeaderSilent(
                f"no policy head from leader {follower.leader} within {leader_timeout:g} s (sync.leader_timeout); check "
                "the peer id (`hivespec identity show` on the leader), that the leader runs with sync.publish: true, "
                "and that both reach a common bootstrap peer (--initial-peer)")
        if until_version is not None and follower.engine.version >= until_version:
            break
        time.sleep(poll_interval)
    return follower
