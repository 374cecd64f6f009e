"""GRPO/PPO trainer with filtered truncated importance sampling, on tiny models."""

import math

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PhiConfig,
    PhiForCausalLM,
)

from hivespec.kernels.importance import importance_weights
from hivespec.node.model.engine import GenerationRequest, SamplingParams, TorchEngine
from hivespec.node.model.loader import load_model
from hivespec.node.training.trainer import (
    OWN,
    ImportanceSettings,
    LogitsNotReproduced,
    Trainer,
    TrainSample,
)
from hivespec.protocol.advantages import group_advantages


def _tiny(seed: int = 0, device: str = "cpu") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).to(device=device, dtype=torch.float64).eval()


def _logp(model, prompt, completion) -> list[float]:
    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def _trainer(model, **kwargs) -> Trainer:
    defaults = {"learning_rate": 1e-2, "micro_batch_size": 3, "autocast_dtype": None}
    return Trainer(model, **{**defaults, **kwargs})


def _group(model, prompt, completions, rewards, group="g", source=OWN, behaviour=None):
    return [
        TrainSample(prompt, c, behaviour(c) if behaviour else _logp(model, prompt, c), r, group, source)
        for c, r in zip(completions, rewards)
    ]


def test_group_advantages_by_hand():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.5], ["a", "a", "b", "b", "c"], eps=0.0)
    assert adv[:4] == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert adv[4] == 0.0  # a group of one has no baseline
    assert group_advantages([1.0, 1.0], ["a", "a"]) == [0.0, 0.0]  # no spread, no signal
    mean_std = group_advantages([3.0, 0.0, 0.0], ["g"] * 3, eps=0.0)
    std = math.sqrt(((3 - 1) ** 2 + 1 + 1) / 3)
    assert mean_std == pytest.approx([2 / std, -1 / std, -1 / std])


@pytest.mark.parametrize("autocast, dropout", [(False, 0.0), (True, 0.0), (False, 0.5)],
                         ids=["float32", "autocast", "a-model-with-dropout"])
def test_on_policy_own_samples_have_weight_exactly_one(autocast, dropout):
    """Behaviour log-probs from the trainer's own path (same micro batches, kernels, dtype and
    autocast) give log-ratios of exactly 0, so weights, PPO ratios and ESS/n are exactly 1; a model
    whose config has dropout trains without it (RL's ratios compare two forwards of one policy)."""
    model = load_model("tiny", dtype=torch.float32)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = dropout
    trainer = _trainer(model, micro_batch_size=2, autocast_dtype=torch.bfloat16 if autocast else None, flat_sample_stats=True)
    prompt = [1, 2, 3, 4]
    shapes = [([40, 41, 42], 1.0), ([50, 51], 0.0), ([60], 0.0), ([70, 71, 72, 73], 1.0), ([80, 81], 1.0), ([90], 1.0)]
    draft = [TrainSample(prompt, c, [0.0] * len(c), r, "g" if i < 4 else "h") for i, (c, r) in enumerate(shapes)]
    behaviour = trainer.logprobs(draft)
    samples = [TrainSample(s.prompt_ids, s.completion_ids, b, s.reward, s.group) for s, b in zip(draft, behaviour)]
    stats = trainer.step(samples)
    assert stats.own is not None and stats.foreign is None and set(stats.sources) == {OWN}
    assert stats.own.mean_weight == 1.0 and stats.own.max_weight == 1.0 and stats.own.ess_fraction == 1.0
    assert stats.own.kept_fraction == 1.0 and stats.own.truncated_fraction == 0.0
    assert stats.own.tokens == 13 and stats.trained_samples == 4 and stats.kept_tokens == 10
    assert stats.clip_fraction == 0.0


