"""Filtered truncated importance weights for off-policy tokens, and their statistics.

A token sampled by a behaviour policy mu and trained under pi gets the ratio r = pi / mu. The
weight the loss uses is built in two stages, kept apart as in verl's rollout correction:

- filters decide which tokens stay in the loss at all (masked tokens leave its numerator and its
  denominator): token bounds (IcePop / masked IS: r outside [low, high]), sequence bounds on the
  geometric-mean ratio exp(mean log r) of each sequence (whole sequences go), and a veto on
  tokens whose behaviour probability mu is below a threshold;
- truncation caps the kept tokens' weight at C: w = min(r, C) (Yao et al.'s TIS).

Behaviour log-probs come from peers, so they are untrusted numbers. The log-ratio is computed in
float32 and clamped before exp, so every weight is finite and in [0, max(C, high)] whatever a
forged rollout claims; a NaN log-ratio (both log-probs -inf, or a NaN input) is masked. Equal
log-probs give a log-ratio of exactly 0 and a weight of exactly 1.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hivespec.kernels.host_transfer import to_host

__all__ = ["ImportanceStats", "ImportanceWeights", "importance_stats", "importance_stats_where", "importance_weights"]

# |log r| beyond this is "infinitely off-policy" for every filter; it keeps +-inf out of means and exp.
_LOG_RATIO_BOUND = 100.0


@dataclass(frozen=True)
class ImportanceStats:
    """Summary of one set of tokens' importance weights.

    tokens: valid positions. The fractions are shares of those: kept_fraction (in the loss),
    masked_fraction = 1 - kept_fraction (dropped by any filter or invalid), vetoed_fraction (the
    part of masked whose behaviour prob was under the veto), truncated_fraction (kept, weight
    capped at C). mean_weight and max_weight are over kept tokens. ess_fraction is the effective
    sample size over n, (sum w)^2 / (n sum w^2), with n = all valid tokens and masked ones at
    weight 0, so it is at most kept_fraction; 0.0 when nothing is kept or every weight is 0.
    """

    tokens: int
    kept_fraction: float
    masked_fraction: float
    vetoed_fraction: float
    truncated_fraction: float
    mean_weight: float
    max_weight: float
    ess_fraction: float


@dataclass(frozen=True)
class ImportanceWeights:
    """Per-token weights and flags, all of logp's shape; weights are detached float32, 0 where not kept."""

    weights: Tensor
    valid: Tensor
    kept: Tensor
    truncated: Tensor
    vetoed: Tensor

    def stats(self, where: Tensor | None = None) -> ImportanceStats:
        """Statistics of all tokens, or of those where ``where`` (bool, same shape) is True."""
        return importance_stats_where(self, [torch.ones_like(self.valid) if where is None else where])[0]

    @staticmethod
    def cat(parts: list[ImportanceWeights]) -> ImportanceWeights:
        """Flat concatenation of several results (e.g. one per micro batch)."""
        return ImportanceWeights(
            *(torch.cat([getattr(p, name).reshape(-1) for p in parts]) for name in ("weights", "valid", "kept", "truncated", "vetoed"))
        )


def importance_weights(
    logp: Tensor,
    behaviour_logp: Tensor,
    valid: Tensor,
    *,
    sequence_ids: Tensor | None = None,
    clip: float | None = 2.0,
    token_bounds: tuple[float, float] | None = None,
    sequence_bounds: tuple[float, float] | None = None,
    veto: float | None = None,
) -> ImportanceWeights:
    """Filtered, truncated weights r = exp(logp - behaviour_logp) per token.

    valid marks real tokens (False for padding: weight 0, not counted). sequence_ids (int64, same
    shape) groups tokens into sequences for sequence_bounds; by default each row of the last
    dimension is one sequence. clip is the truncation cap C (None: no truncation, which needs
    token_bounds so weights stay bounded); token_bounds and sequence_bounds are (low, high) ratio
    bounds outside which tokens / whole sequences are masked; veto masks tokens whose behaviour
    probability exp(behaviour_logp) is below it. Inputs are read detached; nothing here syncs.
    """
    _check(logp, behaviour_logp, valid, clip, token_bounds, sequence_bounds, veto)
    device = logp.device
    behaviour = behaviour_logp.detach().float()
    log_ratio = logp.detach().float() - behaviour
    kept = valid & ~torch.isnan(log_ratio)
    log_ratio = torch.nan_to_num(log_ratio, nan=_LOG_RATIO_BOUND).clamp_(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)

    if token_bounds is not None:
        low, high = token_bounds
        kept &= (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))
    if sequence_bounds is not None:
        ids = _sequence_ids(logp, sequence_ids).reshape(-1)
        flat_valid = valid.reshape(-1)
        # Sized by the largest id: one device sync per call (ids are the caller's, unbounded).
        count = torch.zeros(int(ids.max()) + 1 if ids.numel() else 0, dtype=torch.float64, device=device)
        total = torch.zeros_like(count)
        count.index_add_(0, ids, flat_valid.double())
        total.index_add_(0, ids, torch.where(flat_valid, log_ratio.reshape(-1).double(), 0.0))
        mean = total / count.clamp(min=1.0)
        low, high = sequence_bounds
        inside = (mean >= math.log(low)) & (mean <= math.log(high))
        kept &= inside[ids].reshape(logp.shape)
    vetoed = torch.zeros_like(valid)
    if veto is not None:
        vetoed = valid & (behaviour < math.log(veto))
        kept &= ~vetoed

    truncated = torch.zeros_like(valid)
    if clip is not None:
        truncated = kept & (log_ratio > math.log(clip))
        log_ratio = log_ratio.clamp_(max=math.log(clip))
    weights = torch.where(kept, torch.exp(log_ratio), torch.zeros((), dtype=torch.float32, device=device))
    if clip is not None:
        weights = weights.clamp_(max=clip)  # exp(log(C)) can round a hair above C in float32
    return ImportanceWeights(weights, valid.clone(), kept, truncated, vetoed)


