"""Suite-wide settings: one torch thread per process (2-core machines; oversubscription makes forwards 10-30x slower)."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# `python -m pytest` puts the working directory on sys.path; from the repo root that would make
# our `kernels/` folder importable as a bare `kernels`, which transformers mistakes for Hugging
# Face's package. Code must only ever see it as `hivespec.kernels`.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

CUDA_SKIP = "needs a CUDA device: `python bench/gpu_check.py` runs the tests marked cuda on a GPU machine"


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` (a whole test, or a `pytest.param("cuda", marks=pytest.mark.cuda)` case) skip without CUDA."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch  # here, not at the top: a run of the protocol tests alone never imports it

    if not torch.cuda.is_available():
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=CUDA_SKIP))
