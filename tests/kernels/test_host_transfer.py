"""Batched host transfers and the guard that holds hot paths to them (runs on every machine)."""

import numpy as np
import pytest
import torch

from hivespec.kernels.delta import mismatch_counts
from hivespec.kernels.host_transfer import HostTransferError, HostTransferGuard, readable_on_host, to_device, to_host


def _mixed():
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        torch.arange(7, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.randn(11, generator=generator),
        torch.empty(0, dtype=torch.int16),
        torch.tensor(2.5, dtype=torch.float64),
        torch.randn(2, 2, generator=generator).to(torch.float16),
    ]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


def test_a_strict_guard_copies_like_a_bus_and_keeps_every_bit_and_shape():
    tensors = _mixed()
    with HostTransferGuard() as guard:
        host = to_host(tensors)
        back = to_device(host, "cpu")
    assert guard.transfers == 2
    for original, h, b in zip(tensors, host, back, strict=True):
        assert _same(original, h) and _same(original, b)
        if original.numel():
            assert h.data_ptr() != original.data_ptr() and b.data_ptr() != h.data_ptr()


def test_without_a_guard_cpu_tensors_pass_through_untouched():
    tensors = _mixed()
    assert all(a is b for a, b in zip(tensors, to_host(tensors), strict=True))
    assert all(a is b for a, b in zip(tensors, to_device(tensors, "cpu"), strict=True))


def test_buckets_split_one_transfer_into_bounded_copies():
    tensors = [torch.full((256,), i, dtype=torch.int32) for i in range(6)]  # 1 KiB each
    with HostTransferGuard() as guard:
        host = to_host(tensors, bucket_bytes=2048)
    assert guard.transfers == 3 and guard.transferred_bytes == 6 * 1024
    assert all(_same(a, b) for a, b in zip(tensors, host, strict=True))


@pytest.mark.parametrize("read", [
    lambda t: t.numpy(), lambda t: t.tolist(), lambda t: t[0].item(), lambda t: int(t[0]), lambda t: float(t[0]),
    lambda t: bool(t[0]), lambda t: np.asarray(t), lambda t: t.cpu(),
], ids=["numpy", "tolist", "item", "int", "float", "bool", "asarray", "cpu"])
def test_a_strict_guard_refuses_every_python_read_of_device_data(read):
    tensor = torch.arange(4, dtype=torch.float32) + 1
    with HostTransferGuard(), pytest.raises(HostTransferError, match="to_host"):
        read(tensor)


def test_what_to_host_returned_may_be_read_including_its_views():
    tensor = torch.arange(6, dtype=torch.int64)
    with HostTransferGuard():
        (host,) = to_host([tensor * 2])
        assert host.tolist() == [0, 2, 4, 6, 8, 10]
        assert int(host[3]) == 6 and host[1:].reshape(5).numpy().sum() == 30
        with pytest.raises(HostTransferError):
            tensor.tolist()  # the input stays device data


def test_a_lenient_guard_watches_only_non_cpu_tensors():
    with HostTransferGuard(strict=False) as guard:
        assert torch.arange(3).tolist() == [0, 1, 2]
        with pytest.raises(HostTransferError):
            torch.empty(3, device="meta").tolist()
        with pytest.raises(HostTransferError):
            torch.empty(3, device="meta").to("cpu")
    assert guard.transfers == 0


def test_a_host_kernel_reads_cpu_tensors_except_where_a_strict_guard_counts_them_as_device_data():
    """`readable_on_host` picks numpy's count in `mismatch_counts`: never for what a strict guard treats as a GPU's."""
    a, b = torch.zeros(6, dtype=torch.bfloat16), torch.ones(6, dtype=torch.bfloat16)
    assert readable_on_host(a) and not readable_on_host(torch.zeros(2, device="meta"))
    with HostTransferGuard(strict=False):
        assert readable_on_host(a)
    with HostTransferGuard():
        assert not readable_on_host(a)
        host = to_host([a])[0]
        assert readable_on_host(host)
        counts = mismatch_counts([(a, b)])  # torch's kernel on the "device": no host read, so no HostTransferError
        assert int(to_host(counts)[0]) == 6


def test_moving_tensors_of_two_devices_at_once_is_refused():
    with pytest.raises(ValueError, match="one device"):
        to_host([torch.zeros(1), torch.zeros(1, device="meta")])


@pytest.mark.cuda
def test_cuda_round_trip_is_one_pinned_copy_each_way():
    tensors = _mixed()
    with HostTransferGuard(strict=False) as guard:
        on_gpu = to_device(tensors, "cuda")
        host = to_host(on_gpu)
    assert guard.transfers == 2
    assert all(t.device.type == "cuda" for t in on_gpu)
    assert all(_same(a, b) for a, b in zip(tensors, host, strict=True))
    with HostTransferGuard(strict=False), pytest.raises(HostTransferError):
        on_gpu[1].tolist()
