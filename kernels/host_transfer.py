"""Moving many tensors between a device and host memory in one batched transfer, and a guard that checks it.

Hot paths (weight sync, decoding, training) keep tensor work on the model's device; data
crosses to host memory only at the wire boundary (encoding, hashing, Python token lists), and
there through `to_host` / `to_device`: every tensor of the step packed into one byte buffer,
moved with one copy (through pinned memory on CUDA), and unpacked into views. Tensors already
where they are asked to go are returned as they are, so CPU code runs the same path at no cost.

`HostTransferGuard` is the check (a torch function mode): inside it, reading a tensor's data
from Python (`.numpy()`, `.tolist()`, `.item()`, `int(t)`, `bool(t)`, `np.asarray(t)`, `.cpu()`;
`.to("cpu")` of a non-CPU tensor)
raises `HostTransferError` unless the tensor came out of `to_host`. With ``strict=True`` every
tensor counts as a device tensor, so a CPU-only test catches what would fail or stall on a GPU;
``strict=False`` watches non-CPU tensors only (for runs on a real device). It also counts the
batched transfers, so a test can hold a step to its budget.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Self

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["HostTransferError", "HostTransferGuard", "readable_on_host", "to_device", "to_host"]

_ALIGN = 16  # bytes: every dtype's view of a packed segment starts aligned
_BUCKET_BYTES = 256 << 20  # at most this much device memory is staged for one copy
_GUARDS: contextvars.ContextVar[tuple[HostTransferGuard, ...]] = contextvars.ContextVar("host_transfer_guards", default=())
_IN_TRANSFER: contextvars.ContextVar[bool] = contextvars.ContextVar("in_host_transfer", default=False)


class HostTransferError(RuntimeError):
    """A hot path read device data into Python outside `to_host` (a per-element or per-tensor transfer)."""


def _segments(tensors: Sequence[Tensor]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return offsets, total


def _as_bytes(t: Tensor) -> Tensor:
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _unpack(buffer: Tensor, like: Sequence[Tensor], offsets: Sequence[int]) -> list[Tensor]:
    out = []
    for t, offset in zip(like, offsets, strict=True):
        size = t.numel() * t.element_size()
        raw = buffer[offset : offset + size]
        view = raw.view(torch.uint8 if t.dtype == torch.bool else t.dtype)
        out.append((view.view(torch.bool) if t.dtype == torch.bool else view).reshape(t.shape))
    return out


def _buckets(tensors: Sequence[Tensor], limit: int) -> Iterator[list[int]]:
    bucket, size = [], 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(i)
        size += nbytes
    if bucket:
        yield bucket


def _move(tensors: Sequence[Tensor], device: torch.device, bucket_bytes: int, *, host: bool) -> list[Tensor]:
    """Pack, copy once per bucket, unpack; the result views one buffer per bucket on `device`."""
    out: list[Tensor | None] = [None] * len(tensors)
    pin = device.type == "cpu" and any(t.device.type == "cuda" for t in tensors) or (
        device.type == "cuda" and all(t.device.type == "cpu" for t in tensors)
    )
    inside = _IN_TRANSFER.set(True)  # the declared boundary: its own copies are what the guard allows
    try:
        for bucket in _buckets(tensors, bucket_bytes):
            _move_bucket(tensors, bucket, device, pin, host, out)
    finally:
        _IN_TRANSFER.reset(inside)
    return [t for t in out if t is not None]


def _move_bucket(tensors: Sequence[Tensor], bucket: list[int], device: torch.device, pin: bool, host: bool,
                 out: list[Tensor | None]) -> None:
    items = [tensors[i] for i in bucket]
    offsets, total = _segments(items)
    source_device = items[0].device
    packed = torch.zeros(total, dtype=torch.uint8, device=source_device, pin_memory=pin and source_device.type == "cpu")
    for t, offset in zip(items, offsets, strict=True):
        data = _as_bytes(t)
        packed[offset : offset + data.numel()] = data
    if device.type == "cpu" and pin:
        moved = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        moved.copy_(packed)  # synchronous: the caller reads it next
    else:
        moved = packed.to(device, non_blocking=pin)
    for guard in _GUARDS.get():
        guard._transferred(moved, total, to_host=host)
    for i, view in zip(bucket, _unpack(moved, items, offsets), strict=True):
        out[i] = view


def to_host(tensors: Sequence[Tensor], *, bucket_bytes: int = _BUCKET_BYTES) -> list[Tensor]:
    """CPU tensors with the data of `tensors` (all on one device), in one copy per `bucket_bytes`.

    CPU inputs come back as they are (no copy, except under a strict `HostTransferGuard`, which
    simulates a bus: never rely on the aliasing); device inputs come back as views of one fresh
    host buffer. This is the declared wire boundary: only its results may be
    read from Python under a `HostTransferGuard`.
    """
    tensors = list(tensors)
    if not tensors:
        return []
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"to_host moves tensors of one device at a time, got {sorted(map(str, devices))}")
    if next(iter(devices)).type == "cpu" and not _simulating():
        return tensors
    return _move(tensors, torch.device("cpu"), bucket_bytes, host=True)


def to_device(tensors: Sequence[Tensor], device: torch.device | str, *, bucket_bytes: int = _BUCKET_BYTES) -> list[Tensor]:
    """Copies of `tensors` (all on one device) on `device`, in one copy per `bucket_bytes` (pinned staging from CPU).

    Tensors already on `device` come back as they are (no copy, except under a strict guard). The
    results view one shared buffer per bucket: write into them only if that is what you mean.
    """
    device = torch.device(device)
    tensors = list(tensors)
    if not tensors:
        return []
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"to_device moves tensors of one device at a time, got {sorted(map(str, devices))}")
    here = next(iter(devices))
    if here == device or (here.type == device.type and device.index is None):
        # A strict guard copies and counts: on CPU the host is the device, so this is the call that crosses a bus on a GPU.
        return _move(tensors, here, bucket_bytes, host=False) if _simulating() else tensors
    if device.type == "cpu":
        return to_host(tensors, bucket_bytes=bucket_bytes)
    return _move(tensors, device, bucket_bytes, host=False)


def synchronize(device: torch.device | str) -> None:
    """Wait for the kernels queued on `device` (nothing to wait for on a CPU): what a timing must do before it reads a clock."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def readable_on_host(tensor: Tensor) -> bool:
    """Whether a host kernel (numpy's) may read `tensor`'s data as it is: a CPU tensor, unless an active guard counts it
    as device data (a strict guard simulating a GPU, where only what came out of `to_host` is host data)."""
    return tensor.device.type == "cpu" and not any(guard._is_device_data(tensor) for guard in _GUARDS.get())


