"""Keeping a node's gossip alive: probe it each round, rebuild a dead one with backoff.

The round loop calls `GossipSupervisor.check()` at the start of every round; a gossip whose
p2pd died or whose loop stopped answering is shut down and rebuilt from the same factory (same
Ed25519 identity, same host, port and bootstrap peers: `build.make_gossip`). A failed rebuild is
retried at later rounds with exponential backoff; rounds run solo meanwhile, never blocked.
Never imports hivemind itself: it only calls `Gossip.healthy`, `shutdown` and the factory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hivespec.node.swarm.gossip import Gossip

log = logging.getLogger(__name__)


@dataclass
class Backoff:
    """Exponential backoff: `initial`, `initial * factor`, ... capped at `maximum` seconds."""

    initial: float = 1.0
    factor: float = 2.0
    maximum: float = 60.0
    attempt: int = 0

    def next_delay(self) -> float:
        delay = min(self.maximum, self.initial * self.factor**self.attempt)
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0


class GossipSupervisor:
    """Keeps a working `Gossip`: probes it, and rebuilds it from `factory` when it died.

    `factory()` returns a started Gossip (same identity and addresses each time) or raises.
    `check()` never sleeps: while a rebuild keeps failing it returns the dead gossip and the next
    try waits for the backoff delay, so rounds go on solo in between.
    """

    def __init__(
        self,
        factory: Callable[[], Gossip],
        gossip: Gossip,
        *,
        backoff: Backoff | None = None,
        probe_timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.factory = factory
        self.gossip = gossip
        self.backoff = backoff or Backoff()
        self.probe_timeout = probe_timeout
        self.restarts = 0
        self.failures = 0
        self._clock = clock
        self._next_try = 0.0
        self._down_since: float | None = None

    def healthy(self) -> bool:
        try:
            return bool(self.gossip.healthy(timeout=self.probe_timeout))
        except Exception:
            log.debug("gossip probe raised", exc_info=True)
            return False

    def check(self) -> Gossip:
        """The current gossip, rebuilt first if the probe fails and the backoff allows a try."""
        if self.healthy():
            self.backoff.reset()
            self._down_since = None
            return self.gossip
        now = self._clock()
        if self._down_since is None:
            self._down_since = now
            log.error("gossip is down (p2pd exited or its loop stopped answering); rebuilding it with the same identity")
        if now < self._next_try:
            return self.gossip
        return self.restart()

    def restart(self) -> Gossip:
        """Shut the current gossip down and build a new one; on failure schedule the next try."""
        try:
            self.gossip.shutdown()
        except Exception:  # it is dead already; tearing down must not stop the rebuild
            log.debug("shutting the dead gossip down raised", exc_info=True)
        try:
            fresh = self.factory()
        except Exception as exc:  # GossipError's own line says what to check; the traceback only at debug
            self.failures += 1
            delay = self.backoff.next_delay()
            self._next_try = self._clock() + delay
            log.error("gossip rebuild failed (%s: %s); next try in %.0f s, rounds run solo meanwhile", type(exc).__name__,
                      " ".join(str(exc).split()), delay)
            log.debug("gossip rebuild failure", exc_info=True)
            return self.gossip
        self.gossip = fresh
        self.restarts += 1
        self.backoff.reset()
        down = self._clock() - self._down_since if self._down_since is not None else 0.0
        self._down_since = None
        log.warning("gossip rebuilt (restart %d, down %.1f s); listening on %s", self.restarts, down, fresh.visible_maddrs)
        return fresh
