"""Trainer -> engine sync: after each step the engine equals the trainer's cast bit for bit."""

import copy
import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hivespec.node.weights.sync import WeightSync
from hivespec.protocol.limits import DEFAULT_LIMITS
from hivespec.protocol.verdict import Reason
from hivespec.protocol.weights_hash import state_hash


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


def _bf16_sync(**kwargs) -> tuple[LlamaForCausalLM, WeightSync]:
    """A float32 trainer and the sync into a bf16 copy of it (the engine)."""
    trainer = _tiny()
    return trainer, WeightSync(trainer, _engine_params(copy.deepcopy(trainer).to(torch.bfloat16)), **kwargs)


@torch.no_grad()
def _shift(trainer: torch.nn.Module, amount: float) -> None:
    for p in trainer.parameters():
        p.add_(amount)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


@pytest.mark.parametrize("encode", [True, False], ids=["leader", "no-followers"])
@pytest.mark.parametrize("engine_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_engine_equals_trainer_cast_after_every_step(engine_dtype, encode):
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
        stats, chunks = sync.sync(version, encode=encode)
        assert sync.mismatched_elements() == 0
        assert sync.engine.hash == state_hash(sync.engine.state) and sync.version == version
        for name, tensor in _engine_params(engine).items():
            assert _bits_equal(tensor, trainer.get_parameter(name).detach().to(engine_dtype)), name
        assert stats.delta_bytes == sum(map(len, chunks)) and stats.chunks == len(chunks)
        assert bool(chunks) == encode
        assert 0 < stats.changed <= stats.elements
        dense = stats.dense_bytes
    assert dense == sum(p.numel() * p.element_size() for p in _engine_params(engine).values())


@pytest.mark.parametrize("engine_dtype", [torch.bfloat16, torch.float32])
def test_writing_locally_ends_where_the_wire_path_does(engine_dtype):
    """A node without followers skips the codec; its engine holds the same bits, hash and version."""
    trainer = _tiny()
    engines = [copy.deepcopy(trainer).to(engine_dtype) for _ in range(2)]
    wire, local = (WeightSync(trainer, _engine_params(engine)) for engine in engines)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16))
    for version in range(1, 4):
        optimizer.zero_grad()
        trainer(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        with torch.no_grad():  # one tensor barely moves: written position by position, not whole
            trainer.model.norm.weight.copy_(engines[1].model.norm.weight.float())
            trainer.model.norm.weight[::7] += 0.5
        wire_stats, _ = wire.sync(version)
        local_stats, _ = local.sync(version, encode=False)
        assert local.engine.hash == wire.engine.hash == state_hash(local.engine.state)
        assert local_stats.changed == wire_stats.changed and set(local_stats.tensors) == set(wire_stats.tensors)
        assert local.version == version and local_stats.delta_bytes == 0 and local_stats.chunks == 0
    for (name, a), b in zip(_engine_params(engines[0]).items(), _engine_params(engines[1]).values(), strict=True):
        assert _bits_equal(a, b), name


@pytest.mark.parametrize("told", [False, True], ids=["diffed", "told"])
@pytest.mark.parametrize("encode", [True, False], ids=["leader", "no-followers"])
def test_a_sync_after_a_step_that_updated_nothing_moves_nothing(encode, told):
    """A step whose samples had no advantage runs no optimizer step; its sync only advances the version,
    whether it finds that out by diffing or is told so (`trainer_moved=False`: no tensor is cast or compared)."""
    trainer, sync = _bf16_sync()
    _shift(trainer, 0.01)
    sync.sync(1, encode=encode)
    before = sync.engine.hash
    stats, chunks = sync.sync(2, encode=encode, trainer_moved=not told)
    assert stats.changed == 0 and stats.tensors == () and sync.version == 2
    assert sync.engine.hash == before == state_hash(sync.engine.state) and sync.mismatched_elements() == 0
    if encode:  # a follower at version 1 takes the empty delta to version 2
        follower = WeightSync(trainer, {name: t.clone() for name, t in sync.engine_params.items()})
        follower.engine.commit(1)
        verdict, delta = follower.engine.apply_chunks(chunks)
        assert verdict.ok and delta is not None and follower.version == 2 and follower.engine.hash == before


def test_the_round_check_looks_past_only_the_tensors_copied_whole():
    """A CPU engine takes each changed tensor as one copy of the trainer's cast (`SyncStats.copied`), equal to it by that
    copy: the round's check skips those and still reads every other tensor; a leader's decoded delta copies nothing."""
    trainer, sync = _bf16_sync()
    _shift(trainer, 0.01)
    with torch.no_grad():  # this one does not move
        trainer.model.norm.weight.copy_(sync.engine_params["model.norm.weight"].float())
    stats, _ = sync.sync(1, encode=False)
    assert stats.tensors and set(stats.copied) == set(stats.tensors) and "model.norm.weight" not in stats.tensors
    assert sync.mismatched_elements(skip=stats.copied) == 0
    sync.engine_params["model.norm.weight"].view(torch.int16)[3] ^= 1  # a fault where the sync wrote nothing
    assert sync.mismatched_elements(skip=stats.copied) == 1 == sync.mismatched_elements()
    leader_trainer, leader = _bf16_sync()
    _shift(leader_trainer, 0.01)
    stats, _ = leader.sync(1)
    assert stats.tensors and stats.copied == ()


@pytest.mark.parametrize("engine_dtype", [torch.bfloat16, torch.float16])
def test_the_cast_rounds_as_to_does_at_the_edges(engine_dtype):
    """The sync casts into a buffer it keeps (`copy_`); the engine's bits are `.to()`'s for infinities, NaN, subnormals,
    overflow and ties."""
    trainer = _tiny()
    sync = WeightSync(trainer, _engine_params(copy.deepcopy(trainer).to(engine_dtype)))
    edges = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e-40, -1e-45, 6e-8, 65504.0, 65520.0, 3e38,
                          1 + 2**-8, 1 + 3 * 2**-9, 1 + 2**-11, 0.0, -0.0])
    with torch.no_grad():
        trainer.model.norm.weight[: len(edges)] = edges
    sync.sync(1, encode=False)
    for name, tensor in sync.engine_params.items():
        assert _bits_equal(tensor, trainer.get_parameter(name).detach().to(engine_dtype)), name


