"""What gossip's two ways to find bodies share: one machinery, built once by `Gossip`.

`RolloutGossip` (rollouts by recency, `rollouts.py`) and `SlotGossip` (the weight topics,
`slots.py`) are both a `Machinery` plus what is their own: our index records (`IndexRecords`), the
bodies we serve (`BodyStore`) and the fetcher (`Fetcher`) are the same objects in both, so a body
fetched by one way is never fetched again by the other and both count into gossip's `stats`.

Loop-thread state: only gossip's event loop uses it (`Gossip` is the thread-safe front).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from hivespec.node.swarm.bodies import BodyStore
from hivespec.node.swarm.fetching import Fetcher
from hivespec.node.swarm.peers import PeerScores
from hivespec.node.swarm.records import IndexRecords
from hivespec.protocol.announce import AnnouncedBody
from hivespec.protocol.identity import Identity
from hivespec.protocol.private import PrivateSwarm


@dataclass(eq=False)
class Machinery:
    identity: Identity
    records: IndexRecords
    bodies: BodyStore
    fetcher: Fetcher
    peers: PeerScores | None
    private: PrivateSwarm | None
    stats: Counter  # gossip's counters (`Gossip.stats`)
    request_timeout: float  # seconds one DHT request or body download may take
    spawn: Callable[[Coroutine[Any, Any, Any]], None]  # starts a background task on gossip's loop

    def own_body(self, body: bytes, *, context: str, born: float, version: int, informative: int = -1) -> tuple[AnnouncedBody, bytes]:
        """Our announcement of `body` and the bytes we serve for it (AEAD-sealed under `context` in a private swarm).

        Any thread: it touches no loop state.
        """
        wire = self.private.seal_body(body, context=context) if self.private is not None else body
        return AnnouncedBody(self.identity.peer_id, hashlib.sha256(wire).digest(), len(wire), born, version, informative), wire

    def serve_own(self, item: AnnouncedBody, wire: bytes) -> None:
        """Serve our own body from now on, and never fetch it back from a peer that relays it."""
        self.bodies.keep(item.sha256, wire)
        self.fetcher.mark_done((item.sha256, item.author, item.size))
