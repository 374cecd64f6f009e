"""Keyed sampling: Gumbel-max with randomness keyed by (seed, sample, position).

The noise for one row depends only on its own (seed, sample_id, position), never on the
other rows of the batch, its order or the device. That is what makes plain and speculative
decoding pick the same tokens, and lets a peer re-derive the noise of any rollout.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["keyed_uniform", "sample_tokens"]

_MASK64 = (1 << 64) - 1


def _signed64(value: int) -> int:
    """The int64 that has the same bits as `value` modulo 2**64."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64 constants (Steele, Lea and Flood 2014; Stafford's "mix13" finaliser).
_GAMMA = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)
# Bits kept for a uniform: with 52, (k + 0.5) / 2**52 is exact in float64 and never 0 or 1.
_UNIFORM_BITS = 52


def _shr_(z: Tensor, shift: int) -> Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic, so clear the sign fill)."""
    return (z >> shift).bitwise_and_((1 << (64 - shift)) - 1)


def _mix64_(z: Tensor) -> Tensor:
    """splitmix64 finaliser, in place; int64 multiplication wraps modulo 2**64 on every backend."""
    z ^= _shr_(z, 30)
    z *= _MIX1
    z ^= _shr_(z, 27)
    z *= _MIX2
    z ^= _shr_(z, 31)
    return z


def _row_keys(seed: int | Tensor, sample_ids: Tensor, positions: Tensor) -> Tensor:
    """One well-mixed 64-bit key per row from (seed, sample_id, position)."""
    device = sample_ids.device
    if isinstance(seed, Tensor):
        key = seed.to(device=device, dtype=torch.int64).expand(sample_ids.shape).clone()
    else:
        key = torch.full(sample_ids.shape, _signed64(seed), dtype=torch.int64, device=device)
    # Chaining add-then-mix keeps each field in its own stage, so (s, p) and (p, s) differ.
    key = _mix64_(key + _GAMMA)
    key = _mix64_(key + (sample_ids.to(torch.int64) + 1) * _GAMMA)
    return _mix64_(key + (positions.to(torch.int64) + 1) * _GAMMA)


def keyed_uniform(seed: int | Tensor, sample_ids: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Uniforms in the open interval (0, 1), one per (row, vocab index), keyed by a counter hash.

    Row i is a pure function of (seed[i], sample_ids[i], positions[i]) and the vocab index: the
    same on any device and in any batch. `seed` is an int shared by all rows or an int64 tensor
    of shape [B] (one seed per row). Returns float64 [B, V] with 52 random bits per entry.
    """
    if sample_ids.dim() != 1 or positions.shape != sample_ids.shape:
        raise ValueError(
            f"sample_ids and positions must be 1-D of equal length, got shapes "
            f"{tuple(sample_ids.shape)} and {tuple(positions.shape)}; flatten them to [B]"
        )
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    keys = _row_keys(seed, sample_ids, positions)
    offsets = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device) * _GAMMA
    z = _mix64_(keys[:, None] + offsets[None, :])
    z = _shr_(z, 64 - _UNIFORM_BITS)
    return z.to(torch.float64).add_(0.5).mul_(2.0**-_UNIFORM_BITS)


def _nucleus_mask(scaled: Tensor, top_p: float) -> Tensor:
    """True outside the top-p nucleus: the smallest top set whose probability reaches top_p."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Mass strictly before each token: a token is kept while that mass is still below top_p,
    # so the most likely token is always kept.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    outside_sorted = mass_before >= top_p
    return torch.zeros_like(outside_sorted).scatter_(-1, order, outside_sorted)


def sample_tokens(
    logits: Tensor,
    *,
    seed: int | Tensor,
    sample_ids: Tensor,
    positions: Tensor,
    temperature: float,
    top_p: float,
) -> tuple[Tensor, Tensor]:
    """Draw one token per row by keyed Gumbel-max over logits / temperature within the top-p nucleus.

    Returns (tokens int64 [B], behaviour log-probs float32 [B]): the log-prob of each token under
    exactly the distribution it was drawn from (tempered, nucleus-masked, renormalised). Math
    runs in float32, or float64 when the logits are float64. temperature == 0 is greedy argmax
    (first index on ties) and its behaviour log-prob is reported as 0.0 (a point mass).
    """
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}; use 1.0 to disable nucleus sampling")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}; select the last position first")
    if temperature == 0.0:
        tokens = torch.argmax(logits, dim=-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)

    work_dtype = torch.promote_types(logits.dtype, torch.float32)
    scaled = logits.to(work_dtype) / temperature
    if top_p < 1.0:
        scaled = scaled.masked_fill(_nucleus_mask(scaled, top_p), float("-inf"))
    uniform = keyed_uniform(seed, sample_ids, positions, logits.shape[-1])
    gumbel = uniform.log_().neg_().log_().neg_()
    tokens = torch.argmax(scaled + gumbel, dim=-1)
    chosen = scaled.gather(-1, tokens[:, None]).squeeze(-1)
    behaviour = chosen - torch.logsumexp(scaled, dim=-1)
    return tokens, behaviour.to(torch.float32)
