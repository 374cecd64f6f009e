"""``model.device`` checked against this torch and this machine (`check_device`), and the clock its
measurements are timed by (`work_clock`).

A device string torch cannot parse, a CUDA device on a CPU-only torch build or on a machine
without a visible GPU, a GPU index past the last one, or MPS (its kernels have no float64): each is a
`DeviceError` (a `UserError`) naming the fix, raised before a model is built on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hivespec.protocol.errors import UserError


class DeviceError(UserError):
    """``model.device`` names a device this torch build or this machine does not have."""


def check_device(name: str, *, setting: str = "model.device", on_cpu: str = "set model.device: cpu") -> torch.device:
    """``torch.device(name)`` when this process can use it, else `DeviceError` naming `setting` and `on_cpu`, the way
    back to the CPU (a command's flag words them as ``--device``)."""
    where = f"{setting} {name!r}"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DeviceError(f"{where} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise DeviceError(f"{where}: this torch ({torch.__version__}) is a CPU-only build; {on_cpu}, "
                              "or install a CUDA build of torch (https://pytorch.org/get-started/locally/)")
        if not torch.cuda.is_available():
            raise DeviceError(f"{where}: no CUDA device is visible (torch {torch.__version__}); check the NVIDIA driver "
                              f"(nvidia-smi) and CUDA_VISIBLE_DEVICES, or {on_cpu}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"{where}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0; "
                              "pick one of them")
    elif device.type == "mps":
        # kernels/sampling.py draws its keyed noise and samples in float64 (device-independent, never exactly 0 or 1),
        # which MPS does not have: every step, plain decoding included, would raise.
        raise DeviceError(f"{where}: hivespec samples in float64, which Apple GPUs (MPS) do not support; {on_cpu}")
    return device


def work_clock(device: torch.device | str) -> Callable[[], float]:
    """The clock that times a measurement's runs on `device`: this thread's CPU time where the work is
    this thread's alone (a CPU with one torch thread), else the wall.

    A node measures its machine (the verify-cost curve, precision, attention) to compare runs
    with each other, and a demo node does it while its peers train on the same cores. Timed by the
    wall, a run counts every moment the scheduler gave its core away: on a 2-core EPYC (bf16, one
    thread each, two peers training beside it) three calibrations' T(16, 3) / T(16, 1) came out 4.18,
    4.18 and 2.84 against 2.00 alone, and every ratio was within 109 % of the quiet curve; by the
    thread's CPU time, within 18 % (the quiet curve timed again: 5 %; `bench/calibration_load.py`).
    One torch thread runs a CPU forward and backward on the calling thread, so its CPU time is the
    work. Several torch threads share it and a GPU does it elsewhere: those are timed by the wall, as
    is any run that hands work to other threads (the weight sync's hash: `precision.measure_sync`).
    """
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter
