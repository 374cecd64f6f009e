"""bench/gpu_check.py stays runnable: its device-independent parts run here on the CPU and the tiny model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu_check would measure it")
def test_without_cuda_it_says_so_in_one_line_and_exits_0():
    done = subprocess.run([sys.executable, "-P", str(SCRIPT)], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().count("\n") == 0 and "no CUDA device" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_part_runs_on_the_cpu_with_the_tiny_model():
    done = subprocess.run([sys.executable, "-P", str(SCRIPT), "--device", "cpu", "--quick", "--model", "tiny"],
                          check=False, capture_output=True, text=True, timeout=880)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert done.returncode == 0 and result["failed"] == [], json.dumps(result, indent=1)
    swarm = result["swarm"]
    assert swarm["ok"] and len(swarm["nodes"]) == 2
    for node in swarm["nodes"]:
        assert node["rounds"] == 2 and node["engine_mismatch"] == [0, 0] and node["foreign_accepted"] > 0
    for batch in ("batch1", "batch16"):
        engine = result["engine"][batch]
        assert engine["native_tokens_per_s"] > 0 and engine["generate_tokens_per_s"] > 0
    assert set(result["speculation"]) >= {"wall_ratio", "tokens_per_forward", "identical_fraction"}
    assert result["trainer"]["step_seconds"] > 0 and result["trainer"]["tokens"] > 0
    delta = result["delta"]
    assert delta["ok"] and delta["changed"] > 0 and delta["extract_gb_per_s"] > 0
    assert result["gpu_tests"]["ok"] and result["gpu_tests"].get("skipped", 0) > 0  # CUDA-only tests skip here
    assert result["vllm"] == {"skipped": "CPU run"}
