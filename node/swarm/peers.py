"""Peer scoring on gossipsub v1.1's model, with rate limits, a graylist and a file that survives restarts.

Every item a peer hands us gets a verdict (gossipsub's validator result):
- ``accept``: counts as a first delivery (P2, positive, capped);
- ``ignore``: honest but useless (stale, duplicate, replayed by a relay): no penalty;
- ``reject``: provably wrong (bad signature, bad schema, false reward, a body that does not hash
  to what was announced): counts as an invalid message (P4, weighted by its square, so a few
  rejects outweigh many deliveries).

score = w_deliveries * min(deliveries, cap) + w_invalid * invalid^2. Both counters decay
geometrically with time (per minute), invalid ones slowly, so a peer that misbehaved recovers
after tens of minutes of good behaviour, not after one reconnect. A peer whose score is below
`graylist_threshold` is graylisted: its records are skipped and its bodies are not fetched.

Rate limits: a token bucket per peer for items and one for bytes; a peer over its budget is
ignored (not penalized: bursts happen) until the bucket refills.

Scores persist in a small JSON file in the node's home (written atomically, at most every
`save_interval_s` and on close), with the time they were written, so decay continues across
restarts and a graylisted peer stays graylisted after we or it restart.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

Outcome = Literal["accept", "ignore", "reject"]
FILE_VERSION = 1
MAX_TRACKED_PEERS = 4096  # beyond this, the peers with the fewest interactions are forgotten


@dataclass(frozen=True)
class ScoreParams:
    """Weights, decays, thresholds and budgets; the defaults graylist a peer after 3 rejects."""

    delivery_weight: float = 1.0
    delivery_cap: float = 20.0
    delivery_decay_per_min: float = 0.9
    invalid_weight: float = -10.0
    invalid_decay_per_min: float = 0.98  # half-life ~34 minutes
    graylist_threshold: float = -50.0
    items_per_minute: float = 240.0
    item_burst: float = 64.0
    bytes_per_minute: float = 512 * 1024 * 1024
    byte_burst: float = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("delivery_decay_per_min", "invalid_decay_per_min"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.graylist_threshold >= 0 or self.invalid_weight >= 0:
            raise ValueError("graylist_threshold and invalid_weight must be negative")


@dataclass
class PeerRecord:
    """What we know of one peer; counters are floats because they decay."""

    deliveries: float = 0.0
    invalid: float = 0.0
    accepted: int = 0
    ignored: int = 0
    rejected: int = 0
    last_reason: str = ""
    updated: float = 0.0  # wall clock of the last decay
    item_tokens: float = -1.0  # -1: bucket full (not yet used)
    byte_tokens: float = -1.0
    refilled: float = 0.0


@dataclass
class PeerScores:
    """Scores of every peer we heard from; thread-safe (gossip's loop and the round loop both record)."""

    path: Path | None = None
    params: ScoreParams = field(default_factory=ScoreParams)
    save_interval_s: float = 10.0
    clock: Callable[[], float] = time.time
    _peers: dict[str, PeerRecord] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _saved_at: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.path is not None:
            self.path = Path(self.path)
            self._load()

    # ----- verdicts --------------------------------------------------------------------------

    def record(self, peer: str, outcome: Outcome, reason: str = "") -> None:
        """Count one item's verdict for `peer`; rejects lower its score."""
        if outcome not in ("accept", "ignore", "reject"):
            raise ValueError(f"outcome must be accept, ignore or reject, got {outcome!r}")
        with self._lock:
            rec = self._get(peer)
            if outcome == "accept":
                rec.accepted += 1
                rec.deliveries += 1
            elif outcome == "ignore":
                rec.ignored += 1
            else:
                was_listed = self._score(rec) < self.params.graylist_threshold
                rec.rejected += 1
                rec.invalid += 1
                rec.last_reason = reason[:64]
                if not was_listed and self._score(rec) < self.params.graylist_threshold:
                    logger.warning("peer %s graylisted (score %.1f, last reject: %s)", peer, self._score(rec), reason)
            self._maybe_save()

    def score(self, peer: str) -> float:
        """The peer's current score (0 for a peer we never heard from)."""
        with self._lock:
            rec = self._peers.get(peer)
            if rec is None:
                return 0.0
            self._decay(rec)
            return self._score(rec)

    def graylisted(self, peer: str) -> bool:
        """Whether the peer's score is below the graylist threshold."""
        return self.score(peer) < self.params.graylist_threshold

    def allow(self, peer: str, nbytes: int) -> bool:
        """Whether to take one more item of `nbytes` from `peer` now: not graylisted and within its budgets.

        Spends the budget when it returns True.
        """
        with self._lock:
            rec = self._get(peer)
            if self._score(rec) < self.params.graylist_threshold:
                return False
            p = self.params
            now = self.clock()
            if rec.item_tokens < 0:
                rec.item_tokens, rec.byte_tokens, rec.refilled = p.item_burst, p.byte_burst, now
            elapsed_min = max(0.0, now - rec.refilled) / 60.0
            rec.item_tokens = min(p.item_burst, rec.item_tokens + elapsed_min * p.items_per_minute)
            rec.byte_tokens = min(p.byte_burst, rec.byte_tokens + elapsed_min * p.bytes_per_minute)
            rec.refilled = now
            if rec.item_tokens < 1 or rec.byte_tokens < nbytes:
                return False
            rec.item_tokens -= 1
            rec.byte_tokens -= nbytes
            return True

    def snapshot(self) -> dict[str, dict[str, float | int | bool | str]]:
        """Per peer: score, graylisted, accepted, ignored, rejected, last_reason (for status and reports)."""
        with self._lock:
            out = {}
            for peer, rec in self._peers.items():
                self._decay(rec)
                score = self._score(rec)
                out[peer] = {
                    "score": round(score, 3),
                    "graylisted": score < self.params.graylist_threshold,
                    "accepted": rec.accepted,
                    "ignored": rec.ignored,
                    "rejected": rec.rejected,
                    "last_reason": rec.last_reason,
                }
            return out

    # ----- internals -------------------------------------------------------------------------

    def _get(self, peer: str) -> PeerRecord:
        rec = self._peers.get(peer)
        if rec is None:
            if len(self._peers) >= MAX_TRACKED_PEERS:
                # Forget the least-known peer that is not graylisted (a graylist must not be flushed by sybils).
                candidates = [
                    (r.accepted + r.ignored + r.rejected, p)
                    for p, r in self._peers.items()
                    if self._score(r) >= self.params.graylist_threshold
                ]
                if candidates:
                    del self._peers[min(candidates)[1]]
            rec = self._peers[peer] = PeerRecord(updated=self.clock())
        else:
            self._decay(rec)
        return rec

    def _decay(self, rec: PeerRecord) -> None:
        now = self.clock()
        minutes = max(0.0, now - rec.updated) / 60.0
        if minutes > 0:
            rec.deliveries *= self.params.delivery_decay_per_min**minutes
            rec.invalid *= self.params.invalid_decay_per_min**minutes
            rec.updated = now

    def _score(self, rec: PeerRecord) -> float:
        p = self.params
        return p.delivery_weight * min(rec.deliveries, p.delivery_cap) + p.invalid_weight * rec.invalid**2

    def _maybe_save(self) -> None:
        if self.path is not None and self.clock() - self._saved_at >= self.save_interval_s:
            self._write()

    def save(self) -> None:
        """Write the scores now (atomically); a no-op without a path."""
        if self.path is None:
            return
        with self._lock:
            self._write()

    def _write(self) -> None:
        data = {"version": FILE_VERSION, "saved_at": self.clock(), "peers": {p: asdict(r) for p, r in self._peers.items()}}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, separators=(",", ":")))
            os.replace(tmp, self.path)
            self._saved_at = self.clock()
        except OSError as exc:  # scores are an optimisation: a full disk must not stop the node
            logger.warning("could not save peer scores to %s: %s", self.path, exc)

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            logger.warning("peer scores file %s is unreadable (%s); starting from empty scores", self.path, exc)
            return
        if not isinstance(data, dict) or data.get("version") != FILE_VERSION or not isinstance(data.get("peers"), dict):
            logger.warning("peer scores file %s has an unknown layout; starting from empty scores", self.path)
            return
        names = {f.name for f in fields(PeerRecord)}
        for peer, raw in list(data["peers"].items())[:MAX_TRACKED_PEERS]:
            if isinstance(peer, str) and isinstance(raw, dict) and set(raw) == names:
                try:
                    self._peers[peer] = PeerRecord(**raw)
                except TypeError:
                    continue
