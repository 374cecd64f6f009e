"""The pool of admitted foreign rollouts waiting to be trained on, and which of them a step takes.

Owns four moves: `admit` queues what intake accepted, with each rollout's GRPO advantage over
its author's whole group (a group without a reward spread only where a step would take it:
`take_flat`); `room` says how many informative samples the next step could still take
(what the exchange fetches for, see `exchange.batches_to_fetch`); `select` takes a step's
SAPO-style share (prompt groups, balanced over authors, informative and fresh first; a group
larger than what is left of the budget gives its most informative samples, keeping their
whole-group advantages) after dropping what aged out; `restore` rebuilds the pool after a resume
from the checkpoint's entries plus what was journaled after it. It never validates a rollout
(intake did) and never touches torch: rollouts stay wire `Rollout`s until the trainer's samples
are made from them.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from hivespec.protocol.advantages import group_advantages
from hivespec.protocol.rollout import Rollout, decode_rollout, rollout_content_hash

if TYPE_CHECKING:
    from hivespec.node.training.store import RolloutStore, StoredRollout

log = logging.getLogger(__name__)


@dataclass
class PendingRollout:
    """An admitted foreign rollout waiting to be trained on."""

    author: str
    round: int  # the author's own step count (informational: nodes share no round numbers)
    rollout: Rollout
    policy_version: int = -1  # the author's policy version when it sampled (-1: unknown)
    born: float = 0.0  # when the author signed the batch (unix s)
    advantage: float = 0.0  # GRPO advantage over the author's whole group of this prompt, as admitted

    @property
    def informative(self) -> bool:
        """Whether it carries a GRPO gradient: a nonzero advantage (its group had a reward spread when admitted)."""
        return self.advantage != 0.0


class FreshCheck(Protocol):
    """Whether an admitted rollout may still be trained on (`Intake.still_fresh`: the staleness policy's one owner)."""

    def __call__(self, born: float, policy_version: int, *, current_version: int | None, now: float | None = None) -> bool: ...


class ForeignPool:
    """Admitted foreign rollouts, in admission order, until a step takes them or they age out.

    `foreign_fraction` caps the foreign share of a step; a pending rollout `still_fresh` no
    longer accepts is dropped at the next `select`. `take_flat`: a step also takes groups without
    a reward spread (no gradient) to fill its budget, for a trainer that runs them for its
    statistics (`train.flat_sample_stats`); otherwise such a group is never queued (intake has
    journaled it and the drafter has seen it): in a 7-minute hetero run, 48 to 126 flat samples
    had waited in a slow node's pool to age out, counted as pending and sorted through every step.
    """

    def __init__(self, *, foreign_fraction: float, still_fresh: FreshCheck, take_flat: bool = False) -> None:
        self.foreign_fraction = foreign_fraction
        self.still_fresh = still_fresh
        self.take_flat = take_flat
        self._pending: list[PendingRollout] = []

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def pending(self) -> tuple[PendingRollout, ...]:
        """The pool now, oldest admission first (a copy: safe to keep across rounds)."""
        return tuple(self._pending)

    def admit(self, author: str, round_index: int, rollouts: Iterable[Rollout], policy_version: int = -1, *, born: float) -> int:
        """Queue rollouts intake accepted from `author` (signed at `born`) during our round `round_index`; how many of them
        are informative (a nonzero advantage: a group with a reward spread)."""
        rollouts = list(rollouts)
        advantages = group_advantages([r.reward for r in rollouts], [r.prompt_id for r in rollouts])
        queued = [PendingRollout(author, round_index, r, policy_version, born, a) for r, a in zip(rollouts, advantages, strict=True)]
        self._pending.extend(self._takeable(queued))
        return sum(1 for p in queued if p.informative)

    def _takeable(self, items: list[PendingRollout]) -> list[PendingRollout]:
        """`items` less the groups (`_group`) without an informative sample, unless a step takes those (`take_flat`)."""
        if self.take_flat:
            return items
        informative = {_group(p) for p in items if p.informative}
        return [p for p in items if _group(p) in informative]

    def budget(self, own_count: int) -> int:
        """Foreign samples a step of `own_count` own ones takes at most (`foreign_fraction` of the step)."""
        fraction = self.foreign_fraction
        # Rounded before the floor: 4 own at a third is 1.9999999999999998 in floats, and means 2.
        return math.floor(round(own_count * fraction / (1.0 - fraction), 9)) if fraction > 0 else 0

    def room(self, own_count: int, policy_version: int, *, now: float | None = None) -> int:
        """Informative foreign samples the next step of `own_count` own ones could still take: its budget less the
        informative ones pending (what the swarm should bring before that step, and no more). Drops what
        `still_fresh` refuses first, as `select` does."""
        self._drop_stale(policy_version, now)
        return max(0, self.budget(own_count) - sum(1 for p in self._pending if p.informative))

    def put_back(self, items: Iterable[PendingRollout]) -> None:
        """Return rollouts a step took but never trained on (a stop inside the step), as they were."""
        self._pending.extend(items)

    def select(self, round_index: int, own_count: int, policy_version: int, *, now: float | None = None) -> list[PendingRollout]:
        """Take a step's foreign samples: at most ``foreign_fraction`` of it, whole groups, balanced over peers.

        Pending rollouts `still_fresh` refuses (older than the staleness window at `now`, or
        outside the policy-version window of `policy_version`) are dropped first. Each author's
        groups queue informative first (a nonzero advantage: only those carry a GRPO gradient; the
        rest of a group a step took part of keeps its whole-group advantages, though what is left of
        it may all have one reward), then freshest (by the author's signature time) and nearest our
        policy version first. Authors are served round-robin from an order that rotates every
        round, so no peer id is favoured when the budget runs out: first their informative groups,
        then, with what budget is left and where `take_flat`, their flat ones. What is taken leaves the pool.
        """
        self._drop_stale(policy_version, now)
        budget = self.budget(own_count)
        groups: dict[str, dict[str, list[PendingRollout]]] = defaultdict(lambda: defaultdict(list))
        for item in self._pending:
            groups[item.author][item.rollout.prompt_id].append(item)

        def priority(items: list[PendingRollout]) -> tuple[bool, float, int]:
            return not _informative_group(items), -max(i.born for i in items), min(abs(i.policy_version - policy_version) for i in items)

        # A group larger than the budget left gives its most informative samples first.
        queues = {
            author: [sorted(items, key=lambda i: -abs(i.advantage)) for items in sorted(by_prompt.values(), key=priority)]
            for author, by_prompt in groups.items()
        }
        authors = sorted(queues)
        if authors:
            shift = round_index % len(authors)
            authors = authors[shift:] + authors[:shift]
        chosen: list[PendingRollout] = []
        # Informative groups first across all authors, so one author's flat group never takes a step's place from
        # another's informative one; flat groups (no gradient: a forward for the statistics) only fill what is left.
        passes = (_informative_group, lambda group: True) if self.take_flat else (_informative_group,)
        for wanted in passes:
            while len(chosen) < budget and any(queue and wanted(queue[0]) for queue in queues.values()):
                for author in authors:
                    queue = queues[author]
                    if queue and wanted(queue[0]) and len(chosen) < budget:
                        chosen.extend(queue.pop(0)[: budget - len(chosen)])
        taken = {id(p) for p in chosen}
        self._pending = [p for p in self._pending if id(p) not in taken]
        return chosen

    def _drop_stale(self, policy_version: int, now: float | None) -> None:
        self._pending = [
            p for p in self._pending if self.still_fresh(p.born, p.policy_version, current_version=policy_version, now=now)
        ]

    @staticmethod
    def entries(pending: Sequence[PendingRollout]) -> list[dict]:
        """A checkpoint's record of `pending`: author, round, version, born and content hash each (the rollouts stay in the journal)."""
        return [
            {"author": p.author, "round": p.round, "version": p.policy_version, "born": p.born, "advantage": p.advantage,
             "hash": rollout_content_hash(p.rollout).hex()}
            for p in pending
        ]

    def restore(self, entries: Sequence[dict], journal_rowid: int, store: RolloutStore) -> None:
        """Replace the pool with a checkpoint's `entries` (read back from the journal) plus the foreign
        rollouts journaled after `journal_rowid` (admitted after the save, never trained on).

        A journal row that no longer decodes is left out (logged).
        """
        rows = store.get([bytes.fromhex(e["hash"]) for e in entries])
        pending, saved_advantage = [], []
        for entry in entries:
            row = rows.get(bytes.fromhex(entry["hash"]))
            rollout = _decode_row(row.payload) if row is not None else None
            if rollout is not None:
                born = float(entry.get("born", _born(row)))  # checkpoints from before born was kept: the journal's
                pending.append(PendingRollout(entry["author"], int(entry["round"]), rollout, int(entry.get("version", row.policy_version)), born))
                saved_advantage.append(entry.get("advantage"))
        for row in store.foreign_after(journal_rowid):
            rollout = _decode_row(row.payload)
            if rollout is not None:
                pending.append(PendingRollout(row.author, row.round, rollout, row.policy_version, _born(row)))
                saved_advantage.append(None)
        # Advantages not in the checkpoint: over each author's group of the prompt as restored.
        computed = group_advantages([p.rollout.reward for p in pending], [_group(p) for p in pending])
        for item, saved, fresh in zip(pending, saved_advantage, computed, strict=True):
            item.advantage = float(saved) if saved is not None else fresh
        self._pending = self._takeable(pending)


def _group(item: PendingRollout) -> str:
    """The GRPO group a pending rollout belongs to: its author's prompt."""
    return f"{item.author}/{item.rollout.prompt_id}"


def _informative_group(items: Sequence[PendingRollout]) -> bool:
    """Whether some sample of a (part of a) prompt group carries a gradient."""
    return any(i.informative for i in items)


def _born(row: StoredRollout) -> float:
    """When a journaled rollout's author signed it; for rows from before the journal kept that, when it arrived."""
    return row.received_at if row.born is None else row.born


def _decode_row(payload: bytes) -> Rollout | None:
    verdict, rollout = decode_rollout(payload)
    if not verdict.ok:
        log.warning("a journaled rollout does not decode (%s); it is left out of the pending pool", verdict)
    return rollout
