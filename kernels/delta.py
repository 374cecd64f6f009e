"""Sparse bitwise weight deltas: which elements changed, and writing them back bit for bit.

Elements are compared and copied as integers of the same width, never as floats: float
comparison calls -0.0 equal to 0.0 and NaN unequal to itself, and a float copy may quiet a
signalling NaN, any of which would let engine and trainer weights drift apart silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from hivespec.kernels.host_transfer import readable_on_host

__all__ = ["apply_delta", "extract_delta", "mismatch_count", "mismatch_counts", "write_delta"]

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: Tensor) -> Tensor:
    """A flat integer view of the tensor's bytes, one element per element."""
    width = tensor.element_size()
    if width not in _INT_OF_WIDTH or tensor.is_complex():
        raise ValueError(f"unsupported dtype {tensor.dtype} for a bitwise delta; use a real 1/2/4/8-byte dtype")
    return tensor.reshape(-1).view(_INT_OF_WIDTH[width])


def extract_delta(base: Tensor, new: Tensor) -> tuple[Tensor, Tensor]:
    """Flat indices (int64, ascending) where new's bits differ from base's, and new's values there.

    Values keep new's dtype. Non-contiguous inputs are read in row-major order, the order
    apply_delta writes in.
    """
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(
            f"base and new must match in shape and dtype, got {tuple(base.shape)} {base.dtype} "
            f"and {tuple(new.shape)} {new.dtype}; a delta only describes a same-shaped update"
        )
    if base.device != new.device:
        raise ValueError(f"base is on {base.device} and new on {new.device}; move both to one device")
    new_bits = _bits(new.detach())
    indices = torch.nonzero(_bits(base.detach()) != new_bits, as_tuple=True)[0]
    return indices, new_bits[indices].view(new.dtype)


def mismatch_count(base: Tensor, new: Tensor) -> Tensor:
    """Number of elements whose bits differ, as a 0-d int64 tensor on their device (reading it syncs)."""
    return mismatch_counts([(base, new)])[0]


def mismatch_counts(pairs: Sequence[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """`mismatch_count` of each (base, new) pair: one 0-d int64 tensor each, on the pair's device.

    CPU pairs are compared by numpy, in pieces of `_PIECE` elements spread over torch's intra-op threads (numpy lets
    go of the GIL): over the embedded model's bf16 tensors numpy's compare and count took 0.05-0.07 s where torch's
    `count_nonzero(a != b)` took 0.12-0.26 s at 1 thread and 0.11 s at 2 (2-core Intel Xeon, AMX; `bench/sync_modes.py`
    prints both side by side). A round's sync counts every tensor; its check counts again those not copied whole. On a
    GPU it is torch's `count_nonzero` (~10 ms for the whole model on an H100), not a bool `.sum()`, which accumulates in
    int64 (0.36 s against 0.07 s over one flat 135M-element tensor at 2 threads, 2-core AMD EPYC).
    """
    for base, new in pairs:
        if base.shape != new.shape or base.dtype != new.dtype or base.device != new.device:
            raise ValueError(f"base and new must match in shape, dtype and device, got {tuple(base.shape)} {base.dtype} "
                             f"{base.device} and {tuple(new.shape)} {new.dtype} {new.device}")
    counts: list[Tensor | None] = [None] * len(pairs)
    on_host = [i for i, (base, new) in enumerate(pairs) if readable_on_host(base) and readable_on_host(new)]
    for i, count in zip(on_host, _count_on_host([pairs[i] for i in on_host]), strict=True):
        counts[i] = torch.tensor(count, dtype=torch.int64)
    for i, (base, new) in enumerate(pairs):
        if counts[i] is None:  # on a device (or a CPU tensor a strict guard counts as one): torch's kernel, no host read
            counts[i] = torch.count_nonzero(_bits(base.detach()) != _bits(new.detach()))
    return [c for c in counts if c is not None]


_PIECE = 1 << 22  # elements of a CPU tensor compared on their own (8 MiB of bf16 bits)


def _count_on_host(pairs: Sequence[tuple[Tensor, Tensor]]) -> list[int]:
    """Changed elements of each pair, every tensor `readable_on_host` (the caller checked): numpy views, no copy."""
    views = [(_bits(base.detach()).numpy(), _bits(new.detach()).numpy()) for base, new in pairs]  # host data
    pieces = [(owner, start) for owner, (a, _) in enumerate(views) for start in range(0, a.size, _PIECE)]

    def count(piece: tuple[int, int]) -> int:
        (a, b), start = views[piece[0]], piece[1]
        return int(np.count_nonzero(a[start:start + _PIECE] != b[start:start + _PIECE]))

    threads = min(torch.get_num_threads(), len(pieces))
    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="mismatch-count") as pool:
            found = list(pool.map(count, pieces))
    else:
        found = [count(piece) for piece in pieces]
    totals = [0] * len(views)
    for (owner, _), n in zip(pieces, found, strict=True):
        totals[owner] += n
    return totals


def apply_delta(target: Tensor, indices: Tensor, values: Tensor) -> Tensor:
    """Write values into target at flat indices, in place and bit-exact (no autograd record).

    target must be contiguous; indices int64, 1-D, strictly ascending (hence unique) and inside
    target; values 1-D of target's dtype and device, one per index. Raises ValueError otherwise,
    before writing anything. Returns the values it overwrote, so
    ``apply_delta(target, indices, previous)`` undoes the write bit for bit.
    """
    _check_write(target, indices, values)
    if indices.numel() == 0:
        return values.clone()
    # These reads sync a device; `write_delta` skips them for indices validated on the host.
    first, last = int(indices[0]), int(indices[-1])
    if first < 0 or last >= target.numel():
        raise ValueError(f"indices span [{first}, {last}] but target has {target.numel()} elements")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError("indices must be strictly ascending (sorted, no repeats), as extract_delta makes them")
    with torch.no_grad():
        previous = _bits(target)[indices].view(target.dtype)
    write_delta(target, indices, values)
    return previous


def write_delta(target: Tensor, indices: Tensor, values: Tensor) -> None:
    """`apply_delta` without reading the indices, and without keeping what it overwrote: shapes, dtypes and
    devices are checked, never the data.

    For indices already validated on the host (the delta decoder checks range and order before
    anything is written), so a write stays asynchronous on a GPU. Out-of-range indices raise
    from torch's indexing (on CUDA: a device-side assert); unsorted ones write last-wins.
    """
    _check_write(target, indices, values)
    with torch.no_grad():
        _bits(target)[indices] = _bits(values)


def _check_write(target: Tensor, indices: Tensor, values: Tensor) -> None:
    if not target.is_contiguous():
        raise ValueError("target must be contiguous; apply the delta to the contiguous parameter it came from")
    if indices.dtype != torch.int64 or indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D int64 tensor, got {indices.dim()}-D {indices.dtype}")
    if values.dim() != 1 or values.numel() != indices.numel():
        raise ValueError(
            f"values must be 1-D with one value per index; got shape {tuple(values.shape)} "
            f"for {indices.numel()} indices"
        )
    if values.dtype != target.dtype:
        raise ValueError(f"values are {values.dtype} but target is {target.dtype}; cast on the sender, not here")
    if indices.device != target.device or values.device != target.device:
        raise ValueError(
            f"target is on {target.device}, indices on {indices.device}, values on {values.device}; "
            "move indices and values to target's device"
        )