def test_flat_samples_are_not_run_unless_their_statistics_are_asked_for():
    """A group with one reward carries no gradient: by default a step runs no forward of it;
    `flat_sample_stats` adds one forward of it, for the statistics only."""
    model = _tiny()
    forwards = []
    model.model.register_forward_hook(lambda module, args, output: forwards.append(output.last_hidden_state.shape[0]))
    prompt = [5]
    flat = _group(model, prompt, [[7, 8], [9]], [1.0, 1.0], "flat")
    mixed = _group(model, prompt, [[10, 11], [12]], [1.0, 0.0], "mixed")
    forwards.clear()  # the behaviour log-probs' own forwards

    stats = _trainer(model).step(flat)
    assert forwards == [] and stats.optimizer_steps == 0

    stats = _trainer(model).step(flat + mixed)
    assert forwards == [2] and stats.optimizer_steps == 1 and stats.own.tokens == 3 and stats.samples == 4

    forwards.clear()
    stats = _trainer(model, flat_sample_stats=True).step(flat + mixed)
    assert forwards == [2, 2] and stats.optimizer_steps == 1 and stats.own.tokens == 6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_samples_of_one_prompt_run_it_once_with_the_same_logprobs_and_update(device):
    """Four or more samples of one prompt in a micro batch run the prompt's forward once and their completions on
    its keys and values: the same log-probs, and the same update up to the order its gradients are summed in."""
    prompt, other = [1, 2, 3, 4, 5], [6, 7]
    completions = [[10, 11, 12], [13], [14, 15], [16, 17, 18, 19], [20, 21]]
    results = {}
    for share in (False, True):
        model = _tiny(device=device)
        tokens = []
        model.model.register_forward_hook(lambda module, args, output, runs=tokens: runs.append(output.last_hidden_state.shape[:2]))
        samples = _group(model, prompt, completions, [1.0, 0.0, 1.0, 0.0, 1.0]) + _group(model, other, [[30], [31, 32]], [1.0, 0.0], "h")
        trainer = _trainer(model, max_grad_norm=1e9, micro_batch_size=8, share_prompts=share)
        tokens.clear()
        logprobs = trainer.logprobs(samples)
        results[share] = (logprobs, list(tokens), trainer.step(samples), [p.detach().clone() for p in model.parameters()])
    (plain, plain_runs, plain_stats, plain_grads), (shared, shared_runs, shared_stats, shared_grads) = results[False], results[True]
    assert plain_runs == [(7, 9)]  # every sample in one micro batch, padded to the longest
    assert shared_runs == [(1, 5), (5, 4), (2, 4)]  # the prompt once, its 5 completions on it, the other group as before
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-12) for a, b in zip(plain, shared))
    assert shared_stats.kept_tokens == plain_stats.kept_tokens == 15 and shared_stats.trained_samples == 7
    assert shared_stats.loss == pytest.approx(plain_stats.loss, rel=1e-6)  # float32 sums over two micro batches instead of one
    # Equal up to float32 rounding (the model's RMSNorm and the head's log-prob kernel run in float32 and see other
    # sums); with both in float64 the backbone's gradients agree to 1e-16. A prompt without its gradient would be off by far more.
    assert all((a - b).abs().max() <= 1e-3 * a.abs().max() for a, b in zip(plain_grads, shared_grads))
    assert all(a.abs().max() > 0 for a in plain_grads)


def test_a_cpu_micro_batch_runs_eager_attention_only_where_its_probabilities_fit(monkeypatch):
    """Eager attention keeps every layer's probabilities for the backward: where it is allowed (measured faster), a
    CPU micro batch uses it below EAGER_ATTENTION_BYTES, the model's own SDPA above; the model is left on its own."""
    from hivespec.node.model import attention

    model = _tiny()
    assert model.config._attn_implementation == "sdpa"
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda module, args: seen.append(module.config._attn_implementation))
    samples = _group(model, [1, 2], [[10, 11], [20]], [1.0, 0.0])
    # 2 rows x 4 x 4 positions x 4 heads x 2 layers x 8 bytes
    needs = 2 * 4 * 4 * 4 * 2 * 8
    runs = {}
    for budget in (needs, needs - 1):
        monkeypatch.setattr(attention, "EAGER_ATTENTION_BYTES", budget)
        seen.clear()
        runs[budget] = _trainer(model, eager_attention=True).logprobs(samples)
        assert model.config._attn_implementation == "sdpa"
    assert seen == ["sdpa"]  # the last run, over budget
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-12) for a, b in zip(runs[needs], runs[needs - 1]))
    monkeypatch.setattr(attention, "EAGER_ATTENTION_BYTES", needs)
    seen.clear()
    _trainer(model, eager_attention=True).step(samples)
    assert seen == ["eager"] and model.config._attn_implementation == "sdpa"
    seen.clear()
    _trainer(model).step(samples)  # where eager did not measure faster: the model's own at any size
    assert seen == ["sdpa"]


def test_step_moves_probability_towards_rewarded_completion():
    model = _tiny()
    prompt, good, bad = [1, 2], [10, 11], [20, 21]
    trainer = _trainer(model, learning_rate=5e-2)
    before = sum(_logp(model, prompt, good)) - sum(_logp(model, prompt, bad))
    for _ in range(3):
        trainer.step(_group(model, prompt, [good, bad], [1.0, 0.0]))
    after = sum(_logp(model, prompt, good)) - sum(_logp(model, prompt, bad))
    assert after > before + 1.0
    assert trainer.version == 3
    assert all(p.grad is None for p in model.parameters())  # no gradient held between steps