def importance_stats(weights: Tensor, valid: Tensor, kept: Tensor, truncated: Tensor, vetoed: Tensor) -> ImportanceStats:
    """ImportanceStats of flat per-token tensors (see ImportanceWeights); reading it syncs the device once."""
    flags = ImportanceWeights(weights.reshape(-1), valid.reshape(-1), kept.reshape(-1), truncated.reshape(-1), vetoed.reshape(-1))
    return importance_stats_where(flags, [torch.ones_like(flags.valid)])[0]


def importance_stats_where(weights: ImportanceWeights, masks: list[Tensor]) -> list[ImportanceStats]:
    """ImportanceStats of the tokens under each bool mask (weights' shape), read from the device in one transfer."""
    rows = []
    for mask in masks:
        kept = weights.kept & mask
        kept_weights = torch.where(kept, weights.weights, torch.zeros((), dtype=weights.weights.dtype, device=mask.device)).double()
        flat = kept_weights.reshape(-1)
        rows.append(torch.stack([
            (weights.valid & mask).sum().double(),
            kept.sum().double(),
            flat.sum(),
            (flat * flat).sum(),
            (weights.vetoed & mask).sum().double(),
            (weights.truncated & mask).sum().double(),
            torch.cat([flat, flat.new_zeros(1)]).max(),  # weights are >= 0; 0.0 when nothing is kept
        ]))
    if not rows:
        return []
    (table,) = to_host([torch.stack(rows)])
    return [_stats_of_row(row) for row in table.tolist()]


def _stats_of_row(row: list[float]) -> ImportanceStats:
    tokens, n_kept, total, squares, vetoed, truncated, max_weight = row
    tokens, n_kept = int(tokens), int(n_kept)
    if tokens == 0:
        return ImportanceStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return ImportanceStats(
        tokens=tokens,
        kept_fraction=n_kept / tokens,
        masked_fraction=(tokens - n_kept) / tokens,
        vetoed_fraction=int(vetoed) / tokens,
        truncated_fraction=int(truncated) / tokens,
        mean_weight=total / n_kept if n_kept else 0.0,
        max_weight=max_weight if n_kept else 0.0,
        ess_fraction=(total * total) / (tokens * squares) if squares > 0.0 else 0.0,
    )


def _sequence_ids(logp: Tensor, sequence_ids: Tensor | None) -> Tensor:
    if sequence_ids is not None:
        return sequence_ids.to(torch.int64)
    width = logp.shape[-1] if logp.dim() else 1
    rows = logp.numel() // max(1, width)
    return torch.arange(rows, device=logp.device).repeat_interleave(width).reshape(logp.shape)


def _check(
    logp: Tensor,
    behaviour_logp: Tensor,
    valid: Tensor,
    clip: float | None,
    token_bounds: tuple[float, float] | None,
    sequence_bounds: tuple[float, float] | None,
    veto: float | None,
) -> None:
    if logp.shape != behaviour_logp.shape or logp.shape != valid.shape:
        raise ValueError(
            f"logp, behaviour_logp and valid must have one shape, got {tuple(logp.shape)}, "
            f"{tuple(behaviour_logp.shape)} and {tuple(valid.shape)}"
        )
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor, got {valid.dtype}; use valid.bool() or valid > 0")
    if clip is not None and not (math.isfinite(clip) and clip > 0.0):
        raise ValueError(f"clip must be a finite number > 0 or None, got {clip}; 2.0 is the common choice")
    if clip is None and token_bounds is None:
        raise ValueError("with clip=None the weights are unbounded; pass a clip (e.g. 2.0) or token_bounds")
    for name, bounds in (("token_bounds", token_bounds), ("sequence_bounds", sequence_bounds)):
        if bounds is not None and not (0.0 < bounds[0] <= 1.0 <= bounds[1] and math.isfinite(bounds[1])):
            raise ValueError(f"{name} must be (low, high) with 0 < low <= 1 <= high < inf, got {bounds}; e.g. (0.5, 2.0)")
    if veto is not None and not 0.0 < veto < 1.0:
        raise ValueError(f"veto must be a probability in (0, 1) or None, got {veto}; 1e-4 is a common choice")
