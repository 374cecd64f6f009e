"""Chunked token log-probs: log softmax(head(hidden) / T)[target] without the full logits.

head(h) is the model's output head: h @ weight.T (+ bias), times a scale, then soft-capped,
cap * tanh(logits / cap), where the model does so (Granite divides its logits, Cohere and
Falcon-H1 multiply them, Gemma 2/3 cap them): the log-probs must be those of the logits the
engine sampled from, or every ratio of an own sample is off.

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

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["token_logprobs"]


@dataclass(frozen=True)
class _Head:
    """How the output head's logits become the sampled distribution's: times scale, capped, over temperature."""

    temperature: float
    scale: float
    softcap: float | None


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, head: _Head) -> Tensor:
    """Float32 (or wider) tempered logits of one chunk; the matmul (and bias) run in the inputs' dtype."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    if logits.dtype != torch.promote_types(logits.dtype, torch.float32):
        logits = logits.float()
    if head.scale != 1.0:
        logits.mul_(head.scale)
    if head.softcap is not None:
        logits.div_(head.softcap).tanh_().mul_(head.softcap)
    return logits.div_(head.temperature)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        head: _Head,
        chunk_size: int,
        grad_dtype: torch.dtype | None,
    ) -> Tensor:
        rows = hidden.shape[0]
        out_dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        out = torch.empty(rows, dtype=out_dtype, device=hidden.device)
        log_norm = torch.empty(rows, dtype=out_dtype, device=hidden.device)
        for start in range(0, rows, chunk_size):
            stop = min(start + chunk_size, rows)
            logits = _chunk_logits(hidden[start:stop], weight, bias, head)
            log_norm[start:stop] = torch.logsumexp(logits, dim=-1)
            out[start:stop] = logits.gather(-1, targets[start:stop, None]).squeeze(-1) - log_norm[start:stop]
            del logits  # free this chunk before the next one is allocated
        ctx.save_for_backward(hidden, weight, bias, targets, log_norm)
        ctx.head = head
        ctx.chunk_size = chunk_size
        ctx.grad_dtype = grad_dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None, None, None]:
        hidden, weight, bias, targets, log_norm = ctx.saved_tensors
        head: _Head = ctx.head
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulate the weight and bias gradients in float32 or wider: they sum over every row.
        grad_weight = torch.zeros(weight.shape, dtype=log_norm.dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=log_norm.dtype, device=bias.device) if need_bias else None
        mm_dtype = ctx.grad_dtype or weight.dtype
        mm_weight = weight.to(mm_dtype)
        mm_bias = None if bias is None else bias.to(mm_dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            stop = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:stop].to(mm_dtype)
            # d/dlogits of (logit[target] - logsumexp) is onehot - softmax; chain rule through / T, the
            # cap (d cap tanh(x / cap) / dx = 1 - tanh^2) and the scale. Every step but the cap's slope
            # is in place on the one chunk-sized buffer.
            d_logits = _chunk_logits(h, mm_weight, mm_bias, head)
            slope = None
            if head.softcap is not None:
                slope = (d_logits * (head.temperature / head.softcap)).square_().neg_().add_(1.0)
            g = grad_out[start:stop].to(d_logits.dtype)
            d_logits.sub_(log_norm[start:stop, None].to(d_logits.dtype)).exp_().mul_(-g[:, None])
            d_logits.scatter_add_(-1, targets[start:stop, None], g[:, None])
            d_logits.mul_(head.scale / head.temperature)
            if slope is not None:
                d_logits.mul_(slope)
                del slope
            if grad_bias is not None:
                grad_bias += d_logits.sum(0)
            d_mm = d_logits.to(mm_dtype)
            del d_logits  # a narrower copy was made: drop the wide one before the matmuls
            if grad_hidden is not None:
                grad_hidden[start:stop] = (d_mm @ mm_weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += d_mm.T @ h
            del d_mm
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int = 1024,
    grad_dtype: torch.dtype | None = None,
) -> Tensor:
    """Log-prob of each target under softmax(cap(scale * (hidden @ weight.T + bias)) / temperature), in row chunks.

    hidden [..., H], weight [V, H] and bias [V] (the lm_head), targets [...] int64 -> float32 [...]
    (float64 if an input is float64). scale and softcap (cap(x) = softcap * tanh(x / softcap); None:
    no cap) are the model's own logit transform, applied before the temperature as its forward
    does. Differentiable w.r.t. hidden, weight and bias; backward recomputes each
    chunk's logits. Mixed dtypes (bf16 hidden, fp32 weight) are promoted to the common dtype for
    the matmul, autocast is switched off inside so that rule always holds, and gradients come
    back in each input's own dtype. grad_dtype (e.g. torch.bfloat16) runs the backward's matmuls
    in that dtype instead; the forward values never change. Not twice differentiable.
    """
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}; use 1.0 for the raw model")
    if not (math.isfinite(scale) and scale > 0.0) or (softcap is not None and not (math.isfinite(softcap) and softcap > 0.0)):
        raise ValueError(f"scale and softcap must be finite and > 0 (softcap None: no cap), got {scale} and {softcap}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1]; got weight {tuple(weight.shape)} "
            f"and hidden {tuple(hidden.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
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
    cast_bias = bias if bias is None or bias.dtype == common else bias.to(common)
    head = _Head(float(temperature), float(scale), None if softcap is None else float(softcap))
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        out = _ChunkedTokenLogprobs.apply(
            flat_hidden, cast_weight, cast_bias, targets.reshape(-1).to(torch.int64), head, int(chunk_size), grad_dtype
        )
    return out.reshape(lead)
