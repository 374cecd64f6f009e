"""GRPO's group-relative advantages, and the count of a batch's samples with a gradient that index records announce.

Pure functions (no torch): the trainer's advantages for its own groups, the foreign pool's for each admitted
peer group, and `informative_samples`, the wire's definition of an announced batch's `informative` count
(`announce.py`), which every holder computes the same way from the body.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .rollout import Rollout


def group_advantages(rewards: Sequence[float], groups: Sequence[str], eps: float = 1e-4) -> list[float]:
    """GRPO advantages: (r - mean) / (std + eps) within each group; 0 for groups of one or no spread.

    Never raises on finite rewards: a group whose spread overflows float64 (a peer's claim such as
    [1e200, -1e200], read before any verifier has seen it) is given no signal, like a flat one.
    """
    members: dict[str, list[int]] = defaultdict(list)
    for index, group in enumerate(groups):
        members[group].append(index)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        values = [rewards[i] for i in indices]
        mean = sum(values) / len(values)
        # d * d overflows to inf where d ** 2 raises OverflowError
        std = math.sqrt(sum((v - mean) * (v - mean) for v in values) / len(values))
        if len(values) < 2 or not 1e-8 <= std < math.inf:
            continue
        for i in indices:
            advantages[i] = (rewards[i] - mean) / (std + eps)
    return advantages


def informative_samples(rollouts: Iterable[Rollout]) -> int:
    """How many of `rollouts` carry a GRPO gradient: a nonzero `group_advantages` over their prompt's group among them.

    A batch whose every group has one reward (all right or all wrong) has none: a reader with room for
    foreign samples to train on gains nothing from fetching it. Computed from the rewards the batch
    carries, which a reader recomputes (intake refuses a batch whose rewards its verifier does not
    reproduce), so any holder can check an announced count against the body.
    """
    rollouts = list(rollouts)
    advantages = group_advantages([r.reward for r in rollouts], [r.prompt_id for r in rollouts])
    return sum(1 for advantage in advantages if advantage != 0.0)
