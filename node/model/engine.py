"""The rollout engine: batched generation on token ids with keyed sampling.

`RolloutEngine` is the interface the runtime uses; `TorchEngine` is the native implementation
(transformers model, KV cache, no extra dependencies). Position t of a sample is drawn with
randomness keyed by (seed, sample_index, t), so a completion does not depend on which other
requests share its batch, and a speculative step can later reproduce it token for token.

The decode loop is split so a speculative step can slot in: a step produces, per active row,
one or more (token, behaviour log-prob) pairs; `_DecodeState.extend` does all bookkeeping
(stop tokens, length limits, dropping finished rows) whatever the step was. Plain decoding is
`_plain_step`: sample one token from the last logits, then run one forward for the next ones.

Speculative decoding (`_speculative_step`, on when the engine has a drafter) feeds each row's
last token plus up to K draft tokens in one forward, samples the target at every one of those
positions with the same keyed sampler (`kernels.speculative.verify_drafts`), keeps the agreeing
draft prefix plus one bonus token, and rolls the cache back: the cache is cropped to the longest
kept run in the batch and each row's rejected slots are masked out of the 2D attention mask
(positions are explicit, so holes are harmless; transformers' mask reads the 2D mask per key
index). When holes fill more than half the cache it is compacted. The output is the plain
decoding output: same tokens, same log-probs, up to the rounding of different forward shapes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch
from torch import Tensor
from transformers import DynamicCache, DynamicLayer

from hivespec.kernels.host_transfer import synchronize, to_host
from hivespec.kernels.sampling import sample_tokens
from hivespec.kernels.speculative import verify_drafts
from hivespec.node.model.device import work_clock

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hivespec.node.config import RolloutConfig
    from hivespec.node.speculation.drafter import Draft, DraftSession, SuffixDrafter
    from hivespec.node.speculation.policy import RowPlan, SpeculationPolicy

log = logging.getLogger(__name__)

__all__ = [
    "GenerationRequest", "RolloutEngine", "Sample", "SamplingParams", "SpeculationStats", "TorchEngine", "unique_parameters",
]

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
    # Speculation stats (not part of equality: plain and speculative samples compare equal).
    target_forwards: int = field(default=0, compare=False)  # forwards this sample took part in, prefill included
    drafted: int = field(default=0, compare=False)  # draft tokens verified for it
    accepted: int = field(default=0, compare=False)  # of which the target accepted


@dataclass
class SpeculationStats:
    """Counters over one or more `generate` calls; pass one in to accumulate.

    Forwards and tokens count per sequence, so plain decoding has tokens_per_forward 1.0.
    """

    sequences: int = 0
    tokens: int = 0
    target_forwards: int = 0
    batch_forwards: int = 0  # forward calls (a batch counts once), prefills included
    speculative_steps: int = 0  # batch forwards that verified at least one draft token
    proposed: int = 0  # draft tokens the drafter proposed (the policy may verify fewer)
    drafted: int = 0
    accepted: int = 0
    compactions: int = 0  # times the KV cache was compacted to drop rejected slots
    draft_seconds: float = 0.0
    generate_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def draft_us_per_token(self) -> float:
        """Drafting wall time (index builds included) per draft token proposed."""
        return 1e6 * self.draft_seconds / self.proposed if self.proposed else 0.0

    def add(self, other: SpeculationStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class RolloutEngine(Protocol):
    """What the runtime needs from an engine: generate completions and expose weights for sync."""

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Sample]:
        """Completions for the requests, in request order."""
        ...

    def sync_parameters(self) -> dict[str, Tensor]:
        """The named tensors a weight sync writes into, in place."""
        ...

    def weights_updated(self, names: Sequence[str] | None = None) -> None:
        """The sync wrote these tensors of `sync_parameters()` (None: all); an engine holding another copy reloads them."""
        ...


def unique_parameters(model: torch.nn.Module) -> dict[str, Tensor]:
    """Named parameters (detached, sharing storage), each storage once under its first name.

    Tied weights (SmolLM2's lm_head and embed_tokens) appear once, so a sync writes them once.
    """
    tensors: dict[str, Tensor] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        key = (param.data_ptr(), tuple(param.shape))
        if key not in seen:
            seen.add(key)
            tensors[name] = param.detach()
    return tensors


def _signed64(value: int) -> int:
    """Seed as the int64 with the same low 64 bits, as the sampling kernel reads an int seed."""
    return ((value + (1 << 63)) % (1 << 64)) - (1 << 63)


@dataclass
class _Row:
    request: GenerationRequest
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    session: DraftSession | None = None
    plan: RowPlan | None = None


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

    With a drafter and a policy, `generate` decodes speculatively (see the module docstring);
    `speculative=False` forces plain decoding for one call.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch_size: int = 16,
        drafter: SuffixDrafter | None = None,
        policy: SpeculationPolicy | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._model = model
        self._max_batch_size = max_batch_size
        # A verify step crops rejected drafts off the cache and masks holes by key index: only a
        # full-attention layer can do both. A sliding-window layer forgets what a crop would need
        # (transformers raises) and measures its window in key slots, holes included; a linear
        # attention layer folds every token into its state.
        self.can_speculate = all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)
        self.drafter: SuffixDrafter | None = None
        self.policy: SpeculationPolicy | None = None
        self.set_speculation(drafter, policy)
        self._device = next(model.parameters()).device
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._max_positions: int | None = getattr(model.config, "max_position_embeddings", None)


    @classmethod
    def from_config(cls, model: PreTrainedModel, rollout: RolloutConfig) -> TorchEngine:
        """An engine decoding up to `rollout.max_batch_size` sequences together (speculation is set later)."""
        return cls(model, max_batch_size=rollout.max_batch_size)
    def set_speculation(self, drafter: SuffixDrafter | None, policy: SpeculationPolicy | None) -> None:
        """Turn speculative decoding on (a drafter and a policy) or off (None, None) for later calls."""
        if (drafter is None) != (policy is None):
            raise ValueError("speculation needs both a drafter and a policy (or neither for plain decoding)")
        if drafter is not None and not self.can_speculate:
            log.warning("speculative decoding is off: the model has sliding-window or linear attention layers, whose "
                        "cache cannot drop rejected drafts; decoding plainly")
        self.drafter, self.policy = drafter, policy

    def sync_parameters(self) -> dict[str, Tensor]:
        """The model's `unique_parameters`: a sync writes straight into the weights this engine samples with."""
        return unique_parameters(self._model)

    def weights_updated(self, names: Sequence[str] | None = None) -> None:
        """Nothing to do: `sync_parameters()` shares storage with the model."""

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        *,
        on_tokens: TokenCallback | None = None,
        speculative: bool | None = None,
        stats: SpeculationStats | None = None,
    ) -> list[Sample]:
        """Completions for the requests, in request order.

        on_tokens, if given, is called after every decode step with the number of tokens the
        step added across the batch (for progress and throughput counters; it may raise to
        abandon the call, e.g. on a stop request). speculative defaults to "when the engine has
        a drafter and its policy is active" (a policy still waiting for its verify-cost curve
        is not) and never on a model that cannot roll its cache back (`can_speculate`); stats,
        if given, accumulates counters.
        """
        if speculative is None:
            speculative = self.drafter is not None and self.policy is not None and self.policy.active and self.can_speculate
        if speculative and self.drafter is None:
            raise ValueError("speculative=True needs an engine built with a drafter and a policy")
        if speculative and not self.can_speculate:
            raise ValueError("speculative=True on a model with sliding-window or linear attention layers, whose cache "
                             "cannot drop rejected drafts; decode it plainly (speculative=False)")
        if self._model.training:
            raise ValueError("the model is in training mode (dropout would break keyed sampling); call model.eval()")
        for request in requests:
            self._check_request(request, params)
        started = time.perf_counter()
        run = SpeculationStats()
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        samples: list[Sample | None] = [None] * len(requests)
        for start in range(0, len(order), self._max_batch_size):
            chunk = order[start : start + self._max_batch_size]
            batch = [requests[i] for i in chunk]
            if speculative:
                rows = self._run_batch_speculative(batch, params, on_tokens, run)
            else:
                rows = self._run_batch(batch, params, on_tokens, run)
            for i, row in zip(chunk, rows, strict=True):
                assert row.finish_reason is not None
                samples[i] = Sample(
                    list(row.request.prompt_ids), row.completion, row.logprobs, row.finish_reason,
                    target_forwards=row.forwards, drafted=row.drafted, accepted=row.accepted,
                )
                run.sequences += 1
                run.tokens += len(row.completion)
                run.target_forwards += row.forwards
                run.drafted += row.drafted
                run.accepted += row.accepted
        run.generate_seconds = time.perf_counter() - started
        if stats is not None:
            stats.add(run)
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
        self,
        requests: list[GenerationRequest],
        params: SamplingParams,
        on_tokens: TokenCallback | None,
        stats: SpeculationStats,
    ) -> list[_Row]:
        state = self._prefill(requests, stats)
        rows = list(state.rows)
        while state.rows:
            tokens, logprobs = self._plain_step(state, params)
            added = state.extend(tokens, logprobs, params)
            if on_tokens is not None:
                on_tokens(added)
            state.drop_finished()
            if state.rows:
                self._forward_next(state, stats)
        return rows

    def _run_batch_speculative(
        self,
        requests: list[GenerationRequest],
        params: SamplingParams,
        on_tokens: TokenCallback | None,
        stats: SpeculationStats,
    ) -> list[_Row]:
        """Like `_run_batch`, with every forward after the prefill a verification of drafts."""
        assert self.drafter is not None and self.policy is not None
        state = self._prefill(requests, stats)
        mark = time.perf_counter()
        for row in state.rows:
            row.session = self.drafter.session(row.request.prompt_ids)
            row.plan = self.policy.plan(row.request.prompt_ids)
        stats.draft_seconds += time.perf_counter() - mark
        rows = list(state.rows)
        # The first token comes from the prefill's logits; every later step verifies drafts.
        tokens, logprobs = self._plain_step(state, params)
        while True:
            added = state.extend(tokens, logprobs, params)
            if on_tokens is not None:
                on_tokens(added)
            state.drop_finished()
            if not state.rows:
                return rows
            tokens, logprobs = self._speculative_step(state, params, stats)

    def _speculative_step(
        self, state: _DecodeState, params: SamplingParams, stats: SpeculationStats
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Draft, verify in one forward, roll the cache back; returns each row's emitted tokens."""
        assert self.policy is not None
        mark = time.perf_counter()
        drafts: list[Draft] = []
        width = 0
        if self.policy.wants_drafts(len(state.rows)):
            for row in state.rows:
                assert row.session is not None and row.plan is not None
                # Never draft past the length limit: those tokens could not be kept.
                room = params.max_new_tokens - len(row.completion) - 1
                drafts.append(row.session.propose(row.completion, min(row.plan.cap, room)))
            width = self.policy.width(drafts, [row.plan for row in state.rows])  # type: ignore[misc]
            stats.proposed += sum(len(d.tokens) for d in drafts)
        stats.draft_seconds += time.perf_counter() - mark

        batch = len(state.rows)
        lengths = [min(width, len(d.tokens)) for d in drafts] if width else [0] * batch
        input_ids = torch.zeros(batch, width + 1, dtype=torch.int64)
        new_mask = torch.zeros(batch, width + 1, dtype=state.attention_mask.dtype)
        for i, row in enumerate(state.rows):
            input_ids[i, 0] = row.completion[-1]
            if lengths[i]:
                input_ids[i, 1 : 1 + lengths[i]] = torch.tensor(drafts[i].tokens[: lengths[i]])
            new_mask[i, : 1 + lengths[i]] = 1
        input_ids, new_mask = input_ids.to(self._device), new_mask.to(self._device)
        offsets = torch.arange(width + 1, dtype=torch.int64, device=self._device)
        draft_lengths = torch.tensor(lengths, dtype=torch.int64, device=self._device)
        attention_mask = torch.cat([state.attention_mask, new_mask], dim=-1)
        # A padding slot is masked out but its position is still looked up: it repeats the row's
        # last real one, so it never runs past the model's positions (learned position tables) or
        # stretches a dynamic RoPE for the whole batch.
        positions = state.next_positions[:, None] + torch.minimum(offsets[None, :], draft_lengths[:, None])
        logits = self._forward(input_ids, attention_mask, positions, state.cache, keep=width + 1)
        stats.batch_forwards += 1
        stats.speculative_steps += width > 0
        verdict = verify_drafts(
            logits,
            input_ids[:, 1:],
            draft_lengths,
            seed=state.seeds,
            sample_ids=state.sample_ids,
            positions=state.completion_positions(),
            temperature=params.temperature,
            top_p=params.top_p,
        )
        # Live cache slots per row after this step (for the compaction check), read with the step's tokens.
        live = (state.attention_mask.sum(-1) + verdict.accepted + 1).max()
        accepted_host, tokens_host, logprobs_host, live_host = to_host([verdict.accepted, verdict.tokens, verdict.logprobs, live])
        accepted = accepted_host.tolist()
        # Keep, per row, its last token and accepted drafts in the cache; drop the rest.
        kept = max(accepted) + 1
        state.cache.crop(kept - (width + 1))
        state.attention_mask = torch.cat(
            [state.attention_mask, (offsets[None, :kept] <= verdict.accepted[:, None]).to(state.attention_mask.dtype)],
            dim=-1,
        )
        state.next_positions = state.next_positions + verdict.accepted + 1
        if width:
            rejections = sum(1 for n, a in zip(lengths, accepted, strict=True) if a < n)
            self.policy.observe(sum(lengths), sum(accepted), rejections)
        token_rows, logprob_rows = tokens_host.tolist(), logprobs_host.tolist()
        tokens, logprobs = [], []
        for i, row in enumerate(state.rows):
            row.forwards += 1
            row.drafted += lengths[i]
            row.accepted += accepted[i]
            tokens.append(token_rows[i][: accepted[i] + 1])
            logprobs.append(logprob_rows[i][: accepted[i] + 1])
        cached = state.attention_mask.shape[-1]
        if cached - int(live_host) >= max(16, cached // 4):
            self._compact(state)
            stats.compactions += 1
        return tokens, logprobs

    def _compact(self, state: _DecodeState) -> None:
        """Drop masked cache slots: each row's live entries move together, left-padded."""
        live = state.attention_mask.bool()
        counts = live.sum(-1)
        width = int(counts.max())
        # Row i's live indices in order (a stable sort puts them first), right-aligned in
        # `width` slots; its pad slots point at index 0 and stay masked.
        order = torch.argsort((~live).to(torch.int8), dim=-1, stable=True)[:, :width]
        slots = torch.arange(width, device=live.device)[None, :]
        shift = (width - counts)[:, None]
        pad = slots < shift
        index = order.gather(1, (slots - shift).clamp(min=0)).masked_fill(pad, 0)
        kept_slots = index[:, None, :, None]
        for layer in state.cache.layers:
            # Keys and values may differ in head size (multi-head latent attention: DeepSeek, MiniCPM3).
            layer.keys = layer.keys.gather(2, kept_slots.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1]))
            layer.values = layer.values.gather(2, kept_slots.expand(-1, layer.values.shape[1], -1, layer.values.shape[-1]))
        state.attention_mask = (~pad).to(state.attention_mask.dtype)

    def _prefill(self, requests: list[GenerationRequest], stats: SpeculationStats) -> _DecodeState:
        """Run the left-padded prompts through the model, filling a fresh cache.

        Each distinct prompt runs once (a GRPO group is several samples of one prompt); its keys,
        values and logits are then copied to every row that has it.
        """
        width = max(len(request.prompt_ids) for request in requests)
        distinct: dict[tuple[int, ...], int] = {}
        row_prompt = [distinct.setdefault(tuple(request.prompt_ids), len(distinct)) for request in requests]
        input_ids = torch.zeros(len(distinct), width, dtype=torch.int64)
        attention_mask = torch.zeros(len(distinct), width, dtype=torch.int64)
        for i, prompt in enumerate(distinct):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[i, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(self._device), attention_mask.to(self._device)
        # Positions count real tokens only, so a prompt sees the same positions at any padding.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
        cache = DynamicCache(config=self._model.config)
        logits = self._forward(input_ids, attention_mask, position_ids, cache)
        stats.batch_forwards += 1
        if len(distinct) < len(requests):
            rows = torch.tensor(row_prompt, dtype=torch.int64, device=self._device)
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)
            logits, attention_mask, position_ids = logits.index_select(0, rows), attention_mask[rows], position_ids[rows]
        return _DecodeState(
            rows=[_Row(request, forwards=1) for request in requests],
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
        tokens_host, logprobs_host = to_host([tokens, logprobs])  # the step's one device read
        return [[t] for t in tokens_host.tolist()], [[lp] for lp in logprobs_host.tolist()]

    def _forward_next(self, state: _DecodeState, stats: SpeculationStats) -> None:
        """Feed each active row's last token, extending the cache and refreshing the logits."""
        input_ids = torch.tensor([[row.completion[-1]] for row in state.rows], dtype=torch.int64, device=self._device)
        state.attention_mask = torch.cat([state.attention_mask, torch.ones_like(state.attention_mask[:, :1])], dim=-1)
        state.logits = self._forward(input_ids, state.attention_mask, state.next_positions[:, None], state.cache)
        state.next_positions = state.next_positions + 1
        stats.batch_forwards += 1
        for row in state.rows:
            row.forwards += 1

    def _forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache: DynamicCache, *, keep: int = 0
    ) -> Tensor:
        """Logits of the last position [B, V], or of the last `keep` positions [B, keep, V] when keep > 0."""
        output = self._model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=max(keep, 1),
        )
        return output.logits if keep else output.logits[:, -1, :]

    @torch.inference_mode()
    def time_forwards(
        self,
        batch: int,
        widths: Sequence[int],
        *,
        context: int = 128,
        rounds: int = 2,
        warm_up: Sequence[int] | None = None,
        wider_pays: Callable[[int, float], bool] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> list[float]:
        """Seconds for one step of each width of new tokens per row, at `batch` rows over a `context`-token cache.

        What the verify-cost calibration measures: the forward and the keyed sampling of every
        position it returns (a verify step samples all of them; at batch 1 in fp32 on a 2-core
        CPU that is ~1 ms for one position and ~8 ms for 17, next to a ~55 ms forward). Widths
        are timed in turn, `rounds` times after a warm-up round, and each keeps its fastest run:
        on a shared machine noise only ever adds time, and interleaving spreads it over all
        widths instead of skewing one. The warm-up runs `warm_up` (default: every width); its
        times count too. `wider_pays(width, ratio to width 1)`, if given, is asked after each
        width of a round: False skips the wider ones (returned as inf; the caller extrapolates).
        Steps are timed by `clock` (default `work_clock`: the thread's CPU time on a one-thread CPU,
        so a peer's work on the same cores does not count).
        """
        clock = clock if clock is not None else work_clock(self._device)
        widest = max(widths)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self._vocab_size, (batch, context + widest), generator=generator).to(self._device)
        positions = torch.arange(context + widest, device=self._device).expand(batch, -1)
        mask = torch.ones(batch, context + widest, dtype=torch.int64, device=self._device)
        cache = DynamicCache(config=self._model.config)
        self._forward(ids[:, :context], mask[:, :context], positions[:, :context], cache)
        best = [float("inf")] * len(widths)

        def step(width: int) -> float:
            start = clock()
            end = context + width
            logits = self._forward(ids[:, context:end], mask[:, :end], positions[:, context:end], cache, keep=width)
            rows = torch.arange(batch * width, device=self._device)
            sample_tokens(logits.reshape(batch * width, -1), seed=0, sample_ids=rows, positions=rows, temperature=1.0, top_p=1.0)
            synchronize(self._device)
            seconds = clock() - start
            cache.crop(-width)
            return seconds

        for i, width in enumerate(widths):
            if warm_up is None or width in warm_up:
                seconds = step(width)
                best[i] = seconds if warm_up is not None else best[i]
        for _ in range(rounds):
            for i, width in enumerate(widths):
                best[i] = min(best[i], step(width))
                if wider_pays is not None and i + 1 < len(widths) and not wider_pays(width, best[i] / best[0]):
                    break
        return best
