"""Speculative decoding is lossless: on a float64 tiny model it equals plain decoding exactly.

Same tokens, same behaviour log-probs (to float64 rounding of different forward shapes), same
finish reasons, across greedy / temperature / top-p, batch sizes, budgets, stop tokens, and
drafters that are right (fed the plain output itself), partly right and wrong.
"""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hivespec.node.model.engine import (
    GenerationRequest,
    SamplingParams,
    SpeculationStats,
    TorchEngine,
)
from hivespec.node.model.loader import load_model
from hivespec.node.speculation.curve import VerifyCostCurve
from hivespec.node.speculation.drafter import SuffixDrafter
from hivespec.node.speculation.policy import LengthAwarePolicy, UniformPolicy

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", dtype=torch.float64)


def _requests(count, seed, vocab):
    rng = random.Random(seed)
    # Two prompts shared by several samples each, as in GRPO groups.
    prompts = [tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 9))) for _ in range(2)]
    return [GenerationRequest(prompts[i % 2], seed=seed, sample_index=i) for i in range(count)]


def _fed_drafter(plain, kind, seed, vocab):
    drafter = SuffixDrafter(min_prob=0.0 if kind == "wrong" else 0.1)
    rng = random.Random(seed)
    for sample in plain:
        tokens = list(sample.completion_ids)
        if kind == "partial":
            for _ in range(max(1, len(tokens) // 6)):
                tokens[rng.randrange(len(tokens))] = rng.randrange(vocab)
        elif kind == "wrong":
            tokens = [rng.randrange(vocab) for _ in tokens]
        drafter.observe(sample.prompt_ids, tokens)
    return drafter


def _assert_same(plain, spec):
    for a, b in zip(plain, spec, strict=True):
        assert b.completion_ids == a.completion_ids
        assert b.finish_reason == a.finish_reason
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-9)


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sampling=st.sampled_from([(0.0, 1.0), (1.0, 1.0), (0.8, 0.9), (1.3, 0.5)]),
    count=st.integers(1, 6),
    max_batch=st.integers(1, 4),
    budget=st.integers(1, 10),
    kind=st.sampled_from(["right", "partial", "wrong"]),
    max_new_tokens=st.integers(1, 32),
    with_stop=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_speculative_equals_plain(model, sampling, count, max_batch, budget, kind, max_new_tokens, with_stop, seed):
    vocab = model.config.vocab_size
    temperature, top_p = sampling
    requests = _requests(count, seed, vocab)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    plain = TorchEngine(model, max_batch_size=max_batch).generate(requests, params)
    if with_stop:
        # A token the first sample draws midway: rows stop on it inside accepted runs too.
        first = plain[0].completion_ids
        params = SamplingParams(temperature, top_p, max_new_tokens, stop_token_ids=(first[len(first) // 2],))
        plain = TorchEngine(model, max_batch_size=max_batch).generate(requests, params)
    drafter = _fed_drafter(plain, kind, seed, vocab)
    stats = SpeculationStats()
    engine = TorchEngine(model, max_batch_size=max_batch, drafter=drafter, policy=UniformPolicy(budget))
    spec = engine.generate(requests, params, stats=stats)
    _assert_same(plain, spec)
    if kind == "right" and max_new_tokens > 4 and temperature > 0:
        assert stats.accepted > 0 and stats.tokens_per_forward > 1.0


def test_right_drafter_accepts_almost_everything_and_counts_add_up(model):
    vocab = model.config.vocab_size
    requests = _requests(4, 3, vocab)
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    plain_stats = SpeculationStats()
    plain = TorchEngine(model).generate(requests, params, stats=plain_stats)
    assert plain_stats.tokens_per_forward == 1.0
    drafter = _fed_drafter(plain, "right", 0, vocab)
    stats = SpeculationStats()
    spec = TorchEngine(model, drafter=drafter, policy=UniformPolicy(8)).generate(requests, params, stats=stats)
    _assert_same(plain, spec)
    assert stats.tokens == sum(len(s.completion_ids) for s in plain)
    assert stats.accepted == sum(s.accepted for s in spec) and stats.drafted == sum(s.drafted for s in spec)
    assert stats.acceptance_rate > 0.9
    assert stats.tokens_per_forward > 4.0
    assert stats.batch_forwards < plain_stats.batch_forwards / 3


def _assert_holes_compact_losslessly(model) -> None:
    """Row 0's drafter is always right, row 1's always wrong: row 1 leaves holes every step, compacted away."""
    requests = [GenerationRequest((5, 6, 7), seed=1, sample_index=0), GenerationRequest((9, 8), seed=1, sample_index=1)]
    params = SamplingParams(temperature=1.0, max_new_tokens=60)
    plain = TorchEngine(model).generate(requests, params)
    drafter = SuffixDrafter()
    drafter.observe(plain[0].prompt_ids, plain[0].completion_ids)
    rng = random.Random(0)
    drafter.observe(plain[1].prompt_ids, [rng.randrange(model.config.vocab_size) for _ in range(60)])
    stats = SpeculationStats()
    spec = TorchEngine(model, drafter=drafter, policy=UniformPolicy(8)).generate(requests, params, stats=stats)
    _assert_same(plain, spec)
    assert stats.compactions >= 1


def test_holes_are_compacted_without_changing_the_output(model):
    _assert_holes_compact_losslessly(model)


def test_speculative_false_and_missing_drafter(model):
    requests = _requests(2, 1, model.config.vocab_size)
    params = SamplingParams(max_new_tokens=6)
    drafter = SuffixDrafter()
    engine = TorchEngine(model, drafter=drafter, policy=UniformPolicy(4))
    stats = SpeculationStats()
    assert engine.generate(requests, params, speculative=False, stats=stats) == TorchEngine(model).generate(requests, params)
    assert stats.drafted == 0
    with pytest.raises(ValueError, match="needs an engine built with a drafter"):
        TorchEngine(model).generate(requests, params, speculative=True)
    with pytest.raises(ValueError, match="both a drafter and a policy"):
        TorchEngine(model, drafter=drafter)



def test_padding_slots_stay_within_learned_positions():
    """A verify forward padded past the drafts (a cheaper wider forward) near the model's last position.

    GPT-2 looks every position id up in a learned table of n_positions rows: a padding slot placed
    past the last one raised IndexError, though plain decoding of the same request fits.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=50, n_positions=24, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
        gpt2 = GPT2LMHeadModel(config).eval().double()
    requests = [GenerationRequest((1, 2, 3, 4), seed=5, sample_index=0)]
    params = SamplingParams(temperature=1.0, max_new_tokens=20)  # 4 + 20 = every one of the 24 positions
    plain = TorchEngine(gpt2).generate(requests, params)
    drafter = SuffixDrafter()
    for _ in range(3):
        drafter.observe(requests[0].prompt_ids, plain[0].completion_ids)
    # A 9-token forward is priced cheaper than a 2- or 3-token one: every step pads to 9.
    curve = VerifyCostCurve((1,), (1, 2, 3, 5, 9), ((1.0, 3.0, 3.0, 3.0, 1.05),), (1.0,))
    stats = SpeculationStats()
    spec = TorchEngine(gpt2, drafter=drafter, policy=LengthAwarePolicy(curve, drafter, max_budget=2)).generate(
        requests, params, stats=stats
    )
    _assert_same(plain, spec)
    assert stats.accepted > 0


def test_a_sliding_window_model_decodes_plainly_with_a_drafter(model):
    """Mistral-style sliding-window layers forget the keys a verify step's crop needs.

    A drafter on such a model (Gemma 3, Mistral v0.1, Qwen2 with use_sliding_window) had raised
    RuntimeError from the cache's crop once a completion outgrew the window; the engine now
    decodes it plainly, and refuses an explicit speculative=True.
    """
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=6, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mistral = MistralForCausalLM(config).eval().double()
    requests = [GenerationRequest((1, 2, 3), seed=4, sample_index=i) for i in range(2)]
    params = SamplingParams(temperature=1.0, max_new_tokens=30)
    plain = TorchEngine(mistral).generate(requests, params)
    drafter = SuffixDrafter()
    for sample in plain:
        drafter.observe(sample.prompt_ids, sample.completion_ids)
    engine = TorchEngine(mistral, drafter=drafter, policy=UniformPolicy(6))
    stats = SpeculationStats()
    assert engine.generate(requests, params, stats=stats) == plain
    assert stats.drafted == 0
    assert not engine.can_speculate and TorchEngine(model).can_speculate
    with pytest.raises(ValueError, match="sliding-window"):
        engine.generate(requests, params, speculative=True)


def test_holes_are_compacted_where_keys_and_values_differ_in_head_size():
    """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3) caches keys and values of different head sizes.

    The compaction gathered the values with the keys' shape and raised RuntimeError at the first one.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=60, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=4,
        max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mla = DeepseekV3ForCausalLM(config).eval().double()
    _assert_holes_compact_losslessly(mla)

@pytest.mark.slow
@pytest.mark.real_model
def test_embedded_model_fp32_speculative_matches_plain():
    """fp32 on the real model: forward shapes differ (1 vs K+1 tokens), so equality is up to rounding.

    The drafter is fed another seed's completions of the same prompts (as after an RL epoch);
    every sequence is expected to come out identical (the bench measures the fraction at scale).
    """
    from hivespec.node.model.loader import load_tokenizer

    tokenizer = load_tokenizer()
    model = load_model(dtype=torch.float32)
    questions = ["What is 17 + 25?", "Count the letters in 'banana'.", "Name three primary colors."]
    prompts = [
        tuple(tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False))["input_ids"])
        for q in questions
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=32, stop_token_ids=(tokenizer.eos_token_id,))
    plain_engine = TorchEngine(model, max_batch_size=2)
    drafter = SuffixDrafter()
    warm = [GenerationRequest(p, seed=11, sample_index=i) for i, p in enumerate(prompts)]
    for sample in plain_engine.generate(warm + [GenerationRequest(p, seed=11, sample_index=0) for p in prompts], params):
        drafter.observe(sample.prompt_ids, sample.completion_ids)
    requests = [GenerationRequest(p, seed=12, sample_index=i) for i, p in enumerate(prompts)]
    plain = plain_engine.generate(requests, params)
    stats = SpeculationStats()
    spec = TorchEngine(model, max_batch_size=2, drafter=drafter, policy=UniformPolicy(8)).generate(requests, params, stats=stats)
    assert stats.drafted > 0
    for a, b in zip(plain, spec, strict=True):
        assert b.completion_ids == a.completion_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