@pytest.mark.parametrize("forged", [-20.0, 0.0])
@pytest.mark.parametrize("mask", ["none", "token", "sequence"])
def test_forged_foreign_logprobs_stay_bounded_and_counted_per_peer(forged, mask):
    model = _tiny()
    prompt = [3, 4]
    samples = _group(model, prompt, [[5, 6, 7], [8, 9, 10]], [1.0, 0.0], "p", "peer-a", lambda c: [forged] * len(c))
    samples += _group(model, prompt, [[11], [12, 13]], [0.0, 1.0], "own-group")
    stats = _trainer(model, importance=ImportanceSettings(mask=mask)).step(samples)
    peer = stats.sources["peer-a"]
    assert stats.foreign == peer and peer.tokens == 6 and stats.foreign_samples == 2
    assert peer.max_weight <= 2.0
    assert all(math.isfinite(v) for v in (peer.mean_weight, stats.loss, stats.grad_norm))
    if mask == "none" and forged == -20.0:  # pi/mu is astronomically large: every token is truncated at C
        assert peer.truncated_fraction == 1.0 and peer.max_weight == 2.0 and peer.kept_fraction == 1.0
    elif mask == "none":  # mu claims certainty: pi/mu = pi < 1, nothing truncated
        assert peer.truncated_fraction == 0.0 and peer.max_weight < 1.0
    else:  # the filters drop every token of the forgery, and say so
        assert peer.masked_fraction == 1.0 and peer.kept_fraction == 0.0 and peer.ess_fraction == 0.0
    assert stats.own is not None and stats.own.kept_fraction == 1.0
    assert stats.kept_tokens == 3 + (6 if peer.kept_fraction == 1.0 else 0)


def test_masked_tokens_leave_the_denominator():
    """A fully masked foreign group changes neither the gradient nor K: same update as without it."""
    prompt = [1, 2]
    grads = []
    for with_forgery in (False, True):
        model = _tiny()
        samples = _group(model, prompt, [[10, 11], [20]], [1.0, 0.0])
        if with_forgery:
            # Another prompt: four samples of one prompt would run it once, which sums their gradients in another order.
            samples += _group(model, [1, 3], [[30, 31], [32]], [1.0, 0.0], "q", "peer-b", lambda c: [-20.0] * len(c))
        trainer = _trainer(model, max_grad_norm=1e9, micro_batch_size=8)
        stats = trainer.step(samples)
        assert stats.kept_tokens == 3
        # Adam's first moment after one step is (1 - beta1) x the gradient (the gradient itself is freed after the step).
        grads.append([trainer.optimizer.state[p]["exp_avg"].clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-12, rtol=1e-9) for a, b in zip(*grads))


def test_per_peer_statistics_match_the_kernel():
    model = _tiny()
    prompt = [5]
    offsets = {"peer-a": 0.1, "peer-b": -0.6}
    samples = _group(model, prompt, [[7, 8], [9]], [1.0, 0.0])
    for peer, offset in offsets.items():
        samples += _group(
            model, prompt, [[10, 11, 12], [13]], [0.0, 1.0], peer, peer,
            lambda c, o=offset: [v + o for v in _logp(model, prompt, c)],
        )
    stats = _trainer(model, importance=ImportanceSettings(mask="token")).step(samples)
    assert set(stats.sources) == {OWN, "peer-a", "peer-b"}
    for peer, offset in offsets.items():
        # log pi - log mu = -offset on every token: ratio exp(-offset), inside [0.5, 2] for both
        expected = importance_weights(torch.full((4,), -offset), torch.zeros(4), torch.ones(4, dtype=torch.bool),
                                      clip=2.0, token_bounds=(0.5, 2.0)).stats()
        got = stats.sources[peer]
        assert got.tokens == 4 and got.mean_weight == pytest.approx(expected.mean_weight, abs=1e-6)
    assert stats.foreign.tokens == 8
    assert stats.sources["peer-b"].mean_weight == pytest.approx(math.exp(0.6), abs=1e-6)


