"""The rollout engine: batched generation on token ids with keyed sampling.

`RolloutEngine` is the interface the runtime uses; `TorchEngine` is the native implementation
(transformers model, KV cache, no extra dependencies). Position t of a sample is drawn with
randomness keyed by (seed, sample_index, t), so a completion does not depend on which other
requests share its batch, and a speculative step can later reproduce it token for token.

The decode loop is split so a speculative step can slot in: a step produces, per active row,
one or more (token, behaviour log-prob) pairs; `_DecodeState.extend` does all bookkeeping
(stop tokens, length limits, dropping finished rows) whatever the step was. Plain decoding is
`_plain_step`: sample one token from the last logits, then run one forward for the next ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch
from torch import Tensor
from transformers import DynamicCache

from hivespec.kernels.sampling import sample_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["GenerationRequest", "RolloutEngine", "Sample", "SamplingParams", "TorchEngine"]

FinishReason = Literal["stop", "length"]
TokenCallback = Callable[[int], None]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: vLLM's names. temperature 0 is greedy; stop tokens end a completion and are kept in it."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable nucleus sampling")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(token < 0 for token in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")


@dataclass(frozen=True)
class GenerationRequest:
    """One completion to draw: the prompt's token ids and the key (seed, sample_index) of its randomness."""

    prompt_ids: tuple[int, ...]
    seed: int
    sample_index: int

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids is empty; a completion needs at least one prompt token (e.g. BOS)")
        if self.sample_index < 0:
            raise ValueError(f"sample_index must be >= 0, got {self.sample_index}")


@dataclass
class Sample:
    """A finished completion; logprobs[i] is the behaviour log-prob of completion_ids[i].

    On finish_reason "stop" the stop token is the last completion id, with its log-prob, so a
    trainer learns to stop. Under greedy decoding the log-probs are 0.0.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


class RolloutEngine(Protocol):
    """What the runtime needs from an engine: generate completions and expose weights for sync."""

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Sample]:
        """Completions for the requests, in request order."""
        ...

    def sync_parameters(self) -> dict[str, Tensor]:
        """The named tensors a weight sync writes into, in place."""
        ...


def _signed64(value: int) -> int:
    """Seed as the int64 with the same low 64 bits, as the sampling kernel reads an int seed."""
    return ((value + (1 << 63)) % (1 << 64)) - (1 << 63)


@dataclass
class _Row:
    request: GenerationRequest
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None


@dataclass
class _DecodeState:
    """The active rows of one batch and the per-row tensors that line up with the KV cache."""

    rows: list[_Row]
    cache: DynamicCache
    attention_mask: Tensor  # [b, cached + 1]: 0 on left padding
    next_positions: Tensor  # [b] position id of the token fed next
    seeds: Tensor  # [b] int64
    sample_ids: Tensor  # [b] int64
    logits: Tensor  # [b, V] next-token logits of each active row

    def completion_positions(self) -> Tensor:
        return torch.tensor([len(row.completion) for row in self.rows], dtype=torch.int64, device=self.seeds.device)

    def extend(self, tokens: list[list[int]], logprobs: list[list[float]], params: SamplingParams) -> int:
        """Append each row's new tokens up to a stop token or the length limit; returns tokens kept."""
        stop = set(params.stop_token_ids)
        kept = 0
        for row, row_tokens, row_logprobs in zip(self.rows, tokens, logprobs, strict=True):
            for token, logprob in zip(row_tokens, row_logprobs, strict=True):
                row.completion.append(token)
                row.logprobs.append(logprob)
                kept += 1
                if token in stop:
                    row.finish_reason = "stop"
                elif len(row.completion) >= params.max_new_tokens:
                    row.finish_reason = "length"
                if row.finish_reason is not None:
                    break
        return kept

    def drop_finished(self) -> None:
        """Remove finished rows from the batch (cache included) so they cost no more compute."""
        keep = [i for i, row in enumerate(self.rows) if row.finish_reason is None]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            return
        index = torch.tensor(keep, dtype=torch.int64, device=self.seeds.device)
        self.cache.batch_select_indices(index)
        self.attention_mask = self.attention_mask[index]
        self.next_positions = self.next_positions[index]
        self.seeds = self.seeds[index]
        self.sample_ids = self.sample_ids[index]
        self.logits = self.logits[index]


