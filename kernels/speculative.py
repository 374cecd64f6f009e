"""Speculative verification: the lossless acceptance rule for drafts under keyed sampling.

With randomness keyed by (seed, sample, position) (see `sampling.py`), the token a sample draws
at a position depends only on the target's logits there. So a draft is verified by sampling the
target at every drafted position, exactly as plain decoding would, and accepting drafts while
they equal the sampled tokens; the first sampled token that differs (or the one after the last
draft) is the bonus. Every emitted token and its log-prob is then the one plain decoding would
have produced from the same logits: no rejection sampling, no residual distribution, and the
output distribution is the target's by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hivespec.kernels.sampling import sample_tokens

__all__ = ["Verification", "verify_drafts"]


@dataclass(frozen=True)
class Verification:
    """Per row: `accepted` drafts taken, then one bonus; emitted tokens are tokens[i, : accepted[i] + 1]."""

    accepted: Tensor  # int64 [B], 0 <= accepted[i] <= draft_lengths[i]
    tokens: Tensor  # int64 [B, K + 1]: the target's keyed sample at each verified position
    logprobs: Tensor  # float32 [B, K + 1]: behaviour log-prob of each sampled token


def verify_drafts(
    logits: Tensor,
    drafts: Tensor,
    draft_lengths: Tensor,
    *,
    seed: int | Tensor,
    sample_ids: Tensor,
    positions: Tensor,
    temperature: float,
    top_p: float,
) -> Verification:
    """Sample the target at each of the K + 1 verified positions and accept the agreeing draft prefix.

    logits [B, K + 1, V]: row i's logits after its last emitted token (index 0) and after each
    draft token (index j for draft j - 1). drafts [B, K] int64, of which the first
    draft_lengths[i] are real (the rest is padding and never accepted). positions [B]: the
    sampling position of index 0 (the number of tokens the row has emitted so far); index j is
    drawn at positions[i] + j. `seed` is an int or an int64 tensor [B]. Rows with K = 0 (no
    drafts at all) reduce to one plain sampling step.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, K + 1, V], got shape {tuple(logits.shape)}")
    rows, width, vocab = logits.shape
    if drafts.shape != (rows, width - 1):
        raise ValueError(
            f"drafts must be [B, K] = [{rows}, {width - 1}] to match logits {tuple(logits.shape)}, "
            f"got {tuple(drafts.shape)}"
        )
    if draft_lengths.shape != (rows,) or positions.shape != (rows,) or sample_ids.shape != (rows,):
        raise ValueError(
            f"draft_lengths, positions and sample_ids must be [B] = [{rows}], got "
            f"{tuple(draft_lengths.shape)}, {tuple(positions.shape)} and {tuple(sample_ids.shape)}"
        )
    offsets = torch.arange(width, dtype=torch.int64, device=logits.device)
    flat_seed = seed.repeat_interleave(width) if isinstance(seed, Tensor) else seed
    tokens, logprobs = sample_tokens(
        logits.reshape(rows * width, vocab),
        seed=flat_seed,
        sample_ids=sample_ids.repeat_interleave(width),
        positions=(positions[:, None] + offsets[None, :]).reshape(-1),
        temperature=temperature,
        top_p=top_p,
    )
    tokens, logprobs = tokens.view(rows, width), logprobs.view(rows, width)
    real = offsets[None, : width - 1] < draft_lengths[:, None]
    agree = (tokens[:, : width - 1] == drafts) & real
    # Accepted = length of the all-true prefix of `agree`.
    accepted = torch.cumprod(agree.to(torch.int64), dim=-1).sum(-1)
    return Verification(accepted=accepted, tokens=tokens, logprobs=logprobs)
