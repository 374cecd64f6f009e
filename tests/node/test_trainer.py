"""GRPO trainer with truncated importance weights, on a tiny float64 model."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hivespec.node.trainer import OWN, Trainer, TrainSample, group_advantages


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).to(torch.float64).eval()


def _logp(model, prompt, completion) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def _trainer(model, **kwargs) -> Trainer:
    defaults = dict(learning_rate=1e-2, tis_clip=2.0, micro_batch_size=3, autocast_dtype=None)
    return Trainer(model, **{**defaults, **kwargs})


def test_group_advantages_by_hand():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.5], ["a", "a", "b", "b", "c"], eps=0.0)
    assert adv[:4] == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert adv[4] == 0.0  # a group of one has no baseline
    assert group_advantages([1.0, 1.0], ["a", "a"]) == [0.0, 0.0]  # no spread, no signal
    mean_std = group_advantages([3.0, 0.0, 0.0], ["g"] * 3, eps=0.0)
    std = math.sqrt(((3 - 1) ** 2 + 1 + 1) / 3)
    assert mean_std == pytest.approx([2 / std, -1 / std, -1 / std])


def test_on_policy_own_samples_have_weight_one():
    model = _tiny()
    prompt = [1, 2, 3]
    samples = [
        TrainSample(prompt, c, _logp(model, prompt, c), r, "g")
        for c, r in (([4, 5, 6], 1.0), ([7, 8], 0.0), ([9], 0.0))
    ]
    stats = _trainer(model).step(samples)
    assert stats.own is not None and stats.foreign is None
    assert stats.own.mean_weight == pytest.approx(1.0, abs=1e-9)
    assert stats.own.max_weight == pytest.approx(1.0, abs=1e-9)
    assert stats.own.truncated_fraction == 0.0
    assert stats.trained_samples == 3 and stats.tokens == 6


def test_step_moves_probability_towards_rewarded_completion():
    model = _tiny()
    prompt, good, bad = [1, 2], [10, 11], [20, 21]
    trainer = _trainer(model, learning_rate=5e-2)
    before = sum(_logp(model, prompt, good)) - sum(_logp(model, prompt, bad))
    for _ in range(3):
        trainer.step(
            [TrainSample(prompt, good, _logp(model, prompt, good), 1.0, "g"),
             TrainSample(prompt, bad, _logp(model, prompt, bad), 0.0, "g")]
        )
    after = sum(_logp(model, prompt, good)) - sum(_logp(model, prompt, bad))
    assert after > before + 1.0
    assert trainer.version == 3


@pytest.mark.parametrize("forged", [-20.0, 0.0])
def test_forged_foreign_logprobs_stay_bounded_and_counted(forged):
    model = _tiny()
    prompt = [3, 4]
    samples = [
        TrainSample(prompt, [5, 6, 7], [forged] * 3, 1.0, "p", source="peer-a"),
        TrainSample(prompt, [8, 9, 10], [forged] * 3, 0.0, "p", source="peer-a"),
        TrainSample(prompt, [11], _logp(model, prompt, [11]), 0.0, "own-group"),
    ]
    stats = _trainer(model).step(samples)
    assert stats.foreign is not None and stats.foreign.tokens == 6
    assert stats.foreign.max_weight <= 2.0
    assert all(math.isfinite(v) for v in (stats.foreign.mean_weight, stats.loss, stats.grad_norm))
    if forged == -20.0:  # pi/mu is astronomically large: every token is truncated at C
        assert stats.foreign.truncated_fraction == 1.0 and stats.foreign.max_weight == 2.0
    else:  # mu claims certainty: pi/mu = pi < 1, nothing truncated
        assert stats.foreign.truncated_fraction == 0.0 and stats.foreign.max_weight < 1.0
    assert stats.foreign_samples == 2
    assert stats.own is not None  # the zero-advantage own sample still gets weight statistics


def test_zero_advantage_step_changes_nothing():
    model = _tiny()
    before = [p.detach().clone() for p in model.parameters()]
    prompt = [1]
    stats = _trainer(model).step([TrainSample(prompt, [2], _logp(model, prompt, [2]), 1.0, "g", OWN)] * 2)
    assert stats.trained_samples == 0 and stats.loss == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
