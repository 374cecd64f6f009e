"""GRPO trainer over own and foreign rollouts with filtered truncated importance sampling.

Every sample carries the log-prob of each completion token under the policy that sampled it, the
behaviour policy mu: our bf16 engine for own samples (the ratio then corrects engine vs trainer
numerics and, with rollout.top_p < 1, the nucleus: an own token's ratio is at most 1, the mass of the
nucleus it was drawn from, so config refuses a top_p under tis_mask_low), another peer's policy a few
versions away for foreign ones. The loss of one step is the decoupled PPO objective (verl's "decoupled"
rollout correction, AReaL):

    L = - 1/K  sum_t  w_t * min(r_t A, clip(r_t, 1 - eps, 1 + eps) A)  +  kl_coef * KL_t

- pi_old is the trainer's own log-prob at the start of the step, from the first epoch's forward
  (no extra pass); r_t = pi_theta / pi_old is exactly 1 in the first epoch, so with ppo_epochs = 1
  this is plain importance-weighted GRPO and the clip only matters when a batch is reused.
- w_t = min(pi_old / mu, C) after the filters (kernels.importance): masked tokens are dropped
  from the sum and from K, the number of kept tokens in the step.
- A is the sample's group-relative advantage; KL_t is the k3 estimator against the behaviour
  policy (see ``_kl``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from hivespec.kernels.host_transfer import to_host
from hivespec.kernels.importance import (
    ImportanceStats,
    ImportanceWeights,
    importance_stats_where,
    importance_weights,
)
from hivespec.kernels.logprobs import token_logprobs
from hivespec.node.model.attention import SHARED_PROMPT_MIN_SAMPLES, MicroBatchAttention, hidden_states, running
from hivespec.protocol.advantages import group_advantages
from hivespec.protocol.errors import UserError

if TYPE_CHECKING:
    from hivespec.node.config import TrainConfig
    from hivespec.protocol.rollout import Rollout

log = logging.getLogger(__name__)

OWN = "own"
# The most the trainer's float32 log-probs may differ from the model's own forward's (`Trainer.check_logits`): float32
# sums in another order differ by 1e-6-1e-5; a scale or cap the trainer missed, by tenths to nats.
LOGITS_TOLERANCE = 1e-3
_FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where torch has a fused AdamW kernel for every float dtype we train in

MaskLevel = Literal["none", "token", "sequence"]


class LogitsNotReproduced(UserError):
    """The trainer's log-probs are not the model's own (`Trainer.check_logits`); the message names the model type."""


@dataclass(frozen=True)
class TrainSample:
    """One completion to learn from; ``group`` is the prompt id advantages are relative within.

    ``source`` is ``OWN`` or the author's peer id; statistics are kept per source.
    """

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    behaviour_logprobs: Sequence[float]
    reward: float
    group: str
    source: str = OWN
    advantage: float | None = None  # precomputed over its whole group (a step may take part of a peer's group)

    @classmethod
    def from_rollout(cls, rollout: Rollout, source: str, *, advantage: float | None = None) -> TrainSample:
        """A wire rollout as a sample of `source` (OWN or its author's peer id), grouped by its prompt id.

        `advantage` given: use it as is (computed over the author's whole group when it was admitted);
        else it is computed within this step's samples of the same group.
        """
        return cls(
            prompt_ids=rollout.prompt_ids.tolist(),
            completion_ids=rollout.completion_ids.tolist(),
            behaviour_logprobs=rollout.behaviour_logprobs.tolist(),
            reward=rollout.reward,
            group=rollout.prompt_id,
            source=source,
            advantage=advantage,
        )


@dataclass(frozen=True)
class ImportanceSettings:
    """How behaviour-policy mismatch is corrected; the names map onto verl / slime / TRL options.

    enabled=False trains on every sample as if it were on-policy (what RL Swarm does): weight 1,
    no filter, no statistics; it exists as the baseline for comparisons. clip is the truncation
    cap C (verl rollout_is_threshold, slime --tis-clip); mask picks the filter level ('token':
    IcePop / verl rollout_rs=token, 'sequence': the geometric-mean ratio, verl rollout_rs=geometric)
    with bounds [mask_low, mask_high]; veto masks tokens whose behaviour probability is below it.
    """

    enabled: bool = True
    clip: float | None = 2.0
    mask: MaskLevel = "sequence"
    mask_low: float = 0.5
    mask_high: float = 2.0
    veto: float | None = None

    def __post_init__(self) -> None:
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip >= 1.0):
            raise ValueError(f"clip must be >= 1 or None, got {self.clip}; 2.0 is the common choice")
        if not 0.0 < self.mask_low <= 1.0 <= self.mask_high < math.inf:
            raise ValueError(f"mask bounds need 0 < mask_low <= 1 <= mask_high, got [{self.mask_low}, {self.mask_high}]")
        if self.clip is None and self.mask != "token":
            raise ValueError("clip=None leaves weights unbounded unless mask='token'; set clip (e.g. 2.0)")
        if self.veto is not None and not 0.0 < self.veto < 1.0:
            raise ValueError(f"veto must be in (0, 1) or None, got {self.veto}; 1e-4 is a common choice")

    @classmethod
    def from_config(cls, train: TrainConfig) -> ImportanceSettings:
        """The `train` section's tis_* fields and importance_sampling."""
        return cls(
            enabled=train.importance_sampling, clip=train.tis_clip, mask=train.tis_mask,
            mask_low=train.tis_mask_low, mask_high=train.tis_mask_high, veto=train.tis_veto,
        )


@dataclass(frozen=True)
class StepStats:
    """What one ``Trainer.step`` did. ``sources`` holds importance statistics per source (OWN or a
    peer id); ``own`` and ``foreign`` aggregate them. None where no tokens of that kind were seen or
    importance sampling is disabled. ``kept_tokens`` is the loss's denominator K."""

    version: int
    samples: int
    foreign_samples: int
    trained_samples: int
    tokens: int
    kept_tokens: int
    loss: float
    grad_norm: float
    reward_mean: float
    own: ImportanceStats | None
    foreign: ImportanceStats | None
    seconds: float
    sources: dict[str, ImportanceStats] = field(default_factory=dict)
    clip_fraction: float = 0.0
    kl: float | None = None
    source_samples: dict[str, int] = field(default_factory=dict)  # samples trained on (with a gradient) per source (OWN or a peer id)
    foreign_trained_samples: int = 0  # foreign samples that carried a gradient (a nonzero advantage)
    optimizer_steps: int = 0  # optimizer steps taken; 0: no weight moved (no sample had a gradient, or the filters kept no token)
    micro_batch_size: int = 0  # samples a forward and backward took at most (the config's, or less to fit the memory)


@dataclass
class _MicroBatch:
    """Tensors of one micro batch, built once and reused across PPO epochs."""

    samples: list[tuple[TrainSample, float]]
    with_grad: bool
    input_ids: Tensor
    attention: Tensor
    rows: Tensor
    cols: Tensor  # position in the backbone's hidden states of the state that predicts each completion token
    targets: Tensor
    behaviour: Tensor
    advantage: Tensor
    sequence_ids: Tensor
    source_ids: Tensor
    # (1, prompt tokens) where every row has this prompt: it is run once and `input_ids` hold the completions only
    prompt: Tensor | None = None
    attention_impl: str | None = None  # the model's attention implementation for this micro batch (None: the model's own)


class Trainer:
    """Owns the policy's master weights and its optimizer; ``step`` applies one GRPO/PPO update."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        learning_rate: float,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        importance: ImportanceSettings = ImportanceSettings(),
        ppo_epochs: int = 1,
        clip_epsilon: float = 0.2,
        kl_coef: float = 0.0,
        micro_batch_size: int = 8,
        temperature: float = 1.0,
        autocast_dtype: torch.dtype | None = torch.bfloat16,
        flat_sample_stats: bool = False,
        share_prompts: bool = False,
        eager_attention: bool = False,
    ) -> None:
        if ppo_epochs < 1:
            raise ValueError(f"ppo_epochs must be >= 1, got {ppo_epochs}")
        if not 0.0 < clip_epsilon < 1.0:
            raise ValueError(f"clip_epsilon must be in (0, 1), got {clip_epsilon}; 0.2 is PPO's default")
        if kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.model = model
        self.importance = importance
        self.ppo_epochs = ppo_epochs
        self.clip_epsilon = clip_epsilon
        self.kl_coef = kl_coef
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        # Behaviour log-probs are taken under the tempered distribution; greedy has no density.
        self.temperature = temperature if temperature > 0 else 1.0
        self.autocast_dtype = autocast_dtype
        # Samples of zero advantage carry no gradient; a forward of them only adds them to the importance statistics.
        self.flat_sample_stats = flat_sample_stats
        # Samples of one prompt in a micro batch run its forward once (SHARED_PROMPT_MIN_SAMPLES); the same log-probs.
        # Faster only where the saved tokens outweigh one more forward (`attention.decide_shared_prompts` measures it).
        self.share_prompts = share_prompts
        self.version = 0
        self.device = next(model.parameters()).device
        # What the model's forward does to its head's logits before the engine samples from them.
        self._logit_scale, self._logit_softcap = logit_transform(model.config)
        # Eager attention where `eager_attention` (`hivespec.node.model.attention` measures whether it is faster on this
        # machine) and a micro batch's probabilities fit its budget; the model's own elsewhere.
        self._attention = MicroBatchAttention.for_model(model, eager=eager_attention)
        self._params = [p for p in model.parameters() if p.requires_grad]
        # The fused kernel updates every tensor in one pass: 0.05 s against 0.28 s per step for SmolLM2-135M on a
        # 2-core CPU (torch 2.13). Its results are AdamW's; which kernel runs is the machine's choice, not the checkpoint's.
        self.optimizer = torch.optim.AdamW(self._params, lr=learning_rate, weight_decay=weight_decay,
                                           fused=self.device.type in _FUSED_ADAMW_DEVICES)
        # Called as (index, total) before each micro batch's forward and backward until the first
        # optimizer step; it may raise (a stop request) to abandon the step with the model untouched.
        self.between_micro_batches: Callable[[int, int], None] | None = None
        self.optimizer_steps_in_call = 0


    @classmethod
    def from_config(
        cls, model: torch.nn.Module, train: TrainConfig, *, temperature: float, autocast_dtype: torch.dtype | None,
        eager_attention: bool = False, share_prompts: bool = False,
    ) -> Trainer:
        """A trainer with the `train` section's optimizer, importance and PPO settings.

        `temperature` must be the one the rollouts were sampled at (`rollout.temperature`): the
        trainer's log-probs are taken under it. `autocast_dtype` is precision's choice for the
        trainer (None: float32 forwards), `eager_attention` and `share_prompts` attention's
        (`hivespec.node.model.attention`: what `model.attention` and `train.share_prompts` became here).
        """
        return cls(
            model,
            learning_rate=train.learning_rate,
            weight_decay=train.weight_decay,
            max_grad_norm=train.max_grad_norm,
            importance=ImportanceSettings.from_config(train),
            ppo_epochs=train.ppo_epochs,
            clip_epsilon=train.clip_epsilon,
            kl_coef=train.kl_coef,
            micro_batch_size=train.micro_batch_size,
            temperature=temperature,
            autocast_dtype=autocast_dtype,
            flat_sample_stats=train.flat_sample_stats,
            eager_attention=eager_attention,
            share_prompts=share_prompts,
        )

    def step(self, samples: Sequence[TrainSample]) -> StepStats:
        """One policy update (``ppo_epochs`` optimizer steps) over ``samples``.

        Samples with zero advantage (a group whose rewards are all equal) carry no gradient: they
        are not run at all, unless ``flat_sample_stats`` asks for one forward pass of them without
        autograd, so that the importance statistics cover every sample, own and foreign (on a CPU
        that forward is up to a tenth of a step where most groups have one reward). A step
        where no sample has a gradient moves no weight (``optimizer_steps`` 0).
        """
        started = time.perf_counter()
        sources = sorted({s.source for s in samples})
        batches = list(self._plan(samples, sources, flat=self.flat_sample_stats))
        # The model stays in eval mode: dropout (a config's attention or hidden dropout) would make the step's forward
        # another policy than the one `logprobs` and the engine ran, and the importance ratios noise.
        self.model.eval()
        self.optimizer_steps_in_call = 0
        try:
            return self._step(samples, sources, batches, started)
        except BaseException:
            if self.optimizer_steps_in_call == 0:  # abandoned before any update: leave no gradient behind
                self.optimizer.zero_grad(set_to_none=True)
            raise

    def _step(self, samples: Sequence[TrainSample], sources: list[str], batches: list[_MicroBatch], started: float) -> StepStats:
        hook = self.between_micro_batches
        old: list[Tensor] = []
        weights: list[ImportanceWeights] = []
        # Totals stay on the device and are read once at the end of the step (one transfer).
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        loss_sum = kl_sum = clipped = grad_norm = zero
        kept_tokens = 0
        for epoch in range(self.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for index, batch in enumerate(batches):
                if epoch > 0 and not batch.with_grad:
                    continue
                if hook is not None and epoch == 0:
                    hook(index, len(batches))
                with torch.set_grad_enabled(batch.with_grad):
                    logp = self._logprobs(batch)
                if epoch == 0:
                    old.append(logp.detach())
                    weights.append(self._weights(old[index], batch))
                if not batch.with_grad:
                    continue
                loss, batch_clipped, batch_kl = self._loss(logp, old[index], weights[index], batch)
                if hook is not None and epoch == 0:
                    hook(index, len(batches))  # a second safe point: a forward and a backward take seconds each on a CPU
                loss.backward()
                if epoch == self.ppo_epochs - 1:
                    loss_sum = loss_sum + loss.detach().double()
                    clipped = clipped + batch_clipped
                    kl_sum = kl_sum + batch_kl
            if epoch == 0:
                counts = [w.kept.sum() for w, b in zip(weights, batches) if b.with_grad]
                # The gradient's divisor must be a host number: one read per step.
                kept_tokens = int(to_host([torch.stack(counts).sum()])[0]) if counts else 0
            if kept_tokens == 0:
                break
            # The loss is a sum over kept tokens; dividing the gradient once by K gives the token
            # mean without knowing K before the first backward (it depends on every micro batch).
            for p in self._params:
                if p.grad is not None:
                    p.grad.div_(kept_tokens)
            grad_norm = torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm).double()
            if not bool(torch.isfinite(grad_norm)):  # one host read an update
                # A NaN or inf gradient (an overflow under autocast, a poisoned sample) would be every weight's NaN from
                # here on, synced to the engine and published: the update is skipped, the weights kept as they were.
                log.warning("training step %d: the gradient norm is %s: update skipped, the weights kept (epoch %d of %d)",
                            self.version + 1, float(grad_norm), epoch + 1, self.ppo_epochs)
                break
            self.optimizer_steps_in_call += 1
            self.optimizer.step()
        # The gradients (one fp32 copy of the weights) are not needed until the next step: free them now, not at its
        # start, so generation, sync and gossip between steps run without them (a node's floor drops by that copy).
        self.optimizer.zero_grad(set_to_none=True)
        loss_total, clipped_total, kl_total, grad_norm_value = to_host([torch.stack([loss_sum, clipped, kl_sum, grad_norm])])[0].tolist()
        self.version += 1
        by_source, foreign = self._source_stats(weights, batches, sources)
        trained = [s for b in batches if b.with_grad for s, _ in b.samples]
        return StepStats(
            version=self.version,
            samples=len(samples),
            foreign_samples=sum(1 for s in samples if s.source != OWN),
            trained_samples=len(trained),
            tokens=sum(len(s.completion_ids) for s in trained),
            kept_tokens=kept_tokens,
            loss=loss_total / kept_tokens if kept_tokens else 0.0,
            grad_norm=grad_norm_value,
            reward_mean=sum(s.reward for s in samples) / max(1, len(samples)),
            own=by_source.get(OWN),
            foreign=foreign,
            seconds=time.perf_counter() - started,
            sources=by_source,
            clip_fraction=clipped_total / kept_tokens if kept_tokens else 0.0,
            kl=kl_total / kept_tokens if self.kl_coef > 0.0 and kept_tokens else None,
            source_samples=dict(Counter(s.source for s in trained)),
            foreign_trained_samples=sum(1 for s in trained if s.source != OWN),
            optimizer_steps=self.optimizer_steps_in_call,
            micro_batch_size=self.micro_batch_size,
        )

    @torch.no_grad()
    def logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """The trainer's log-prob of every completion token, per sample, in ``samples`` order.

        Runs the exact micro batches and kernels ``step`` would run on the same samples, so these
        values, used as behaviour log-probs, give importance weights of exactly 1.
        """
        sources = sorted({s.source for s in samples})
        out: dict[int, list[float]] = {}
        batches = list(self._plan(samples, sources, flat=True))
        hosted = to_host([self._logprobs(batch) for batch in batches])  # one transfer for every micro batch
        for batch, host in zip(batches, hosted, strict=True):
            values = host.tolist()  # host data: one to_host above
            start = 0
            for sample, _ in batch.samples:
                stop = start + len(sample.completion_ids)
                out[id(sample)] = values[start:stop]
                start = stop
        return [out.get(id(s), []) for s in samples]

    def check_logits(self, tokens: int = 8) -> None:
        """Raise `LogitsNotReproduced` where the trainer's log-probs are not those of the model's own forward.

        The trainer reads them from the backbone's hidden states and the head (`logit_transform`: the scales and caps
        of the architectures it knows); a model whose forward does something else to its logits (remote code, a later
        architecture) would make every own sample off-policy and every gradient another policy's. One forward of
        `tokens` tokens each way, in float32, before a node starts.
        """
        vocab = self.model.get_output_embeddings().weight.shape[0]
        ids = [(7919 * i + 11) % vocab for i in range(tokens)]
        sample = TrainSample(ids[:2], ids[2:], [0.0] * (tokens - 2), 0.0, "check")
        autocast, self.autocast_dtype = self.autocast_dtype, None
        try:
            with torch.no_grad():
                ours = torch.tensor(self.logprobs([sample])[0], dtype=torch.float64)
                logits = self.model(input_ids=torch.tensor([ids], device=self.device)).logits[0, 1:-1]
        finally:
            self.autocast_dtype = autocast
        theirs = torch.log_softmax(logits.double() / self.temperature, dim=-1).gather(-1, torch.tensor(ids[2:], device=logits.device)[:, None])
        gap = float((ours - theirs.squeeze(-1).cpu()).abs().max())
        if not gap <= LOGITS_TOLERANCE:
            kind = getattr(self.model.config, "model_type", type(self.model).__name__)
            raise LogitsNotReproduced(
                f"hivespec's trainer cannot reproduce the log-probs of model type {kind!r}: its forward changes the "
                f"output head's logits in a way the trainer does not know (log-probs {gap:.3g} apart); training it "
                "would take every own sample as off-policy. Use a model of a supported architecture."
            )

    def _plan(self, samples: Sequence[TrainSample], sources: list[str], *, flat: bool) -> Iterator[_MicroBatch]:
        """Micro batches: samples with an advantage first (with autograd), then, where `flat`, those
        without (no autograd). Within each, the samples of a prompt that fill SHARED_PROMPT_MIN_SAMPLES
        rows run it once; the rest are sorted by length so padding stays small."""
        grouped = [s for s in samples if s.advantage is None]
        computed = dict(zip(map(id, grouped), group_advantages([s.reward for s in grouped], [s.group for s in grouped]), strict=True))
        advantages = [s.advantage if s.advantage is not None else computed[id(s)] for s in samples]
        usable = [(s, a) for s, a in zip(samples, advantages, strict=True) if len(s.completion_ids) > 0]
        trained = sorted((p for p in usable if p[1] != 0.0), key=_length)
        idle = sorted((p for p in usable if p[1] == 0.0), key=_length) if flat else []
        index = {source: i for i, source in enumerate(sources)}
        size = self.micro_batch_size
        for group, with_grad in ((trained, True), (idle, False)):
            shared, rest = _split_shared_prompts(group, size) if self.share_prompts else ([], group)
            for chunk in shared:
                yield self._build(chunk, with_grad, index, share_prompt=True)
            for start in range(0, len(rest), size):
                yield self._build(rest[start : start + size], with_grad, index)

    def _build(self, chunk: list[tuple[TrainSample, float]], with_grad: bool, source_index: dict[str, int], *,
               share_prompt: bool = False) -> _MicroBatch:
        """Tensors of one micro batch. `share_prompt`: every sample has the same prompt, which is run once
        (`_MicroBatch.prompt`); `input_ids` then hold the completions only and the attention mask covers both."""
        shared = len(chunk[0][0].prompt_ids) if share_prompt else 0
        lengths = [len(s.prompt_ids) + len(s.completion_ids) - shared for s, _ in chunk]
        input_ids = torch.zeros(len(chunk), max(lengths), dtype=torch.long)
        attention = torch.zeros(len(chunk), shared + max(lengths), dtype=torch.long)
        rows, cols, targets, behaviour, advantage, sequence, source = [], [], [], [], [], [], []
        for row, (sample, adv) in enumerate(chunk):
            tokens = list(sample.prompt_ids)[shared:] + list(sample.completion_ids)
            input_ids[row, : len(tokens)] = torch.tensor(tokens)
            attention[row, : shared + len(tokens)] = 1
            n = len(sample.completion_ids)
            if len(sample.behaviour_logprobs) != n:
                raise ValueError(
                    f"sample of group {sample.group!r} has {n} completion tokens but "
                    f"{len(sample.behaviour_logprobs)} behaviour log-probs; they must pair one to one"
                )
            # The token at position p is predicted by the hidden state at p - 1; with a shared prompt the
            # hidden states are the prompt's last one followed by the completion's (see `hidden_states`).
            first = 0 if share_prompt else len(sample.prompt_ids) - 1
            rows.extend([row] * n)
            cols.extend(range(first, first + n))
            targets.extend(sample.completion_ids)
            behaviour.extend(sample.behaviour_logprobs)
            advantage.extend([adv] * n)
            sequence.extend([row] * n)
            source.extend([source_index[sample.source]] * n)
        device = self.device

        def tensor(values: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return _MicroBatch(
            samples=chunk,
            with_grad=with_grad,
            input_ids=input_ids.to(device),
            attention=attention.to(device),
            rows=tensor(rows, torch.long),
            cols=tensor(cols, torch.long),
            targets=tensor(targets, torch.long),
            behaviour=tensor(behaviour, torch.float32),
            advantage=tensor(advantage, torch.float32),
            sequence_ids=tensor(sequence, torch.long),
            source_ids=tensor(source, torch.long),
            prompt=torch.tensor([chunk[0][0].prompt_ids], dtype=torch.long, device=device) if share_prompt else None,
            attention_impl=self._attention.choose(len(chunk), input_ids.shape[1], attention.shape[1]),
        )

    def _logprobs(self, batch: _MicroBatch) -> Tensor:
        """Float32 log-prob of every completion token of the micro batch, flat."""
        backbone = getattr(self.model, self.model.base_model_prefix)
        head = self.model.get_output_embeddings()
        with running(self.model, batch.attention_impl), \
                torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            hidden = hidden_states(backbone, batch.input_ids, batch.attention, batch.prompt)
            selected = hidden[batch.rows, batch.cols]
            # The head's backward matmuls follow autocast's dtype; its forward stays float32.
            logp = token_logprobs(selected, head.weight, batch.targets, temperature=self.temperature, bias=getattr(head, "bias", None),
                                  scale=self._logit_scale, softcap=self._logit_softcap, grad_dtype=self.autocast_dtype)
        return logp.float()

    def _weights(self, old: Tensor, batch: _MicroBatch) -> ImportanceWeights:
        valid = torch.ones_like(old, dtype=torch.bool)
        settings = self.importance
        if not settings.enabled:
            zeros = torch.zeros_like(valid)
            return ImportanceWeights(torch.ones_like(old), valid, valid, zeros, zeros)
        bounds = (settings.mask_low, settings.mask_high)
        return importance_weights(
            old,
            batch.behaviour,
            valid,
            sequence_ids=batch.sequence_ids,
            clip=settings.clip,
            token_bounds=bounds if settings.mask == "token" else None,
            sequence_bounds=bounds if settings.mask == "sequence" else None,
            veto=settings.veto,
        )

    def _loss(self, logp: Tensor, old: Tensor, weights: ImportanceWeights, batch: _MicroBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Sum over kept tokens of the clipped, weighted surrogate (+ KL); also clipped count and KL sum (0-d, on the device)."""
        ratio = torch.exp(logp - old)  # exactly 1 in the first epoch: logp - logp.detach() == 0
        advantage = batch.advantage
        surrogate = -advantage * ratio
        clipped_surrogate = -advantage * ratio.clamp(1.0 - self.clip_epsilon, 1.0 + self.clip_epsilon)
        per_token = weights.weights * torch.maximum(surrogate, clipped_surrogate)
        kept = weights.kept
        clipped = ((clipped_surrogate > surrogate) & kept).sum().double()
        kl_sum = torch.zeros((), dtype=torch.float64, device=logp.device)
        if self.kl_coef > 0.0:
            kl = self._kl(logp, batch.behaviour)
            per_token = per_token + self.kl_coef * kl
            kl_sum = torch.where(kept, kl.detach(), torch.zeros((), dtype=kl.dtype, device=kl.device)).sum().double()
        return torch.where(kept, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device)).sum(), clipped, kl_sum

    def _kl(self, logp: Tensor, behaviour: Tensor) -> Tensor:
        """k3 estimate of KL(mu || pi_theta) per token, against the behaviour policy mu.

        The reference is the sample's own behaviour policy, not a frozen model copy: it comes free
        with every sample (no second model in memory, no extra forward, which costs a CPU node
        about a third of its step), and it acts as a per-sample trust region, like PPO's clip.
        The log-ratio is clamped to [log mask_low, log mask_high] first, so the pull of one token
        is bounded (|d/dlogp| <= max(1/mask_low - 1, 1 - 1/mask_high)) even when a forged
        behaviour log-prob slipped past the filters.
        """
        low, high = math.log(self.importance.mask_low), math.log(self.importance.mask_high)
        x = (behaviour - logp).clamp(-high, -low)
        return torch.exp(x) - x - 1.0

    def _source_stats(
        self, weights: list[ImportanceWeights], batches: list[_MicroBatch], sources: list[str]
    ) -> tuple[dict[str, ImportanceStats], ImportanceStats | None]:
        """Stats per source name, and over all foreign tokens; empty / None when disabled."""
        if not self.importance.enabled or not weights:
            return {}, None
        merged = ImportanceWeights.cat(weights)
        source_ids = torch.cat([b.source_ids for b in batches])
        foreign = source_ids != (sources.index(OWN) if OWN in sources else -1)
        # Every source's statistics and the foreign aggregate in one device read.
        *per_source, foreign_stats = importance_stats_where(merged, [source_ids == i for i in range(len(sources))] + [foreign])
        by_source = dict(zip(sources, per_source, strict=True))
        return {k: v for k, v in by_source.items() if v.tokens > 0}, foreign_stats if foreign_stats.tokens > 0 else None


