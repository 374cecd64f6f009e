"""GRPO trainer over own and foreign rollouts with truncated importance weights.

Every sample carries the log-prob of each completion token under the policy that sampled it
(the behaviour policy mu). The gradient of one step is

    - sum_t  min(pi_theta(t) / mu(t), C) * A * grad log pi_theta(t)  /  (completion tokens)

with A the group-relative advantage of the sample. For own samples the ratio only corrects the
engine-vs-trainer numerics (bf16 engine, fp32 trainer) and stays near 1; for a peer's sample it
corrects for a different policy, and the cap C keeps one forged or stale sample from dominating.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch

from hivespec.kernels.importance import ImportanceStats, truncated_importance_weights
from hivespec.kernels.logprobs import token_logprobs

OWN = "own"


@dataclass(frozen=True)
class TrainSample:
    """One completion to learn from; ``group`` is the prompt id advantages are relative within."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    behaviour_logprobs: Sequence[float]
    reward: float
    group: str
    source: str = OWN


@dataclass(frozen=True)
class StepStats:
    version: int
    samples: int
    foreign_samples: int
    trained_samples: int
    tokens: int
    loss: float
    grad_norm: float
    reward_mean: float
    own: ImportanceStats | None
    foreign: ImportanceStats | None
    seconds: float


def group_advantages(rewards: Sequence[float], groups: Sequence[str], eps: float = 1e-4) -> list[float]:
    """GRPO advantages: (r - mean) / (std + eps) within each group; 0 for groups of one or no spread."""
    members: dict[str, list[int]] = defaultdict(list)
    for index, group in enumerate(groups):
        members[group].append(index)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        values = [rewards[i] for i in indices]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if len(values) < 2 or std < 1e-8:
            continue
        for i in indices:
            advantages[i] = (rewards[i] - mean) / (std + eps)
    return advantages


class Trainer:
    """Owns the policy's master weights and its optimizer; ``step`` applies one GRPO update."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        learning_rate: float,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        tis_clip: float = 2.0,
        micro_batch_size: int = 8,
        temperature: float = 1.0,
        autocast_dtype: torch.dtype | None = torch.bfloat16,
    ) -> None:
        self.model = model
        self.tis_clip = tis_clip
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        # Behaviour log-probs are taken under the tempered distribution; greedy has no density.
        self.temperature = temperature if temperature > 0 else 1.0
        self.autocast_dtype = autocast_dtype
        self.version = 0
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=learning_rate, weight_decay=weight_decay
        )

    def step(self, samples: Sequence[TrainSample]) -> StepStats:
        """One optimizer step over ``samples``.

        Samples with zero advantage (a group whose rewards are all equal) carry no gradient: they
        get a forward pass without autograd, only so the importance-weight statistics cover every
        sample, own and foreign.
        """
        started = time.perf_counter()
        advantages = group_advantages([s.reward for s in samples], [s.group for s in samples])
        usable = [(s, a) for s, a in zip(samples, advantages) if len(s.completion_ids) > 0]
        trained = [(s, a) for s, a in usable if a != 0.0]
        idle = [(s, a) for s, a in usable if a == 0.0]
        total_tokens = sum(len(s.completion_ids) for s, _ in trained)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        logps: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        behaviours: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        for chunk, with_grad in self._micro_batches(trained, idle):
            with torch.set_grad_enabled(with_grad):
                logp, behaviour, advantage, is_own = self._micro_batch_logprobs(chunk)
            if with_grad:
                mask = torch.ones_like(logp, dtype=torch.bool)
                weights, _ = truncated_importance_weights(logp.detach(), behaviour, mask, clip=self.tis_clip)
                loss = -(weights * advantage * logp).sum() / total_tokens
                loss.backward()
                loss_sum += float(loss.detach())
            for own in (True, False):
                selected = is_own == own
                logps[own].append(logp.detach()[selected])
                behaviours[own].append(behaviour[selected])
        grad_norm = 0.0
        if trained:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
            self.optimizer.step()
        self.version += 1
        self.model.eval()
        return StepStats(
            version=self.version,
            samples=len(samples),
            foreign_samples=sum(1 for s in samples if s.source != OWN),
            trained_samples=len(trained),
            tokens=total_tokens,
            loss=loss_sum,
            grad_norm=grad_norm,
            reward_mean=sum(s.reward for s in samples) / max(1, len(samples)),
            own=self._stats(logps[True], behaviours[True]),
            foreign=self._stats(logps[False], behaviours[False]),
            seconds=time.perf_counter() - started,
        )

    def _micro_batches(self, trained, idle):
        size = self.micro_batch_size
        for start in range(0, len(trained), size):
            yield trained[start : start + size], True
        for start in range(0, len(idle), size):
            yield idle[start : start + size], False

    def _micro_batch_logprobs(
        self, chunk: Sequence[tuple[TrainSample, float]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat per-completion-token (logp, behaviour logp, advantage, is_own) for a micro batch."""
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for s, _ in chunk]
        width = max(lengths)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros(len(chunk), width, dtype=torch.long)
        rows, cols, targets, behaviour, advantage, is_own = [], [], [], [], [], []
        for row, (sample, adv) in enumerate(chunk):
            tokens = list(sample.prompt_ids) + list(sample.completion_ids)
            input_ids[row, : len(tokens)] = torch.tensor(tokens)
            attention[row, : len(tokens)] = 1
            first = len(sample.prompt_ids)
            # The token at position p is predicted by the hidden state at p - 1.
            positions = range(first - 1, first - 1 + len(sample.completion_ids))
            rows.extend([row] * len(sample.completion_ids))
            cols.extend(positions)
            targets.extend(sample.completion_ids)
            behaviour.extend(sample.behaviour_logprobs)
            advantage.extend([adv] * len(sample.completion_ids))
            is_own.extend([sample.source == OWN] * len(sample.completion_ids))
        backbone = getattr(self.model, self.model.base_model_prefix)
        head = self.model.get_output_embeddings().weight
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            hidden = backbone(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device)
            ).last_hidden_state
            selected = hidden[torch.tensor(rows), torch.tensor(cols)]
            logp = token_logprobs(
                selected, head, torch.tensor(targets, device=self.device), temperature=self.temperature
            )
        return (
            logp.float(),
            torch.tensor(behaviour, dtype=torch.float32, device=self.device),
            torch.tensor(advantage, dtype=torch.float32, device=self.device),
            torch.tensor(is_own, dtype=torch.bool, device=self.device),
        )

    def _stats(self, logps: list[torch.Tensor], behaviours: list[torch.Tensor]) -> ImportanceStats | None:
        if not logps or sum(t.numel() for t in logps) == 0:
            return None
        logp = torch.cat(logps)
        behaviour = torch.cat(behaviours)
        _, stats = truncated_importance_weights(logp, behaviour, torch.ones_like(logp, dtype=torch.bool), clip=self.tis_clip)
        return stats