def test_foreign_samples_with_a_gradient_are_counted_apart_from_those_taken():
    model = _tiny()
    prompt = [5]
    samples = _group(model, prompt, [[7, 8], [9]], [1.0, 0.0])
    samples += _group(model, prompt, [[10, 11], [12]], [1.0, 1.0], "flat", "peer-a")  # no spread: a forward, no gradient
    samples += _group(model, prompt, [[13], [14, 15]], [0.0, 1.0], "mixed", "peer-b")
    stats = _trainer(model).step(samples)
    assert (stats.foreign_samples, stats.foreign_trained_samples, stats.trained_samples) == (4, 2, 4)
    assert stats.source_samples == {OWN: 2, "peer-b": 2}  # what each source's samples gave the step (the credits' count)


def test_ppo_surrogate_by_hand():
    """Advantage +1, eps 0.2, weight 0.5: ratio 1.1 keeps the gradient w*A*r, ratio 1.5 is clipped (no gradient)."""
    trainer = _trainer(_tiny(), clip_epsilon=0.2)
    old = torch.zeros(3, dtype=torch.float32)
    logp = torch.tensor([math.log(1.1), math.log(1.5), math.log(0.5)], requires_grad=True)
    weights = importance_weights(old, torch.zeros(3), torch.ones(3, dtype=torch.bool), clip=2.0)
    weights = type(weights)(torch.full((3,), 0.5), weights.valid, weights.kept, weights.truncated, weights.vetoed)

    class Batch:
        advantage = torch.tensor([1.0, 1.0, -1.0])
        behaviour = torch.zeros(3)

    loss, clipped, _ = trainer._loss(logp, old, weights, Batch)
    loss.backward()
    # token 0: -0.5*1.1; token 1: clipped at 1.2 -> -0.5*1.2; token 2 (A<0, r=0.5 < 0.8): max(0.5, 0.8)*0.5 -> clipped
    assert float(loss.detach()) == pytest.approx(-0.5 * 1.1 - 0.5 * 1.2 + 0.5 * 0.8, abs=1e-6)
    assert clipped == 2
    assert logp.grad.tolist() == pytest.approx([-0.5 * 1.1, 0.0, 0.0], abs=1e-6)


def test_multi_epoch_reuse_clips_and_single_epoch_never_does():
    prompt = [1, 2]
    completions, rewards = [[10, 11, 12], [20, 21], [30]], [1.0, 0.0, 0.0]
    one = _trainer(_tiny(), learning_rate=5e-2).step(_group(_tiny(), prompt, completions, rewards))
    assert one.clip_fraction == 0.0
    model = _tiny()
    many = _trainer(model, learning_rate=5e-2, ppo_epochs=4, clip_epsilon=0.05).step(_group(model, prompt, completions, rewards))
    assert 0.0 < many.clip_fraction <= 1.0 and math.isfinite(many.loss)
    assert many.version == 1  # one policy version per step, however many epochs


def test_kl_to_behaviour_is_reported_and_bounded_for_forgeries():
    model = _tiny()
    prompt = [3, 4]
    samples = _group(model, prompt, [[5, 6, 7], [8]], [1.0, 0.0])
    samples += _group(model, prompt, [[9, 10], [11]], [1.0, 0.0], "p", "peer", lambda c: [0.0] * len(c))
    settings = ImportanceSettings(mask="none")  # let the forgery (mu = 1) into the loss
    stats = _trainer(model, kl_coef=1.0, importance=settings, max_grad_norm=1e9).step(samples)
    assert stats.kl is not None and 0.0 <= stats.kl <= math.log(2.0)  # k3 on log-ratios clamped to [log .5, log 2]
    assert math.isfinite(stats.grad_norm) and math.isfinite(stats.loss)
    assert _trainer(_tiny()).step(_group(_tiny(), prompt, [[5], [6]], [1.0, 0.0])).kl is None


def test_plain_mode_trains_without_weights_or_stats():
    model = _tiny()
    prompt = [1]
    samples = _group(model, prompt, [[2, 3], [4]], [1.0, 0.0], "p", "peer", lambda c: [-20.0] * len(c))
    stats = _trainer(model, importance=ImportanceSettings(enabled=False)).step(samples)
    assert stats.own is None and stats.foreign is None and stats.sources == {}
    assert stats.kept_tokens == 3 and stats.grad_norm > 0.0


