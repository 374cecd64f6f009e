"""Truncated importance weights: min(pi_train / pi_behaviour, clip) per token, with stats.

Behaviour log-probs arrive from peers, so they are untrusted numbers: the log-ratio is clamped
before exp and NaNs are zeroed, which keeps every weight finite and in [0, clip] whatever a
forged rollout claims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ImportanceStats", "truncated_importance_weights"]

# Below this log-ratio the weight is 0 in float32 anyway; the floor only keeps -inf out of exp.
_LOG_RATIO_FLOOR = -100.0


@dataclass(frozen=True)
class ImportanceStats:
    """Summary of one batch of importance weights; fractions are in [0, 1].

    tokens: kept (mask True) tokens. kept_fraction: tokens / all positions. truncated_fraction:
    share of kept tokens whose ratio exceeded clip. mean_weight, max_weight: over kept tokens.
    ess_fraction: effective sample size over n, (sum w)^2 / (n sum w^2), over kept tokens; 0.0
    when there are none or all their weights are 0.
    """

    tokens: int
    kept_fraction: float
    truncated_fraction: float
    mean_weight: float
    max_weight: float
    ess_fraction: float


def truncated_importance_weights(
    logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, clip: float = 2.0
) -> tuple[Tensor, ImportanceStats]:
    """Per-token weights min(exp(logp - behaviour_logp), clip), 0 where mask is False.

    Returns detached float32 weights of logp's shape and their ImportanceStats. A NaN log-ratio
    (e.g. both log-probs -inf) gives weight 0; +inf gives clip. Reading the stats syncs the device.
    """
    if not (math.isfinite(clip) and clip > 0.0):
        raise ValueError(f"clip must be a finite number > 0, got {clip}; 2.0 is a common choice")
    if logp.shape != behaviour_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp, behaviour_logp and mask must have one shape, got {tuple(logp.shape)}, "
            f"{tuple(behaviour_logp.shape)} and {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}; use mask.bool() or mask > 0")

    log_clip = math.log(clip)
    log_ratio = logp.detach().float() - behaviour_logp.detach().float()
    truncated = (log_ratio > log_clip) & mask
    log_ratio = torch.nan_to_num(log_ratio, nan=float("-inf")).clamp_(_LOG_RATIO_FLOOR, log_clip)
    weights = torch.where(mask, torch.exp(log_ratio), torch.zeros((), dtype=torch.float32, device=logp.device))
    # exp(log(clip)) can round a hair above clip in float32.
    weights = weights.clamp_(max=clip)
    return weights, _stats(weights, mask, truncated)


def _stats(weights: Tensor, mask: Tensor, truncated: Tensor) -> ImportanceStats:
    positions = mask.numel()
    kept = weights[mask].double()
    tokens = kept.numel()
    if tokens == 0:
        return ImportanceStats(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    total = kept.sum().item()
    squares = (kept * kept).sum().item()
    return ImportanceStats(
        tokens=tokens,
        kept_fraction=tokens / positions,
        truncated_fraction=int(truncated.sum().item()) / tokens,
        mean_weight=total / tokens,
        max_weight=kept.max().item(),
        ess_fraction=(total * total) / (tokens * squares) if squares > 0.0 else 0.0,
    )
