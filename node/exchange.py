"""A step's exchange with the swarm: our batch out, fresh peers' batches in, through intake, into the pool.

Nodes share no round numbers. `publish` journals our rollouts first (a crash after it loses
nothing we made), then signs the batch and announces it in the index by recency. `collect` asks
gossip for fresh batches (younger than ``train.staleness_seconds``, and within
``train.staleness_versions`` of our policy where that is set), chosen by peer score with exploration, and
returns at once: a node never waits for another. It fetches what the next step can train on and no
more (`batches_to_fetch`): enough batches for the informative samples the pool still has room for
(`ForeignPool.room`), at the informative samples per batch seen lately, at most
``max_foreign_batches``; none while the pool holds enough; again at once for what is still missing
where the batches brought less than that, within the same K; never a batch whose record says none of
its samples carries a gradient (`publish` announces that count, and a reader's fetch checks it). (Fetching
K every step, a node whose peers' batches are as large as its foreign budget downloaded and
verified K times what it trained on, and the surplus aged out of the pool.) Only a small swarm of equal nodes may set
``expected_peers``: then a step fetches up to K and waits, at most ``round_timeout``, until that
many authors had a new batch accepted. Each body goes through intake, its sender is scored, and what passes
feeds the drafter and waits in the foreign pool. Owns the envelope sequence number; never trains
and never touches the engine. Gossip is passed per call: the supervisor may rebuild it between steps.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hivespec.node.training.store import StoredRollout
from hivespec.protocol.advantages import informative_samples
from hivespec.protocol.envelope import Kind, seal
from hivespec.protocol.limits import DEFAULT_LIMITS
from hivespec.protocol.rollout import Rollout, RolloutBatch, encode_batch

if TYPE_CHECKING:
    from hivespec.node.config import SwarmConfig
    from hivespec.node.speculation.feed import DrafterFeed
    from hivespec.node.swarm.gossip import Fetched, Gossip
    from hivespec.node.swarm.peers import PeerScores
    from hivespec.node.training.foreign_pool import ForeignPool
    from hivespec.node.training.intake import Admission, Intake
    from hivespec.node.training.store import RolloutStore
    from hivespec.protocol.identity import Identity

log = logging.getLogger(__name__)

_POLL_MIN_S, _POLL_MAX_S = 0.2, 1.0  # while expected_peers' batches are awaited, index reads back off
_YIELD_MEMORY = 0.3  # weight of the latest fetched batch in the informative-samples-per-batch average


def batches_to_fetch(need: int, per_batch: float | None, cap: int) -> int:
    """Batches a step fetches for `need` more informative samples, at `per_batch` informative samples a fetched batch
    (None: nothing fetched yet), at most `cap`: none when nothing is needed, `cap` while the yield is unknown or nil."""
    if need <= 0:
        return 0
    if not per_batch:
        return cap
    return min(cap, math.ceil(need / per_batch))


class RoundExchange:
    """Publishes our batches and admits peers' for one node.

    `check(where)` is called while waiting and may raise to stop the round (`RunControl.check`);
    `progress(phase, detail)` hears how the wait goes; `on_admission(admission, body)` hears every
    verdict (the status board's per-peer tallies).
    """

    def __init__(
        self,
        *,
        identity: Identity,
        fingerprint: str,
        store: RolloutStore,
        intake: Intake,
        pool: ForeignPool,
        feed: DrafterFeed,
        swarm: SwarmConfig,
        peer_scores: PeerScores | None = None,
        on_admission: Callable[[Admission, bytes], None] | None = None,
        check: Callable[[str], None] | None = None,
        progress: Callable[[str, str], None] | None = None,
    ) -> None:
        self.identity = identity
        self.fingerprint = fingerprint
        self.store = store
        self.intake = intake
        self.pool = pool
        self.feed = feed
        self.swarm = swarm
        self.peer_scores = peer_scores
        self.on_admission = on_admission
        self.check = check
        self.progress = progress
        self._seq = int(time.time() * 1000)  # monotonic across restarts without a stored counter
        self.informative_per_batch: float | None = None  # moving average over fetched batches (a refused one brings 0)

    def publish(self, gossip: Gossip, round_index: int, rollouts: Sequence[Rollout], policy_version: int) -> bool:
        """Journal our round's rollouts, then sign the batch and offer it to the swarm, saying how many of its samples
        carry a gradient (readers fetching for room to train skip a batch that has none). A round without rollouts
        (every prompt skipped as too long for the model) publishes nothing: False.

        A batch over gossip's body cap (4 MiB) or readers' rollouts a batch goes out as several, each prompt's group
        whole in one (a reader computes advantages over the group it admits); a group too large alone is left out, said.
        """
        if not rollouts:  # an empty batch would only take a slot of each peer's K and be ignored there
            log.warning("round %d: no own rollouts (every prompt was skipped): nothing published to the swarm", round_index)
            return False
        groups: dict[str, list[Rollout]] = {}
        for rollout in rollouts:
            groups.setdefault(rollout.prompt_id, []).append(rollout)
        bodies = self._bodies(round_index, list(groups.values()), policy_version, gossip.max_body_bytes)
        now = time.time()
        self.store.add_rollouts([
            StoredRollout.from_rollout(r, author=self.identity.peer_id, round=round_index, policy_version=policy_version,
                                       own=True, received_at=now, born=now)
            for r in rollouts
        ])
        # journaled first: a crash here loses nothing we made
        for body, part in bodies:
            gossip.publish_rollouts(body, version=policy_version, informative=informative_samples(part))
        return bool(bodies)

    def _bodies(self, round_index: int, groups: list[list[Rollout]], policy_version: int, max_bytes: int) -> list[tuple[bytes, list[Rollout]]]:
        """Sealed batches of `groups` (whole), each within `max_bytes` and readers' rollouts a batch, with their rollouts."""
        part = [r for group in groups for r in group]
        batch = RolloutBatch(round=round_index, policy_version=policy_version, fingerprint=self.fingerprint, rollouts=tuple(part))
        self._seq += 1
        body = seal(self.identity, Kind.ROLLOUTS, self._seq, encode_batch(batch))
        if len(body) <= max_bytes and len(part) <= DEFAULT_LIMITS.max_rollouts_per_batch:
            return [(body, part)]
        if len(groups) == 1:
            log.warning("round %d: prompt %s's group of %d rollouts is %d bytes as a batch, over the %d a body may hold (or "
                        "readers' %d rollouts): not published (lower rollout.num_generations or max_completion_length)",
                        round_index, part[0].prompt_id, len(part), len(body), max_bytes, DEFAULT_LIMITS.max_rollouts_per_batch)
            return []
        half = len(groups) // 2
        return (self._bodies(round_index, groups[:half], policy_version, max_bytes)
                + self._bodies(round_index, groups[half:], policy_version, max_bytes))

    def collect(self, gossip: Gossip, round_index: int, policy_version: int, *, need: int | None = None) -> list[Admission]:
        """Admit fresh peers' batches: enough for `need` more informative samples (None: as many as allowed), at most
        ``max_foreign_batches``, waiting only where ``expected_peers`` asks (then up to K, whatever the need). Without
        the wait, where the batches fetched brought fewer informative samples than `need`, it fetches again at once
        for the rest, within K, until nothing new is in sight.

        An author whose batches were all refused does not count toward ``expected_peers``, so a
        peer sending junk cannot end the wait before the honest peers' batches arrive.
        """
        swarm = self.swarm
        left = swarm.max_foreign_batches  # K, less what this call fetched
        short = None if swarm.expected_peers else need  # informative samples still wanted, as far as this call filled them
        deadline = time.monotonic() + (swarm.round_timeout if swarm.expected_peers else 0.0)
        admissions: list[Admission] = []
        useful: set[str] = set()
        interval = _POLL_MIN_S
        while True:
            k = left if short is None else batches_to_fetch(short, self.informative_per_batch, left)
            if k <= 0:
                return admissions
            if admissions and short is not None:  # a pass after one whose batches fell short (below)
                log.info("round %d: the batches fetched left room for %d informative foreign samples; fetching again "
                         "(%d of %d batches left this step)", round_index, short, left, swarm.max_foreign_batches)
            if self.check is not None:
                self.check("waiting for peers' new batches" if swarm.expected_peers else "fetching peers' batches")
            remaining = max(0.0, deadline - time.monotonic())
            if self.progress is not None and swarm.expected_peers:
                self.progress("waiting for peers", f"round {round_index}: {len(useful)}/{swarm.expected_peers} peers' new batches, {remaining:.0f}s left")
            fetched = gossip.sample_rollouts(
                k=k, max_age_s=self.intake.staleness_seconds, version_ok=self.intake.version_window(policy_version),
                # A step that waits for each peer's next batch takes one an author: a second would be the next step's.
                fill=not swarm.expected_peers,
                # Fetching for room to train: a batch its record calls flat would bring nothing to train (the pool keeps
                # no flat group unless the trainer takes them for its statistics).
                informative_only=short is not None and not self.pool.take_flat,
                # short while waiting: a stop is seen within a second or two
                timeout=min(swarm.request_timeout, max(1.0, remaining)) if swarm.expected_peers else swarm.request_timeout,
            )
            left -= len(fetched)
            for item in fetched:
                admission, informative = self._admit(round_index, item, policy_version)
                admissions.append(admission)
                if admission.outcome == "accept":
                    useful.add(item.author_peer_id)
                if short is not None:
                    short -= informative
            if not swarm.expected_peers:
                # Nobody to wait for, but where what came had fewer informative samples than the step has room for (fewer
                # than the yield seen lately, or batches whose holders did not say), fetch more at once for the rest (the
                # loop's next `k`), within K.
                if not fetched or short is None or short <= 0:
                    return admissions
                continue
            if len(useful) >= swarm.expected_peers or left <= 0 or time.monotonic() >= deadline:
                return admissions
            if not fetched:  # nothing new yet: poll again, backing off
                time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
                interval = min(2 * interval, _POLL_MAX_S)

    def _admit(self, round_index: int, item: Fetched, policy_version: int) -> tuple[Admission, int]:
        """Run one fetched body through intake; score its sender, feed the drafter, pool what passed. Returns the
        admission and how many informative samples it brought to the pool."""
        admission = self.intake.admit(item.author_peer_id, item.body, current_version=policy_version)
        if self.on_admission is not None:
            self.on_admission(admission, item.body)
        if self.peer_scores is not None:
            self.peer_scores.record(admission.blame(item.holder), admission.outcome, admission.reason)
        informative = 0
        if admission.outcome == "accept":  # peers' rollouts of shared prompts feed the drafter too
            self.feed.feed(admission.rollouts, own=False, author=admission.author, round_index=round_index,
                           policy_version=admission.policy_version)
            informative = self.pool.admit(admission.author, round_index, admission.rollouts, admission.policy_version,
                                          born=admission.born)
        last = self.informative_per_batch
        self.informative_per_batch = informative if last is None else last + _YIELD_MEMORY * (informative - last)
        return admission, informative
