"""``model.device`` checked against this torch and this machine: `check_device`.

A device string torch cannot parse, a CUDA device on a CPU-only torch build or on a machine
without a visible GPU, a GPU index past the last one, or MPS where there is none: each is a
`DeviceError` (a `UserError`) naming the fix, raised before a model is built on it.
"""

from __future__ import annotations

import torch

from hivespec.protocol.errors import UserError


class DeviceError(UserError):
    """``model.device`` names a device this torch build or this machine does not have."""


def check_device(name: str) -> torch.device:
    """``torch.device(name)`` when this process can use it, else `DeviceError`."""
    where = f"model.device {name!r}"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DeviceError(f"{where} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise DeviceError(f"{where}: this torch ({torch.__version__}) is a CPU-only build; set model.device: cpu, "
                              "or install a CUDA build of torch (https://pytorch.org/get-started/locally/)")
        if not torch.cuda.is_available():
            raise DeviceError(f"{where}: no CUDA device is visible (torch {torch.__version__}); check the NVIDIA driver "
                              "(nvidia-smi) and CUDA_VISIBLE_DEVICES, or set model.device: cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"{where}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0; "
                              "pick one of them")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"{where}: MPS (Apple GPU) is not available here; set model.device: cpu")
    return device
