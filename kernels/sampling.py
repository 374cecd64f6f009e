"""Keyed sampling: Gumbel-max with randomness keyed by (seed, sample, position).

The noise for one row depends only on its own (seed, sample_id, position), never on the
other rows of the batch, its order or the device. That is what makes plain and speculative
decoding pick the same tokens, and lets a peer re-derive the noise of any rollout.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["keyed_uniform", "nucleus_mask", "sample_tokens"]


def _wrap(value: int, bits: int) -> int:
    """The signed `bits`-bit integer with the same low bits as `value` (two's complement)."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


# splitmix64 (Steele, Lea and Flood 2014) mixes the per-row key: B elements, so 64-bit is cheap.
_GAMMA64 = _wrap(0x9E3779B97F4A7C15, 64)
_MIX64_A = _wrap(0xBF58476D1CE4E5B9, 64)
_MIX64_B = _wrap(0x94D049BB133111EB, 64)
# The [B, V] part hashes in 32 bits ("lowbias32", C. Wellons): CPUs vectorise 32-bit multiplies
# but not 64-bit ones, which makes this ~10x faster than splitmix64 per element.
_GAMMA32 = _wrap(0x9E3779B9, 32)
_MIX32_A = _wrap(0x21F0AAAD, 32)
_MIX32_B = _wrap(0x735A2D97, 32)
# Multiplication wraps modulo 2**bits on every torch backend; torch's >> is arithmetic, so the
# sign fill is cleared by hand to get a logical shift.


def _mix64(z: Tensor) -> Tensor:
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _MIX64_A
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _MIX64_B
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _mix32_(x: Tensor) -> Tensor:
    x ^= (x >> 16).bitwise_and_(0xFFFF)
    x *= _MIX32_A
    x ^= (x >> 15).bitwise_and_(0x1FFFF)
    x *= _MIX32_B
    x ^= (x >> 15).bitwise_and_(0x1FFFF)
    return x


def _row_keys(seed: int | Tensor, sample_ids: Tensor, positions: Tensor) -> Tensor:
    """One int32 key per row, from a splitmix64 chain over (seed, sample_id, position)."""
    device = sample_ids.device
    if isinstance(seed, Tensor):
        key = seed.to(device=device, dtype=torch.int64).expand(sample_ids.shape)
    else:
        key = torch.full(sample_ids.shape, _wrap(seed, 64), dtype=torch.int64, device=device)
    # Add-then-mix per field keeps the fields in separate stages, so (s, p) and (p, s) differ.
    key = _mix64(key + _GAMMA64)
    key = _mix64(key + (sample_ids.to(torch.int64) + 1) * _GAMMA64)
    key = _mix64(key + (positions.to(torch.int64) + 1) * _GAMMA64)
    # Fold to 32 bits explicitly rather than rely on how a backend narrows out-of-range int64.
    low = (key ^ ((key >> 32) & 0xFFFFFFFF)) & 0xFFFFFFFF
    return (low - ((low >> 31) << 32)).to(torch.int32)


def keyed_uniform(seed: int | Tensor, sample_ids: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Uniforms in the open interval (0, 1), one per (row, vocab index), from a counter hash.

    Row i is a pure function of (seed, sample_ids[i], positions[i]) and the vocab index: the same
    on any device and in any batch. `seed` is an int shared by all rows or an int64 tensor [B].
    Returns float64 [B, V]; each entry carries 32 random bits, (k + 0.5) / 2**32, so never 0 or 1.
    """
    if sample_ids.dim() != 1 or positions.shape != sample_ids.shape:
        raise ValueError(
            f"sample_ids and positions must be 1-D of equal length, got shapes "
            f"{tuple(sample_ids.shape)} and {tuple(positions.shape)}; flatten them to [B]"
        )
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    keys = _row_keys(seed, sample_ids, positions)
    vocab = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device)
    offsets = ((vocab * _GAMMA32) & 0xFFFFFFFF).to(torch.int32)  # wraps mod 2**32 by construction
    bits = _mix32_(keys[:, None] + offsets[None, :])
    # int32 read as signed; shifting by 2**31 maps it onto [0, 2**32) with the same uniformity.
    return bits.to(torch.float64).add_(2.0**31 + 0.5).mul_(2.0**-32)


def nucleus_mask(probs: Tensor, top_p: float) -> Tensor:
    """True for tokens outside the top-p nucleus of each row of `probs` [B, V].

    A token is kept when the mass of tokens strictly more probable than it is below top_p, so
    the most probable token is always kept and tied tokens are kept or dropped together (the
    set does not depend on sort order). Looks at the top 64 candidates first and sorts the full
    row only when its nucleus is larger.
    """
    vocab = probs.shape[-1]
    keep_cut = torch.empty(probs.shape[0], dtype=probs.dtype, device=probs.device)
    rows = torch.arange(probs.shape[0], device=probs.device)
    for k in sorted({min(64, vocab), vocab}):
        if k < vocab:
            top = torch.topk(probs[rows], k, dim=-1, sorted=True).values
        else:
            top = torch.sort(probs[rows], dim=-1, descending=True).values
        mass_before = torch.cumsum(top, dim=-1) - top
        # Ties share the mass before their first member: "strictly more probable" mass.
        first = torch.searchsorted(-top, -top, side="left")
        kept = mass_before.gather(-1, first) < top_p
        last_kept = kept.sum(-1) - 1
        keep_cut[rows] = top.gather(-1, last_kept[:, None]).squeeze(-1)
        # Everything above the k-th value is inside the top-k, so a row whose k-th candidate is
        # dropped has its exact cut; the rest need a wider look.
        unresolved = kept[:, -1] & (k < vocab)
        rows = rows[unresolved]
        if rows.numel() == 0:
            break
    return probs < keep_cut[:, None]


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

    Gumbel-max is evaluated in its exponential-race form, argmax(p / E) with E = -log(u) (the
    form vLLM uses). Returns (tokens int64 [B], behaviour log-probs float32 [B]): each token's
    log-prob under exactly the distribution it was drawn from (tempered, nucleus-masked,
    renormalised). Math runs in float32, or float64 for float64 logits. temperature == 0 is
    greedy argmax (first index on ties); its behaviour log-prob is reported as 0.0 (a point mass).
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

    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_norm = torch.logsumexp(scaled, dim=-1, keepdim=True)
    probs = torch.exp(scaled - log_norm)
    if top_p < 1.0:
        probs = probs.masked_fill_(nucleus_mask(probs, top_p), 0.0)
        log_norm = log_norm + torch.log(probs.sum(-1, keepdim=True))
    exponential = keyed_uniform(seed, sample_ids, positions, logits.shape[-1]).log_().neg_()
    tokens = torch.argmax(probs.to(torch.float64).div_(exponential), dim=-1)
    behaviour = scaled.gather(-1, tokens[:, None]) - log_norm
    return tokens, behaviour.squeeze(-1).to(torch.float32)
