"""bench/logprob_memory.py's memory figure: the step's peak above the inputs, gradients included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "logprob_memory.py"


def test_naive_peak_counts_at_least_the_gradients_of_hidden_and_w():
    # A fresh process per variant, as the bench runs them. Building W (randn, then scaled) left a
    # W-sized temporary in the high-water mark, which a mark read without a reset took off the step:
    # 56 MB from a shell, 0.0 when started from this test, under the 108 MB gradient of W alone.
    rows, vocab, hidden = 128, 49152, 576
    command = [sys.executable, "-P", str(SCRIPT), "--variant", "naive", "--batch", "1", "--seq-len", str(rows),
               "--vocab", str(vocab), "--hidden", str(hidden), "--threads", "1", "--repeats", "1"]
    done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT)
    figure = json.loads(done.stdout.strip().splitlines()[-1])
    gradients_mb = (vocab + rows) * hidden * 4 / 2**20  # both live at the end of backward
    logits_mb = rows * vocab * 4 / 2**20  # the gradient of the logits, live while W's is made
    assert figure["peak_extra_mb"] >= gradients_mb + logits_mb, figure
