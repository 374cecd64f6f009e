"""Suite-wide settings: one torch thread per process (2-core machines; oversubscription makes forwards 10-30x slower)."""

import os
import sys
from pathlib import Path

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