def test_an_empty_delta_that_promises_other_weights_is_refused():
    _, sync = _bf16_sync()
    delta = sync.build_delta(1)
    assert delta.tensors == () and delta.result_hash == delta.base_hash == sync.engine.hash
    forged = dataclasses.replace(delta, result_hash=b"\x00" * 32)
    verdict, _ = sync.engine.apply_chunks(sync.encode(forged))
    assert verdict.reason is Reason.RESULT_MISMATCH and sync.version == 0
    assert sync.engine.hash == state_hash(sync.engine.state)


def test_small_updates_give_a_sparse_bf16_delta():
    trainer, sync = _bf16_sync()
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 1e-6)  # far under half a bf16 ulp for most weights
    stats, _ = sync.sync(1)
    assert stats.density < 0.05
    assert stats.delta_bytes < stats.dense_bytes / 10
    assert sync.mismatched_elements() == 0


def test_a_delta_for_another_base_is_refused():
    trainer, sync = _bf16_sync()
    with torch.no_grad():
        next(trainer.parameters()).add_(1.0)
    _, chunks = sync.sync(1)
    before = sync.engine.hash
    with pytest.raises(ValueError, match="base_mismatch"):
        sync.apply(chunks)  # made against version 0; the engine is at 1 now
    assert sync.engine.hash == before == state_hash(sync.engine.state)


def test_a_delta_whose_result_hash_lies_is_rolled_back():
    trainer, sync = _bf16_sync()
    _shift(trainer, 0.01)
    delta = sync.build_delta(1)
    forged = dataclasses.replace(delta, result_hash=b"\x00" * 32)
    before = {name: t.clone() for name, t in sync.engine_params.items()}
    verdict, _ = sync.engine.apply_chunks(sync.encode(forged))
    assert verdict.reason is Reason.RESULT_MISMATCH and sync.version == 0
    for name, tensor in sync.engine_params.items():
        assert _bits_equal(tensor, before[name]), name
    assert sync.engine.hash == state_hash(sync.engine.state)


def test_sync_through_many_small_chunks():
    trainer, sync = _bf16_sync(limits=dataclasses.replace(DEFAULT_LIMITS, max_delta_chunk_bytes=2048))
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    stats, chunks = sync.sync(1)
    assert stats.chunks == len(chunks) > 3 and max(map(len, chunks)) <= 2048
    assert sync.mismatched_elements() == 0