def _simulating() -> bool:
    """A strict guard is active: CPU-to-CPU moves copy too, as they would across a bus."""
    return any(guard.strict for guard in _GUARDS.get())


_READS = {
    Tensor.numpy, Tensor.tolist, Tensor.item, Tensor.__bool__, Tensor.__int__, Tensor.__float__,
    Tensor.__index__, Tensor.__array__, Tensor.cpu,
}


class HostTransferGuard(TorchFunctionMode):
    """Raises on a Python read of device data that did not go through `to_host`; counts batched transfers.

    ``strict=True`` treats every tensor as a device tensor (run on CPU to find what would break
    or stall on a GPU). ``transfers`` counts `to_host` / `to_device` calls made while active;
    ``transferred_bytes`` the bytes they copied.
    """

    def __init__(self, *, strict: bool = True) -> None:
        super().__init__()
        self.strict = strict
        self.transfers = 0
        self.transferred_bytes = 0
        self._host: set[int] = set()
        self._token: contextvars.Token | None = None

    def __enter__(self) -> Self:
        self._token = _GUARDS.set((*_GUARDS.get(), self))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self._token is not None:
            _GUARDS.reset(self._token)

    def _transferred(self, buffer: Tensor, nbytes: int, *, to_host: bool) -> None:
        self.transfers += 1
        self.transferred_bytes += nbytes
        if to_host:
            self._host.add(buffer.untyped_storage().data_ptr())

    def _is_device_data(self, t: Tensor) -> bool:
        if not self.strict and t.device.type == "cpu":
            return False
        if t.device.type == "meta":
            return True
        return t.untyped_storage().data_ptr() not in self._host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # `.to(cpu)` is checked on real device tensors only: device-agnostic code writes `.to(x.device)`.
        cross = func is Tensor.to and _to_cpu(args, kwargs) and isinstance(args[0], Tensor) and args[0].device.type != "cpu"
        if not _IN_TRANSFER.get() and (func in _READS or cross):
            tensor = args[0] if args else None
            if isinstance(tensor, Tensor) and self._is_device_data(tensor):
                name = getattr(func, "__name__", str(func))
                raise HostTransferError(
                    f"{name}() read a {tuple(tensor.shape)} {tensor.dtype} tensor's data on the host outside to_host(): "
                    "on a GPU that is a device sync (or fails, for .numpy()) per call; batch it through "
                    "hivespec.kernels.host_transfer.to_host at the wire boundary"
                )
        return func(*args, **kwargs)


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    target = kwargs.get("device")
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device)):
            target = arg
    return target is not None and torch.device(target).type == "cpu"


@contextmanager
def no_host_reads(*, strict: bool = True) -> Iterator[HostTransferGuard]:
    """`with no_host_reads() as guard:` run a hot path under a `HostTransferGuard`."""
    with HostTransferGuard(strict=strict) as guard:
        yield guard
