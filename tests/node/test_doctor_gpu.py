"""The doctor's GPU lines: a pure function of device properties, so every machine tests them."""

import torch

from hivespec.node.config import load_config
from hivespec.node.doctor import GpuProperties, check_gpu, gpu_checks, gpu_footprint

GIB = 1 << 30
H100 = GpuProperties(0, "NVIDIA H100 80GB HBM3", (9, 0), 80 * GIB, 79 * GIB, True)
T4 = GpuProperties(0, "Tesla T4", (7, 5), 15 * GIB, 14 * GIB, False)
PARAMS = 134_515_008  # SmolLM2-135M


def _lines(checks):
    return [c.line() for c in checks]


def test_a_big_gpu_reports_name_capability_bf16_and_vram_against_the_footprint():
    checks = gpu_checks([H100], device="cuda", params=PARAMS, engine_dtype="bfloat16")
    assert [(c.name, c.status) for c in checks] == [("gpu", "ok"), ("vram", "ok")]
    assert "cuda:0 NVIDIA H100 80GB HBM3 (compute 9.0), bf16 supported" in checks[0].detail
    need = PARAMS * 18 + GIB
    assert gpu_footprint(PARAMS, "bfloat16", engine="native", vllm_memory_utilization=0.5, total_bytes=80 * GIB) == need
    assert checks[1].detail == f"cuda:0 79.0 GiB free of 80.0 GiB, a node needs ~{need / GIB:.1f} GiB"


def test_no_bf16_with_a_bf16_engine_warns_with_the_fix():
    gpu, vram = gpu_checks([T4], device="cuda:0", params=PARAMS, engine_dtype="bfloat16")
    assert gpu.status == "warn" and "no native bf16" in gpu.detail and "model.engine_dtype=float32" in gpu.detail
    assert vram.status == "ok"
    assert gpu_checks([T4], device="cuda", params=PARAMS, engine_dtype="float32")[0].status == "ok"


def test_vram_failures_say_whether_to_free_memory_or_shrink_the_model():
    busy = GpuProperties(0, "busy", (8, 0), 16 * GIB, 1 * GIB, True)
    (vram,) = [c for c in gpu_checks([busy], device="cuda", params=PARAMS, engine_dtype="bfloat16") if c.name == "vram"]
    assert vram.status == "fail" and "stop them (nvidia-smi)" in vram.detail
    small = GpuProperties(0, "small", (8, 6), 4 * GIB, 4 * GIB, True)
    (vram,) = [c for c in gpu_checks([small], device="cuda", params=PARAMS, engine_dtype="bfloat16", engine="vllm",
                                     vllm_memory_utilization=0.9) if c.name == "vram"]
    assert vram.status == "fail" and "does not fit" in vram.detail and "vllm_gpu_memory_utilization" in vram.detail


def test_only_the_configured_device_can_fail_and_others_are_labelled():
    other = GpuProperties(1, "tiny", (8, 0), 2 * GIB, 0, True)
    checks = gpu_checks([H100, other], device="cuda:0", params=PARAMS, engine_dtype="bfloat16")
    assert [c.status for c in checks] == ["ok", "ok", "ok", "ok"]
    assert "not the configured device" in checks[2].detail and "not the configured device" in checks[3].detail


def test_a_configured_device_this_machine_lacks_fails():
    """model.device cuda:1 on a one-GPU machine (or cuda:x) passed every line (cuda:0 'not the configured device', or a
    ValueError traceback), where the node's start refuses it."""
    for device in ("cuda:1", "cuda:x"):
        checks = gpu_checks([H100], device=device, params=PARAMS, engine_dtype="bfloat16")
        assert checks[0].status == "fail" and f"model.device {device!r} is none of this machine's 1 CUDA device(s)" in checks[0].detail
    assert "fail" not in {c.status for c in gpu_checks([H100], device="cuda:0", params=PARAMS, engine_dtype="bfloat16")}


def test_no_gpu_is_a_skip_on_cpu_and_a_failure_when_cuda_is_configured():
    cpu = gpu_checks([], device="cpu", params=PARAMS, engine_dtype="bfloat16", torch_version="2.13.0+cpu")
    assert [(c.name, c.status) for c in cpu] == [("gpu", "skip"), ("vram", "skip")]
    assert "CPU-only build" in cpu[0].detail
    wanted = gpu_checks([], device="cuda", params=PARAMS, engine_dtype="bfloat16", torch_version="2.13.0", cuda_version="12.8")
    assert wanted[0].status == "fail" and "sees none" in wanted[0].detail and "model.device=cpu" in wanted[0].detail


def test_this_machine_gets_lines_from_the_real_properties():
    checks = check_gpu(load_config("tiny"), PARAMS)
    assert {c.name for c in checks} == {"gpu", "vram"}
    if not torch.cuda.is_available():
        assert all(c.status == "skip" for c in checks)