class TorchEngine:
    """Batched generation with a transformers causal LM and a DynamicCache, on token ids only.

    The model must already be on its device and dtype, in eval mode; the engine never moves or
    copies it. Requests are grouped by prompt length into batches of at most max_batch_size,
    left-padded, and results come back in request order. Results do not depend on the grouping
    beyond the rounding of the model's own forward pass.
    """

    def __init__(self, model: PreTrainedModel, *, max_batch_size: int = 16) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._model = model
        self._max_batch_size = max_batch_size
        self._device = next(model.parameters()).device
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._max_positions: int | None = getattr(model.config, "max_position_embeddings", None)

    def sync_parameters(self) -> dict[str, Tensor]:
        """Named parameters (detached, sharing storage), each storage once under its first name.

        Tied weights (SmolLM2's lm_head and embed_tokens) appear once, so a sync writes them once.
        """
        tensors: dict[str, Tensor] = {}
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, param in self._model.named_parameters(remove_duplicate=False):
            key = (param.data_ptr(), tuple(param.shape))
            if key not in seen:
                seen.add(key)
                tensors[name] = param.detach()
        return tensors

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        *,
        on_tokens: TokenCallback | None = None,
    ) -> list[Sample]:
        """Completions for the requests, in request order.

        on_tokens, if given, is called after every decode step with the number of tokens the
        step added across the batch (for progress and throughput counters).
        """
        if self._model.training:
            raise ValueError("the model is in training mode (dropout would break keyed sampling); call model.eval()")
        for request in requests:
            self._check_request(request, params)
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        samples: list[Sample | None] = [None] * len(requests)
        for start in range(0, len(order), self._max_batch_size):
            chunk = order[start : start + self._max_batch_size]
            rows = self._run_batch([requests[i] for i in chunk], params, on_tokens)
            for i, row in zip(chunk, rows, strict=True):
                assert row.finish_reason is not None
                samples[i] = Sample(list(row.request.prompt_ids), row.completion, row.logprobs, row.finish_reason)
        return [sample for sample in samples if sample is not None]

    def _check_request(self, request: GenerationRequest, params: SamplingParams) -> None:
        bad = [token for token in request.prompt_ids if not 0 <= token < self._vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the model's vocabulary [0, {self._vocab_size})")
        total = len(request.prompt_ids) + params.max_new_tokens
        if self._max_positions is not None and total > self._max_positions:
            raise ValueError(
                f"prompt of {len(request.prompt_ids)} tokens + max_new_tokens {params.max_new_tokens} exceeds "
                f"the model's {self._max_positions} positions; shorten the prompt or lower max_new_tokens"
            )

    def _run_batch(
        self, requests: list[GenerationRequest], params: SamplingParams, on_tokens: TokenCallback | None
    ) -> list[_Row]:
        state = self._prefill(requests)
        rows = list(state.rows)
        while state.rows:
            tokens, logprobs = self._plain_step(state, params)
            added = state.extend(tokens, logprobs, params)
            if on_tokens is not None:
                on_tokens(added)
            state.drop_finished()
            if state.rows:
                self._forward_next(state)
        return rows

    def _prefill(self, requests: list[GenerationRequest]) -> _DecodeState:
        """Run the left-padded prompts through the model, filling a fresh cache."""
        width = max(len(request.prompt_ids) for request in requests)
        input_ids = torch.zeros(len(requests), width, dtype=torch.int64)
        attention_mask = torch.zeros(len(requests), width, dtype=torch.int64)
        for i, request in enumerate(requests):
            input_ids[i, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            attention_mask[i, width - len(request.prompt_ids) :] = 1
        input_ids, attention_mask = input_ids.to(self._device), attention_mask.to(self._device)
        # Positions count real tokens only, so a prompt sees the same positions at any padding.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
        cache = DynamicCache(config=self._model.config)
        logits = self._forward(input_ids, attention_mask, position_ids, cache)
        return _DecodeState(
            rows=[_Row(request) for request in requests],
            cache=cache,
            attention_mask=attention_mask,
            next_positions=position_ids[:, -1] + 1,
            seeds=torch.tensor([_signed64(r.seed) for r in requests], dtype=torch.int64, device=self._device),
            sample_ids=torch.tensor([r.sample_index for r in requests], dtype=torch.int64, device=self._device),
            logits=logits,
        )

    def _plain_step(self, state: _DecodeState, params: SamplingParams) -> tuple[list[list[int]], list[list[float]]]:
        """One token per row, sampled from the current logits."""
        tokens, logprobs = sample_tokens(
            state.logits,
            seed=state.seeds,
            sample_ids=state.sample_ids,
            positions=state.completion_positions(),
            temperature=params.temperature,
            top_p=params.top_p,
        )
        return [[t] for t in tokens.tolist()], [[lp] for lp in logprobs.tolist()]

    def _forward_next(self, state: _DecodeState) -> None:
        """Feed each active row's last token, extending the cache and refreshing the logits."""
        input_ids = torch.tensor([[row.completion[-1]] for row in state.rows], dtype=torch.int64, device=self._device)
        state.attention_mask = torch.cat([state.attention_mask, torch.ones_like(state.attention_mask[:, :1])], dim=-1)
        state.logits = self._forward(input_ids, state.attention_mask, state.next_positions[:, None], state.cache)
        state.next_positions = state.next_positions + 1

    def _forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache: DynamicCache) -> Tensor:
        output = self._model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return output.logits[:, -1, :]
