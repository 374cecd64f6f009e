"""Trainer -> engine sync: after each step the engine equals the trainer's cast bit for bit."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hivespec.node.sync import WeightSync


def _tiny(dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).to(dtype)


def _engine_params(model):
    seen, params = set(), {}
    for name, p in model.named_parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            params[name] = p.data
    return params


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


@pytest.mark.parametrize("engine_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_engine_equals_trainer_cast_after_every_step(engine_dtype):
    trainer = _tiny()
    engine = copy.deepcopy(trainer).to(engine_dtype)
    sync = WeightSync(trainer, _engine_params(engine))
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16))
    dense = None
    for version in range(1, 4):
        optimizer.zero_grad()
        trainer(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        stats, wire = sync.sync(version)
        assert sync.mismatched_elements() == 0
        for name, tensor in _engine_params(engine).items():
            assert _bits_equal(tensor, trainer.get_parameter(name).detach().to(engine_dtype)), name
        assert stats.delta_bytes == len(wire)
        assert 0 < stats.changed <= stats.elements
        dense = stats.dense_bytes
    assert dense == sum(p.numel() * p.element_size() for p in _engine_params(engine).values())


def test_small_updates_give_a_sparse_bf16_delta():
    trainer = _tiny()
    engine = copy.deepcopy(trainer).to(torch.bfloat16)
    sync = WeightSync(trainer, _engine_params(engine))
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 1e-6)  # far under half a bf16 ulp for most weights
    stats, _ = sync.sync(1)
    assert stats.density < 0.05
    assert stats.delta_bytes < stats.dense_bytes / 10
    assert sync.mismatched_elements() == 0


def test_a_delta_for_another_base_is_refused():
    trainer = _tiny()
    engine = copy.deepcopy(trainer).to(torch.bfloat16)
    sync = WeightSync(trainer, _engine_params(engine))
    with torch.no_grad():
        next(trainer.parameters()).add_(1.0)
    _, wire = sync.sync(1)
    with pytest.raises(ValueError, match="applies to version 0, engine is at 1"):
        sync.apply(wire)
