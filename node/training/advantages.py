"""GRPO's group-relative advantages: a pure function (no torch), shared by the trainer and the foreign pool."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], groups: Sequence[str], eps: float = 1e-4) -> list[float]:
    """GRPO advantages: (r - mean) / (std + eps) within each group; 0 for groups of one or no spread."""
    members: dict[str, list[int]] = defaultdict(list)
    for index, group in enumerate(groups):
        members[group].append(index)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        values = [rewards[i] for i in indices]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if len(values) < 2 or std < 1e-8:
            continue
        for i in indices:
            advantages[i] = (rewards[i] - mean) / (std + eps)
    return advantages
