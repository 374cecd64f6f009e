"""A round's own rollouts: this round's prompts, their completions from the engine, rewards from our verifier.

Every random choice is keyed: the prompts by (node seed, round), each completion by
(`derive_seed(node seed, "sampling", round)`, sample index), so a round re-run after a resume
draws exactly what the interrupted run drew. The result is wire `Rollout`s (uint32 token ids,
float32 behaviour log-probs), the form that is journaled, published, fed to the drafter and
trained on. Owns no network and no disk; an out-of-memory generation is split and retried
(node/supervise.py).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hivespec.node.model.engine import GenerationRequest, SamplingParams, SpeculationStats, TorchEngine
from hivespec.node.supervise import generate_splitting_on_oom
from hivespec.protocol.rollout import Rollout

if TYPE_CHECKING:
    from hivespec.node.config import RolloutConfig
    from hivespec.node.model.vllm_engine import VllmEngine
    from hivespec.node.tasks.source import TaskSource

log = logging.getLogger(__name__)


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (identical across processes and machines)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def make_rollouts(
    engine: TorchEngine | VllmEngine,
    tasks: TaskSource,
    tokenizer: Any,
    sampling: SamplingParams,
    config: RolloutConfig,
    *,
    seed: int,
    round_index: int,
    stats: SpeculationStats,
    on_tokens: Callable[[int], None] | None = None,
    on_split: Callable[[int], None] | None = None,
    max_positions: int | None = None,
) -> list[Rollout]:
    """Generate ``num_generations`` completions of each of the round's ``prompts_per_round`` prompts and score them.

    `stats` accumulates the engine's speculation counters. `on_tokens(added)` hears decoding
    progress (the native engine only: vLLM decodes a whole call at once) and may raise to stop
    the round; `on_split(size)` hears each out-of-memory split. A prompt that leaves less than
    ``sampling.max_new_tokens`` of the model's `max_positions` is skipped with a warning (a
    user's task file may hold one long question; the engine refuses it, which had ended the round).
    """
    prompts = tasks.prompts(seed=seed, round=round_index, count=config.prompts_per_round)
    sampling_seed = derive_seed(seed, "sampling", round_index)
    requests, owners = [], []
    for group, task in enumerate(prompts):
        prompt_ids = tuple(tasks.chat_prompt_ids(tokenizer, task))
        if max_positions is not None and len(prompt_ids) + sampling.max_new_tokens > max_positions:
            log.warning("round %d: prompt %s is %d tokens, and %d more would pass the model's %d positions: skipped "
                        "(shorten it, or lower rollout.max_completion_length)", round_index, task.prompt_id,
                        len(prompt_ids), sampling.max_new_tokens, max_positions)
            continue
        for i in range(config.num_generations):
            requests.append(GenerationRequest(prompt_ids=prompt_ids, seed=sampling_seed, sample_index=group * config.num_generations + i))
            owners.append(task)
    if isinstance(engine, TorchEngine):
        def generate(chunk: list[GenerationRequest]) -> list:
            return engine.generate(chunk, sampling, stats=stats, on_tokens=on_tokens)
    else:  # vLLM decodes a whole call at once: a stop waits for it
        def generate(chunk: list[GenerationRequest]) -> list:
            return engine.generate(chunk, sampling, stats=stats)
    samples = generate_splitting_on_oom(generate, requests, on_split=on_split)
    return [
        Rollout(
            prompt_id=task.prompt_id,
            sample_index=request.sample_index,
            seed=request.seed,
            prompt_ids=np.asarray(sample.prompt_ids, dtype=np.uint32),
            completion_ids=np.asarray(sample.completion_ids, dtype=np.uint32),
            behaviour_logprobs=np.asarray(sample.logprobs, dtype=np.float32),
            reward=float(tasks.reward(task, tokenizer.decode(sample.completion_ids, skip_special_tokens=True))),
            finish_reason=sample.finish_reason,
        )
        for request, task, sample in zip(requests, owners, samples)
    ]