@pytest.mark.parametrize("flat_sample_stats", [False, True])
def test_zero_advantage_step_changes_nothing(flat_sample_stats):
    model = _tiny()
    before = [p.detach().clone() for p in model.parameters()]
    prompt = [1]
    samples = [TrainSample(prompt, [2], _logp(model, prompt, [2]), 1.0, "g", OWN)] * 2
    stats = _trainer(model, flat_sample_stats=flat_sample_stats).step(samples)
    assert stats.trained_samples == 0 and stats.loss == 0.0 and stats.optimizer_steps == 0
    assert (stats.own.tokens == 2) if flat_sample_stats else (stats.own is None)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bad_settings_and_samples():
    with pytest.raises(ValueError, match="unbounded"):
        ImportanceSettings(clip=None, mask="sequence")
    with pytest.raises(ValueError, match="mask bounds"):
        ImportanceSettings(mask_low=1.5)
    with pytest.raises(ValueError, match="ppo_epochs"):
        _trainer(_tiny(), ppo_epochs=0)
    with pytest.raises(ValueError, match="pair one to one"):
        _trainer(_tiny()).step([TrainSample([1], [2, 3], [0.0], 1.0, "g"), TrainSample([1], [4], [0.0], 0.0, "g")])


def _head_transform_model(kind: str):
    """A tiny model of an architecture whose forward changes its head's logits (scaled, capped, or a head bias)."""
    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    torch.manual_seed(0)
    model = {
        "granite": lambda: GraniteForCausalLM(GraniteConfig(**small, logits_scaling=8.0)),
        "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**small, head_dim=8, final_logit_softcapping=2.0)),
        "cohere": lambda: CohereForCausalLM(CohereConfig(**small, logit_scale=0.0625)),
        "phi": lambda: PhiForCausalLM(PhiConfig(**{k: v for k, v in small.items() if k != "num_key_value_heads"})),
    }[kind]().double().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)  # logits of a trained model's size, where the transform matters
        if model.get_output_embeddings().bias is not None:
            torch.nn.init.normal_(model.get_output_embeddings().bias, std=1.0)
    return model


@pytest.mark.parametrize("kind", ["granite", "gemma2", "cohere", "phi"])
def test_own_samples_are_on_policy_on_models_that_transform_their_logits(kind):
    """The trainer's log-probs are those of the logits the engine sampled from: Granite divides its head's logits by
    logits_scaling, Cohere multiplies them by logit_scale, Gemma 2 caps them and Phi's head has a bias. The trainer had
    read hidden @ lm_head.weight alone, so own samples were off-policy by nats (all masked on the capped model)."""
    model = _head_transform_model(kind)
    requests = [GenerationRequest((1, 2, 3), seed=1, sample_index=i) for i in range(4)]
    drawn = TorchEngine(model).generate(requests, SamplingParams(temperature=0.8, max_new_tokens=8))
    samples = [TrainSample(list(s.prompt_ids), list(s.completion_ids), list(s.logprobs), float(i % 2), "g") for i, s in enumerate(drawn)]
    trainer = _trainer(model, temperature=0.8)
    for sample, logprobs in zip(samples, trainer.logprobs(samples)):
        assert logprobs == pytest.approx(sample.behaviour_logprobs, abs=1e-5)
    stats = trainer.step(samples)
    assert stats.own.kept_fraction == 1.0 and stats.own.mean_weight == pytest.approx(1.0, abs=1e-4)
    trainer.check_logits()  # a known transform: the node starts


class _ScaledLlama(LlamaForCausalLM):
    """A model whose forward changes its logits in a way the trainer has no entry for (as remote code may)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out


def test_a_model_whose_logits_the_trainer_cannot_reproduce_is_refused():
    """The trainer's table of logit transforms names the architectures it knows; a model that changes its logits
    otherwise (remote code, a later architecture) had started and trained every own sample as off-policy."""
    _trainer(_tiny(), temperature=0.7).check_logits()  # the model's own forward, reproduced
    scaled = _ScaledLlama(_tiny().config).double().eval()
    with pytest.raises(LogitsNotReproduced, match="model type 'llama'.*cannot|cannot.*model type 'llama'"):
        _trainer(scaled).check_logits()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_step_whose_gradient_is_not_finite_moves_no_weight(bad, caplog):
    """A NaN or inf gradient (an overflow under autocast; here one weight's gradient made so by a hook) was applied by
    AdamW: every weight NaN from then on, synced to the engine and published. The update is skipped, the weights kept,
    and the next step trains."""
    model = _tiny()
    before = [p.detach().clone() for p in model.parameters()]
    samples = _group(model, [1], [[2, 3], [4]], [1.0, 0.0])
    trainer = _trainer(model)
    handle = next(model.parameters()).register_hook(lambda grad: torch.full_like(grad, bad))
    stats = trainer.step(samples)
    handle.remove()
    assert stats.optimizer_steps == 0 and not math.isfinite(stats.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert "update skipped, the weights kept" in caplog.text
    assert trainer.step(samples).optimizer_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters()) and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
