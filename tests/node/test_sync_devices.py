"""The sync path as a GPU runs it, checked on every machine.

Under a strict `HostTransferGuard` every tensor counts as device data: a `.numpy()`, `.tolist()`
or `.item()` on it outside `to_host` raises (the bug that broke CUDA sync: `tensor_bits` called
`.numpy()` on engine tensors), and `to_host` / `to_device` really copy, so the engine's tensors
are written only through the device push, as on a GPU. Tests needing CUDA are skipped with the
command to run them there.
"""

import copy
import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hivespec.kernels.host_transfer import HostTransferError, HostTransferGuard
from hivespec.node.model.engine import unique_parameters
from hivespec.node.weights.sync import EngineWeights, WeightSync
from hivespec.protocol.verdict import Reason
from hivespec.protocol.weights_hash import state_hash


def _tiny(device="cpu") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(device)


def _step(trainer, optimizer, ids):
    optimizer.zero_grad()
    trainer(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def _cast_equal(engine_params, trainer, dtype) -> bool:
    width = {2: torch.int16, 4: torch.int32}
    return all(
        torch.equal(t.view(width[t.element_size()]), trainer.get_parameter(n).detach().to(dtype).view(width[t.element_size()]))
        for n, t in engine_params.items()
    )


def _run_syncs(device: str, strict: bool, engine_dtype=torch.bfloat16, encode: bool = True):
    trainer = _tiny(device)
    engine = copy.deepcopy(trainer).to(engine_dtype)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), device=device)
    with HostTransferGuard(strict=strict) as guard:
        sync = WeightSync(trainer, unique_parameters(engine))
    assert guard.transfers == 1  # the engine's bits, read once into the host mirror
    for version in range(1, 4):
        _step(trainer, optimizer, ids)  # transformers' own forward is not ours to guard
        with HostTransferGuard(strict=strict) as guard:
            stats, _ = sync.sync(version, encode=encode)
            if encode:
                assert guard.transfers == 2, "one transfer down (the delta), one up (the verified write)"
            else:  # counts down, changes down (written on the device where they were found; dense tensors copied there)
                assert guard.transfers <= 2
            assert sync.mismatched_elements() == 0 and sync.engine.mirror_mismatches() == 0
            assert sync.engine.hash == state_hash(sync.engine.state)
            # A tensor copied whole is equal by that copy; the round's check reads the rest (a leader copies none).
            assert set(stats.copied) <= set(stats.tensors) and not (encode and stats.copied)
            assert sync.mismatched_elements(skip=stats.copied) == 0
    assert _cast_equal(unique_parameters(engine), trainer, engine_dtype)
    return sync


@pytest.mark.parametrize("encode", [True, False], ids=["leader", "no-followers"])
@pytest.mark.parametrize("engine_dtype", [torch.bfloat16, torch.float32])
def test_sync_runs_as_on_a_gpu_one_transfer_each_way_per_step(engine_dtype, encode):
    _run_syncs("cpu", strict=True, engine_dtype=engine_dtype, encode=encode)


def test_the_old_numpy_view_of_engine_tensors_is_caught_on_cpu():
    # What node/weights/sync.py did before (tensor.numpy() on the engine's tensors): fine on a CPU, fails on CUDA.
    params = unique_parameters(_tiny().to(torch.bfloat16))
    with HostTransferGuard(), pytest.raises(HostTransferError, match="numpy"):
        next(iter(params.values())).view(torch.int16).numpy()


def test_a_rejected_delta_never_reaches_the_device():
    trainer = _tiny()
    engine = copy.deepcopy(trainer).to(torch.bfloat16)
    with HostTransferGuard() as guard:
        sync = WeightSync(trainer, unique_parameters(engine))
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.01)
        forged = dataclasses.replace(sync.build_delta(1), result_hash=b"\x00" * 32)
        chunks = sync.encode(forged)
        before = {n: t.clone() for n, t in sync.engine_params.items()}
        pushed = guard.transfers
        verdict, _ = sync.engine.apply_chunks(chunks)
        assert verdict.reason is Reason.RESULT_MISMATCH and guard.transfers == pushed
        assert sync.engine.hash == state_hash(sync.engine.state) and sync.engine.mirror_mismatches() == 0
    for name, tensor in sync.engine_params.items():
        assert torch.equal(tensor.view(torch.int16), before[name].view(torch.int16)), name


def test_a_follower_applies_and_restores_through_the_device_path():
    leader_model = _tiny()
    follower_model = copy.deepcopy(leader_model).to(torch.bfloat16)
    leader = WeightSync(leader_model, unique_parameters(copy.deepcopy(leader_model).to(torch.bfloat16)))
    with torch.no_grad():
        for p in leader_model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    _, chunks = leader.sync(1)
    with HostTransferGuard():
        follower = EngineWeights(unique_parameters(follower_model))
        base_bits, base_hash = follower.snapshot_bits(), follower.hash
        verdict, _ = follower.apply_chunks(chunks)
        assert verdict.ok and follower.hash == leader.engine.hash and follower.mirror_mismatches() == 0
        follower.restore(base_bits, version=0, digest=base_hash)
        assert follower.mirror_mismatches() == 0 and state_hash(follower.state) == base_hash
    assert _cast_equal(unique_parameters(follower_model), _tiny(), torch.bfloat16)


def test_a_resume_reset_rereads_the_engine_in_one_transfer():
    trainer = _tiny()
    engine = copy.deepcopy(trainer).to(torch.bfloat16)
    sync = WeightSync(trainer, unique_parameters(engine))
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.5)
    with HostTransferGuard() as guard:
        sync.reset(7)
        assert guard.transfers == 1
        assert sync.version == 7 and sync.mismatched_elements() == 0 and sync.engine.mirror_mismatches() == 0


def test_shapes_and_dtypes_of_the_cast_path_hold_on_the_meta_device():
    # No data on `meta`: what runs there is the shape/dtype plumbing of the trainer -> engine cast.
    trainer = _tiny().to("meta")
    engine_params = {n: torch.empty(t.shape, dtype=torch.bfloat16, device="meta") for n, t in unique_parameters(trainer).items()}
    sync = object.__new__(WeightSync)
    sync.trainer_params = dict(trainer.named_parameters())
    sync.engine = type("Engine", (), {"params": engine_params})()
    for group in sync._targets():
        for name, engine_tensor, target in group:
            assert target.device.type == "meta" and target.dtype == torch.bfloat16 and target.shape == engine_tensor.shape, name


@pytest.mark.cuda
@pytest.mark.parametrize("engine_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("encode", [True, False], ids=["leader", "no-followers"])
def test_sync_on_cuda(engine_dtype, encode):
    sync = _run_syncs("cuda", strict=False, engine_dtype=engine_dtype, encode=encode)
    assert all(t.device.type == "cuda" for t in sync.engine_params.values())
