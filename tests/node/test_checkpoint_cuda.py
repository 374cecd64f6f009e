"""Checkpoint RNG state on CUDA: saved per device and restored bit for bit (skipped without CUDA)."""

import pytest
import torch

from hivespec.node.training.checkpoint import restore_rng, rng_tensors


def test_a_cpu_machine_saves_no_cuda_rng_and_restores_what_it_saved():
    tensors, meta = rng_tensors()
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; test_cuda_rng_round_trips covers it")
    assert meta["cuda_devices"] == 0 and not any(name.startswith("torch_cuda") for name in tensors)
    expected = torch.rand(4)
    restore_rng(tensors, meta)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.cuda
def test_cuda_rng_round_trips():
    torch.cuda.manual_seed_all(123)
    tensors, meta = rng_tensors()
    assert meta["cuda_devices"] == torch.cuda.device_count()
    expected = torch.rand(8, device="cuda")
    torch.rand(100, device="cuda")  # move the generator on
    restore_rng(tensors, meta)
    assert torch.equal(torch.rand(8, device="cuda"), expected)
