"""Chunked token log-probs: log softmax(hidden @ weight.T / T)[target] without the full logits.

For a 49k vocabulary the [tokens x vocab] logits of a training batch are the largest tensor in
the step; computing them a chunk of rows at a time, and again in backward, keeps peak memory at
O(chunk_size x vocab) while hidden, weight, targets and one logsumexp per row are all that is saved.
bench/logprob_memory.py measures it against the naive path.

Precision: the forward runs in float32 (or wider) because its values are what importance ratios
and the loss read; bf16 logits would put ~1e-2 nats of noise on every ratio. The backward only
makes a gradient, so ``grad_dtype=torch.bfloat16`` runs its three matmuls in bf16 (softmax and the
weight-gradient sum stay float32): about 3x faster on CPUs with AVX512-BF16 for the head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["token_logprobs"]


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """Float32 (or wider) tempered logits of one chunk; the matmul runs in the inputs' dtype."""
    logits = hidden @ weight.T
    if logits.dtype != torch.promote_types(logits.dtype, torch.float32):
        logits = logits.float()
    return logits.div_(temperature)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        grad_dtype: torch.dtype | None,
    ) -> Tensor:
        rows = hidden.shape[0]
        out_dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        out = torch.empty(rows, dtype=out_dtype, device=hidden.device)
        log_norm = torch.empty(rows, dtype=out_dtype, device=hidden.device)
        for start in range(0, rows, chunk_size):
            stop = min(start + chunk_size, rows)
            logits = _chunk_logits(hidden[start:stop], weight, temperature)
            log_norm[start:stop] = torch.logsumexp(logits, dim=-1)
            out[start:stop] = logits.gather(-1, targets[start:stop, None]).squeeze(-1) - log_norm[start:stop]
            del logits  # free this chunk before the next one is allocated
        ctx.save_for_backward(hidden, weight, targets, log_norm)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.grad_dtype = grad_dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        hidden, weight, targets, log_norm = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulate the weight gradient in float32 or wider: it sums over every row.
        grad_weight = torch.zeros(weight.shape, dtype=log_norm.dtype, device=weight.device) if need_weight else None
        mm_dtype = ctx.grad_dtype or weight.dtype
        mm_weight = weight.to(mm_dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            stop = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:stop].to(mm_dtype)
            # d/dlogits of (logit[target] - logsumexp) is onehot - softmax; chain rule through / T.
            # Every step is in place on the one chunk-sized buffer.
            d_logits = _chunk_logits(h, mm_weight, ctx.temperature)
            g = grad_out[start:stop].to(d_logits.dtype)
            d_logits.sub_(log_norm[start:stop, None].to(d_logits.dtype)).exp_().mul_(-g[:, None])
            d_logits.scatter_add_(-1, targets[start:stop, None], g[:, None])
            d_logits.div_(ctx.temperature)
            d_mm = d_logits.to(mm_dtype)
            del d_logits  # a narrower copy was made: drop the wide one before the matmuls
            if grad_hidden is not None:
                grad_hidden[start:stop] = (d_mm @ mm_weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += d_mm.T @ h
            del d_mm
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    grad_dtype: torch.dtype | None = None,
) -> Tensor:
    """Log-prob of each target under softmax(hidden @ weight.T / temperature), in row chunks.

    hidden [..., H], weight [V, H] (the lm_head), targets [...] int64 -> float32 [...] (float64
    if an input is float64). Differentiable w.r.t. hidden and weight; backward recomputes each
    chunk's logits. Mixed dtypes (bf16 hidden, fp32 weight) are promoted to the common dtype for
    the matmul, autocast is switched off inside so that rule always holds, and gradients come
    back in each input's own dtype. grad_dtype (e.g. torch.bfloat16) runs the backward's matmuls
    in that dtype instead; the forward values never change. Not twice differentiable.
    """
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}; use 1.0 for the raw model")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1]; got weight {tuple(weight.shape)} "
            f"and hidden {tuple(hidden.shape)}"
        )
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}"
        )
    lead = targets.shape
    common = torch.promote_types(hidden.dtype, weight.dtype)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    # Casting outside the Function lets autograd route the gradient back to hidden's own dtype.
    if flat_hidden.dtype != common:
        flat_hidden = flat_hidden.to(common)
    cast_weight = weight if weight.dtype == common else weight.to(common)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        out = _ChunkedTokenLogprobs.apply(
            flat_hidden, cast_weight, targets.reshape(-1).to(torch.int64), float(temperature), int(chunk_size), grad_dtype
        )
    return out.reshape(lead)
