"""Our clock against our peers': the index finds batches by wall-clock time, so clocks must roughly agree.

Rollout batches are announced in time buckets (`index.bucket_of`, `swarm.index_bucket_s`: 30 s)
and chosen by the age their authors sign into them. A node whose clock is a minute behind the
swarm's announces into buckets its peers have stopped reading; one a minute ahead, into buckets
its peers read only a minute later, and either misjudges every batch's age by that minute.
Nothing fails loudly: the node just shares less, or nothing. A laptop back from sleep, a VM or
a WSL instance can drift that far.

So a node measures: after each (re)join it asks peers for their time (the reach stream's
``ping``, `nat.ReachService`, answers with it) and takes each peer's offset at the midpoint of
the request's round trip. `ClockCheck` keeps the latest offset of the last `KEPT_PEERS` peers and
warns, once per episode, where more than half of them (at least two) see our clock off the same
way by more than a third of a bucket (10 s at the default 30 s: a node that far behind announces in the
previous bucket a third of the time, and readers read that one only while the current is thin).
So a single lying or drifting peer can neither raise the warning nor keep it off. It only warns:
the clock a node signs with is never adjusted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from hivemind.p2p import P2P, PeerID

from hivespec.node.swarm.nat import ask

logger = logging.getLogger(__name__)

KEPT_PEERS = 9  # peers whose latest offset counts
MIN_PEERS = 2  # peers a verdict needs: with one, either clock may be the one that is off
JOIN_PEERS = 3  # peers asked right after the first join (a verdict in the node's first seconds)
ROUTINE_PEERS = 1  # peers asked at each re-bootstrap after that (drift; one small RPC a minute)
_MAX_RTT_S = 5.0  # a reply slower than this says little about the time it was sent; dropped


class ClockCheck:
    """Offsets of peers' clocks from ours (theirs minus ours, s) and the verdict they give.

    `bucket_s` is the index's bucket (`swarm.index_bucket_s`); `clock` the node's wall clock (`time.time`; a test
    shifts it).
    """

    def __init__(self, bucket_s: float, *, clock: Callable[[], float] = time.time) -> None:
        if bucket_s <= 0:
            raise ValueError(f"bucket_s must be > 0, got {bucket_s}")
        self.bucket_s = bucket_s
        self.tolerance_s = bucket_s / 3
        self.clock = clock
        self._offsets: OrderedDict[str, float] = OrderedDict()
        self.warning = ""  # the warning in force ("" while our clock agrees with our peers')

    def add(self, peer: str, sent: float, their_time: float, received: float) -> None:
        """One answer: we asked `peer` at `sent` and heard `their_time` back at `received` (both our clock)."""
        if not 0.0 <= received - sent <= _MAX_RTT_S or not isinstance(their_time, float) or not math.isfinite(their_time):
            return  # a slow round trip, our clock stepped meanwhile, or no time at all (a peer's NaN included)
        self._offsets[peer] = their_time - (sent + received) / 2
        self._offsets.move_to_end(peer)
        while len(self._offsets) > KEPT_PEERS:
            self._offsets.popitem(last=False)

    @property
    def peers(self) -> int:
        return len(self._offsets)

    def choose(self, peers: Sequence[PeerID], rng: random.Random | None = None) -> list[PeerID]:
        """Whom to ask now among `peers` (the routing table): `JOIN_PEERS` until that many answered, then `ROUTINE_PEERS`;
        peers not measured yet first, at random. A node that joined through one peer of a small swarm knows only it at
        first: the next questions go to the peers it met since, so a verdict (two peers at least) comes at its next
        re-bootstrap rather than whenever chance picks a second peer."""
        wanted = max(ROUTINE_PEERS, JOIN_PEERS - self.peers)
        shuffled = list(peers)
        (rng or random).shuffle(shuffled)
        shuffled.sort(key=lambda peer: peer.to_base58() in self._offsets)  # stable: the unmeasured first, each part shuffled
        return shuffled[:wanted]

    @property
    def offset_s(self) -> float | None:
        """The median of the peers' offsets (positive: our clock is behind theirs); None before any answer."""
        offsets = list(self._offsets.values())  # one C-level copy: status() reads this from another thread
        return statistics.median(offsets) if offsets else None

    def judge(self) -> None:
        """Warn (once per episode) or clear the warning from the offsets kept; called after each round of questions,
        so the order a round's answers arrive in cannot flip the verdict. Fewer than `MIN_PEERS` peers: no verdict."""
        offsets = list(self._offsets.values())
        if len(offsets) < MIN_PEERS:
            return
        behind = [o for o in offsets if o > self.tolerance_s]
        ahead = [o for o in offsets if o < -self.tolerance_s]
        off = behind if len(behind) * 2 > len(offsets) else ahead if len(ahead) * 2 > len(offsets) else []
        if not off:
            if self.warning:
                logger.warning("this machine's clock agrees with its peers' again (median offset %+.1f s over %d peers)",
                               self.offset_s, len(offsets))
            self.warning = ""
            return
        median = statistics.median(off)
        way = "behind" if median > 0 else "ahead of"
        warning = (f"this machine's clock is about {abs(median):.0f} s {way} its peers' ({len(off)} of {len(offsets)} peers "
                   f"measured): peers find batches by the time they are announced (index buckets of "
                   f"{self.bucket_s:g} s), so this node shares less or nothing; sync the clock (NTP: "
                   "`timedatectl set-ntp true`; in WSL, `wsl --shutdown` and start again)")
        if not self.warning:
            logger.warning("%s", warning)
        self.warning = warning


async def ask_time(p2p: P2P, peers: Sequence[PeerID], check: ClockCheck, timeout: float) -> None:
    """Ask `peers` for their time (the reach stream's ``ping``) at once and add each answer to `check`."""

    async def one(peer: PeerID) -> None:
        sent = check.clock()
        try:
            reply = await ask(p2p, peer, {"op": "ping"}, timeout)
        except Exception as exc:  # noqa: BLE001 - a peer that does not answer tells nothing about our clock
            logger.debug("clock: %s did not answer: %s: %s", peer, type(exc).__name__, exc)
            return
        their_time = reply.get("time")
        if isinstance(their_time, float):  # a node of an older hivespec answers without its time
            check.add(peer.to_base58(), sent, their_time, check.clock())

    await asyncio.gather(*(one(peer) for peer in peers))
    check.judge()