# Model types whose forward scales the head's logits, and the config key (divisor or factor) it scales them by.
_LOGIT_DIVISORS = {t: "logits_scaling" for t in (
    "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "granitemoehybrid", "minicpm3")}
_LOGIT_FACTORS = {"hyperclovax": "logits_scaling", "cohere": "logit_scale", "cohere2": "logit_scale",
                  "cohere2_moe": "logit_scale", "falcon_h1": "lm_head_multiplier"}


def logit_transform(config: object) -> tuple[float, float | None]:
    """(scale, softcap) of a transformers model's logits: its forward returns cap(scale * head(h)), cap(x) = softcap *
    tanh(x / softcap) (softcap None: no cap), as Granite (logits / logits_scaling), Cohere (* logit_scale), Falcon-H1
    (* lm_head_multiplier) and Gemma 2/3 (final_logit_softcapping) do. The trainer's log-probs must be the engine's."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(text, "model_type", "")
    scale = 1.0
    if kind in _LOGIT_DIVISORS:
        scale = 1.0 / float(getattr(text, _LOGIT_DIVISORS[kind]))
    elif kind in _LOGIT_FACTORS:
        scale = float(getattr(text, _LOGIT_FACTORS[kind]))
    softcap = getattr(text, "final_logit_softcapping", None)
    return scale, None if softcap is None else float(softcap)


def _length(pair: tuple[TrainSample, float]) -> int:
    """Tokens a sample runs whole: the sort key that keeps a micro batch's padding small."""
    return len(pair[0].prompt_ids) + len(pair[0].completion_ids)


def _split_shared_prompts(
    group: list[tuple[TrainSample, float]], size: int
) -> tuple[list[list[tuple[TrainSample, float]]], list[tuple[TrainSample, float]]]:
    """Micro batches of at most `size` samples of one prompt, each of at least SHARED_PROMPT_MIN_SAMPLES, and the
    samples left over (sorted by length); a sample without prompt tokens has nothing to share."""
    by_prompt: dict[tuple[int, ...], list[tuple[TrainSample, float]]] = defaultdict(list)
    rest = [pair for pair in group if not pair[0].prompt_ids]
    for pair in group:
        if pair[0].prompt_ids:
            by_prompt[tuple(pair[0].prompt_ids)].append(pair)
    shared = []
    for members in by_prompt.values():
        for start in range(0, len(members), size):
            chunk = members[start : start + size]
            if len(chunk) >= SHARED_PROMPT_MIN_SAMPLES:
                shared.append(chunk)
            else:
                rest.extend(chunk)
    return shared, sorted(rest, key=_length)
