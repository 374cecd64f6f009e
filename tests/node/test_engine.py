"""TorchEngine on a tiny random float64 Llama: keyed determinism, batch invariance, log-probs, stops."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hivespec.kernels.sampling import nucleus_mask
from hivespec.node.model.engine import GenerationRequest, RolloutEngine, SamplingParams, TorchEngine

torch.set_num_threads(1)

VOCAB = 256


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,  # peakier than the default so sampling has structure to get wrong
        tie_word_embeddings=True,
    )
    # float64: the forward pass rounds the same at any batch shape, so comparisons can be exact.
    return LlamaForCausalLM(config).to(torch.float64).eval()


@pytest.fixture(scope="module")
def engine(model):
    return TorchEngine(model, max_batch_size=16)


def _requests(seed=7, lengths=(5, 1, 9, 3, 12)):
    gen = torch.Generator().manual_seed(seed)
    return [
        GenerationRequest(tuple(torch.randint(0, VOCAB, (n,), generator=gen).tolist()), seed=seed, sample_index=i)
        for i, n in enumerate(lengths)
    ]


@torch.inference_mode()
def _full_logits(model, prompt, completion):
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def test_engine_satisfies_the_protocol(engine):
    assert isinstance(engine, TorchEngine)
    protocol_engine: RolloutEngine = engine
    assert callable(protocol_engine.generate)


def test_same_seed_same_output_and_seed_matters(engine):
    params = SamplingParams(max_new_tokens=12)
    first = engine.generate(_requests(), params)
    assert engine.generate(_requests(), params) == first
    reseeded = [GenerationRequest(r.prompt_ids, seed=8, sample_index=r.sample_index) for r in _requests()]
    other = engine.generate(reseeded, params)
    assert [s.completion_ids for s in other] != [s.completion_ids for s in first]
    assert [s.prompt_ids for s in first] == [list(r.prompt_ids) for r in _requests()]


def test_each_request_alone_equals_it_in_a_batch(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=10)
    requests = _requests()
    batched = engine.generate(requests, params)
    chunked = TorchEngine(engine._model, max_batch_size=2).generate(requests, params)
    for request, together, in_pairs in zip(requests, batched, chunked, strict=True):
        (alone,) = engine.generate([request], params)
        for sample in (together, in_pairs):
            assert sample.completion_ids == alone.completion_ids
            assert sample.logprobs == pytest.approx(alone.logprobs, abs=1e-9)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_prompt_shared_by_several_samples_is_read_once(model, device):
    """A GRPO group's samples share a prompt: the prefill runs each distinct prompt once, and every sample comes out
    as it does alone."""
    model = copy.deepcopy(model).to(device)
    engine = TorchEngine(model, max_batch_size=16)
    prompts = [tuple(r.prompt_ids) for r in _requests(lengths=(6, 3))]
    requests = [GenerationRequest(prompts[i % 2], seed=5, sample_index=i) for i in range(6)]
    rows_run = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: rows_run.append(kwargs["input_ids"].shape), with_kwargs=True)
    try:
        together = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=8))
    finally:
        hook.remove()
    assert rows_run[0] == (2, 6)  # the prefill: the 2 prompts, left-padded to the longer
    assert all(shape[0] == 6 for shape in rows_run[1:])  # then every sample decodes
    for request, sample in zip(requests, together, strict=True):
        (alone,) = engine.generate([request], SamplingParams(temperature=1.0, max_new_tokens=8))
        assert sample.completion_ids == alone.completion_ids
        assert sample.logprobs == pytest.approx(alone.logprobs, abs=1e-9)
    assert len({tuple(s.completion_ids) for s in together}) > 2  # the samples of a prompt differ: each has its own key


def test_behaviour_logprobs_match_a_full_forward(engine, model):
    temperature = 0.7
    samples = engine.generate(_requests(), SamplingParams(temperature=temperature, max_new_tokens=16))
    for sample in samples:
        assert sample.finish_reason == "length" and len(sample.completion_ids) == 16
        logits = _full_logits(model, sample.prompt_ids, sample.completion_ids)
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(sample.completion_ids)[:, None])
        assert sample.logprobs == pytest.approx(expected.squeeze(-1).tolist(), abs=1e-5)


def test_stop_token_ends_the_sequence_and_is_kept(engine):
    params = SamplingParams(max_new_tokens=20)
    (free,) = engine.generate(_requests()[:1], params)
    stop = free.completion_ids[4]
    first = free.completion_ids.index(stop)
    calls = []
    (stopped,) = engine.generate(
        _requests()[:1], SamplingParams(max_new_tokens=20, stop_token_ids=(stop, VOCAB + 5)), on_tokens=calls.append
    )
    assert stopped.finish_reason == "stop"
    assert stopped.completion_ids == free.completion_ids[: first + 1]
    assert stopped.logprobs == free.logprobs[: first + 1]
    assert sum(calls) == first + 1


def test_mixed_finishes_in_one_batch(engine):
    requests = _requests()
    free = engine.generate(requests, SamplingParams(max_new_tokens=8))
    stop = free[2].completion_ids[1]
    mixed = engine.generate(requests, SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)))
    for before, after in zip(free, mixed, strict=True):
        if stop in before.completion_ids:
            cut = before.completion_ids.index(stop) + 1
            assert (after.finish_reason, after.completion_ids) == ("stop", before.completion_ids[:cut])
        else:
            assert (after.finish_reason, after.completion_ids) == ("length", before.completion_ids)


def test_greedy_equals_argmax_decoding(engine, model):
    samples = engine.generate(_requests(), SamplingParams(temperature=0.0, max_new_tokens=8))
    for sample in samples:
        ids = list(sample.prompt_ids)
        with torch.inference_mode():
            for _ in range(8):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert sample.completion_ids == ids[len(sample.prompt_ids) :]
        assert sample.logprobs == [0.0] * 8


def test_top_p_never_samples_outside_the_nucleus(engine, model):
    top_p = 0.5
    requests = [
        GenerationRequest(r.prompt_ids, seed=seed, sample_index=r.sample_index) for seed in range(3) for r in _requests()
    ]
    samples = engine.generate(requests, SamplingParams(top_p=top_p, max_new_tokens=12))
    for sample in samples:
        probs = torch.softmax(_full_logits(model, sample.prompt_ids, sample.completion_ids), -1)
        outside = nucleus_mask(probs, top_p)
        targets = torch.tensor(sample.completion_ids)[:, None]
        assert not outside.gather(-1, targets).any()
        kept = probs.masked_fill(outside, 0.0)
        expected = (kept.gather(-1, targets).squeeze(-1) / kept.sum(-1)).log()
        assert sample.logprobs == pytest.approx(expected.tolist(), abs=1e-5)


def test_sync_parameters_dedupes_tied_weights_and_writes_through(model):
    engine = TorchEngine(model)
    tensors = engine.sync_parameters()
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors
    assert len(tensors) == len(list(model.parameters()))
    assert all(not t.requires_grad for t in tensors.values())
    norm = tensors["model.norm.weight"]
    saved = norm.clone()
    with torch.no_grad():
        norm.mul_(2.0)
    try:
        assert torch.equal(model.model.norm.weight.detach(), saved * 2.0)
    finally:
        with torch.no_grad():
            norm.copy_(saved)


def test_bad_requests_raise(engine):
    with pytest.raises(ValueError, match="at least one prompt token"):
        GenerationRequest((), seed=0, sample_index=0)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([GenerationRequest((1, VOCAB), seed=0, sample_index=0)], SamplingParams())
    with pytest.raises(ValueError, match="lower max_new_tokens"):
        engine.generate([GenerationRequest((1, 2), seed=0, sample_index=0)], SamplingParams(max_new_tokens=200))
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert engine.generate([], SamplingParams()) == []


def test_training_mode_is_refused(model):
    model.train()
    try:
        with pytest.raises(ValueError, match="model.eval"):
            TorchEngine(model).generate(_requests()[:1], SamplingParams(max_new_tokens=2))
    finally:
        model.eval()
