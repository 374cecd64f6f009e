"""The one command to run on a GPU machine: does hivespec work there, and how fast is it.

    python bench/gpu_check.py                 # on a CUDA box: everything below, embedded model
    python bench/gpu_check.py --quick         # smaller workloads
    python bench/gpu_check.py --device cpu --quick --model tiny   # the same code on a CPU (what the test runs)

Parts, each reported in the RESULT line:
- swarm: 2 rounds of a 2-node swarm (real `hivespec join` processes on 127.0.0.1, via
  bench/swarm_harness.py) with model.device set; every round must report engine_mismatch 0 (the
  engine bit-exact to the trainer's cast after the sync) and each node must accept foreign rollouts;
- engine: native engine tokens/s against transformers' `model.generate` at batch 1 and 16;
- speculation: plain vs speculative decoding on the RL-epoch workload (bench/spec_rollout.py):
  wall ratio, tokens per forward, identical fraction;
- trainer: seconds per GRPO step;
- delta: sparse delta extract and apply bandwidth (kernels/delta.py) and one full sync's time,
  with the engine checked bit-exact to the trainer and its host mirror afterwards;
- gpu_tests: the tests marked `cuda` (`pytest -m cuda tests`: whole tests, and the CUDA cases of tests
  parametrized by device), which skip without CUDA; collecting them needs the dev extra (hypothesis);
- vllm (when vLLM imports): the swarm round with model.engine=vllm and tests/node/test_vllm_engine.py.

Without CUDA (and no --device) it prints one line saying so and exits 0. Ends with one line
``RESULT {json}``; exits 1 when a correctness check (not a speed) failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # the bench folder only (swarm_harness); the repo root stays off sys.path

from swarm_harness import SwarmNode, prepare_model, start_swarm

from hivespec.kernels.host_transfer import synchronize
from hivespec.node.model.loader import EMBEDDED_MODEL, configure_threads, load_model, load_tokenizer


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="torch device (default: cuda when available, else say so and exit 0)")
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a few minutes on a GPU)")
    parser.add_argument("--model", default=EMBEDDED_MODEL, help="model for every part (tiny: random 2-layer, for CPU checks)")
    parser.add_argument("--skip", action="append", default=[], choices=["swarm", "engine", "speculation", "trainer", "delta", "gpu_tests", "vllm"],
                        help="leave a part out (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per completion in the engine part (default 128, quick 32)")
    return parser.parse_args(argv)


def _engine_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device computes in it (CUDA with bf16, the policy of node/model/loader.py), else float32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def device_info(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"name": props.name, "vram_gib": round(props.total_memory / (1 << 30), 1), "cuda": torch.version.cuda,
                 "capability": f"{props.major}.{props.minor}", "bf16": torch.cuda.is_bf16_supported()}
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


# ----- parts ---------------------------------------------------------------------------------


def swarm_part(device: torch.device, model: str, *, engine: str = "native", rounds: int = 2, timeout: float = 900.0) -> dict:
    """2 nodes, `rounds` rounds each; every round's engine_mismatch must be 0, each node must accept foreign rollouts."""
    if model != "tiny":
        prepare_model()
    # Each round waits for the other node's batch (as bench/swarm_vs_solo.py's shared condition does).
    sets = [f"model.device={device}", f"model.name={model}", f"model.engine={engine}", "swarm.expected_peers=1"]
    if device.type == "cuda":
        dtype = "bfloat16" if _engine_dtype(device) == torch.bfloat16 else "float32"
        sets += [f"model.engine_dtype={dtype}", "model.train_dtype=float32"]
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as root:
        started = time.perf_counter()
        nodes: list[SwarmNode] = []
        try:
            nodes = start_swarm(Path(root), 2, sets)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(len(n.rounds()) < rounds for n in nodes):
                for node in nodes:
                    node.poll()
                    if not node.alive() and len(node.rounds()) < rounds:
                        raise RuntimeError(f"{node.name} exited early:\n{node.log_text()[-3000:]}")
                time.sleep(0.5)
        finally:
            for node in nodes:
                node.stop()
        per_node = []
        for node in nodes:
            reports = node.rounds()[:rounds]
            per_node.append({
                "rounds": len(reports),
                "engine_mismatch": [r.get("engine_mismatch") for r in reports],
                "foreign_accepted": sum(int(r.get("accepted", 0)) for r in reports),
                "round_seconds": [round(r["seconds"]["round"], 2) for r in reports if isinstance(r.get("seconds"), dict)],
                # where each round's time went (rollout, gossip, train, sync, ...): what a slow round is made of
                "phases": [{k: round(v, 2) for k, v in r["seconds"].items() if k != "round"} for r in reports if isinstance(r.get("seconds"), dict)],
            })
    ok = all(n["rounds"] == rounds and set(n["engine_mismatch"]) == {0} and n["foreign_accepted"] > 0 for n in per_node)
    return {"ok": ok, "engine": engine, "nodes": per_node, "seconds": round(time.perf_counter() - started, 1)}


def _prompts(tokenizer, count: int) -> list[list[int]]:
    from hivespec.node.tasks import GSM_MINI_PATH, TaskSource

    source = TaskSource([("jsonl", 1, 1.0)], jsonl_path=GSM_MINI_PATH)
    family = source.families["jsonl"]
    return [list(source.chat_prompt_ids(tokenizer, family.make(i, 1))) for i in range(count)]  # type: ignore[attr-defined]


_ENGINE_REPEATS = 3  # timed runs per side; the fastest counts


def engine_part(device: torch.device, model_name: str, max_new_tokens: int) -> dict:
    """Native engine vs `model.generate`, tokens/s at batch 1 and 16, same prompts and length (no stop token)."""
    tokenizer = load_tokenizer(model_name)
    model = load_model(model_name, dtype=_engine_dtype(device), device=str(device)).requires_grad_(False)
    return {f"batch{batch}": _engine_rates(model, tokenizer, device, _prompts(tokenizer, batch), max_new_tokens) for batch in (1, 16)}


def _engine_rates(model, tokenizer, device: torch.device, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Tokens/s of both sides on `prompts` as one batch.

    Each side first runs the whole workload once untimed (a GPU's clocks, cuBLAS/cuDNN plans and
    the allocator warm up over the first runs); then the two alternate and each keeps its fastest
    of `_ENGINE_REPEATS` runs, so neither is timed colder than the other.
    """
    from hivespec.node.model.engine import GenerationRequest, SamplingParams, TorchEngine

    batch = len(prompts)
    engine = TorchEngine(model, max_batch_size=batch)
    requests = [GenerationRequest(tuple(p), seed=1, sample_index=i) for i, p in enumerate(prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)  # no stop tokens: every row runs to the limit
    width = max(map(len, prompts))
    ids = torch.full((batch, width), tokenizer.pad_token_id or 0, dtype=torch.int64)
    mask = torch.zeros(batch, width, dtype=torch.int64)
    for i, p in enumerate(prompts):  # left padding, as the engine pads
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)

    def native() -> int:
        return sum(len(s.completion_ids) for s in engine.generate(requests, params))

    def generate() -> int:
        with torch.inference_mode():
            generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                       do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=tokenizer.pad_token_id)
        return (generated.shape[1] - width) * batch

    runs = {"native": native, "generate": generate}
    tokens = {name: run() for name, run in runs.items()}  # the warm-up
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(_ENGINE_REPEATS):
        for name, run in runs.items():
            synchronize(device)
            started = time.perf_counter()
            tokens[name] = run()
            synchronize(device)
            best[name] = min(best[name], time.perf_counter() - started)
    native_rate, generate_rate = tokens["native"] / best["native"], tokens["generate"] / best["generate"]
    return {"native_tokens_per_s": round(native_rate, 1), "generate_tokens_per_s": round(generate_rate, 1),
            "native_over_generate": round(native_rate / generate_rate, 3), "tokens": tokens["native"]}


def speculation_part(device: torch.device, model: str, quick: bool) -> dict:
    """bench/spec_rollout.py on this device (its RESULT line)."""
    dtype = "bfloat16" if _engine_dtype(device) == torch.bfloat16 else "float32"
    command = [sys.executable, "-P", str(HERE / "spec_rollout.py"), "--device", str(device), "--model", model, "--dtype", dtype,
               "--peers", "0"]
    command += ["--quick"] if quick else []
    if device.type == "cuda":
        command += ["--batch-size", "1", "--threads", str(os.cpu_count() or 1)]
    result = _run_bench(command)
    keep = ("wall_ratio", "tokens_per_forward", "identical_fraction", "acceptance", "drafter_share", "sequences")
    return {k: result[k] for k in keep if k in result} | ({"error": result["error"]} if "error" in result else {})


def _run_bench(command: list[str]) -> dict:
    process = subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT)
    for line in reversed(process.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"{' '.join(command[2:4])} exited {process.returncode} without RESULT: {(process.stderr or process.stdout)[-1500:]}"}


def _train_samples(tokenizer, model, device: torch.device, count: int, max_new_tokens: int):
    from hivespec.node.model.engine import GenerationRequest, SamplingParams, TorchEngine
    from hivespec.node.training.trainer import TrainSample

    engine = TorchEngine(model.eval(), max_batch_size=count)
    prompts = _prompts(tokenizer, count // 4)
    requests = [GenerationRequest(tuple(p), seed=7, sample_index=i * 4 + g) for i, p in enumerate(prompts) for g in range(4)]
    samples = engine.generate(requests, SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,)))
    return [TrainSample(s.prompt_ids, s.completion_ids, s.logprobs, reward=float(i % 2), group=str(i // 4)) for i, s in enumerate(samples)]


def trainer_part(device: torch.device, model_name: str, quick: bool) -> dict:
    """Seconds per GRPO step (16 samples in groups of 4, micro batch 8), after one warm-up step, with a group's
    prompt run once or not as a node decides here (`train.share_prompts: auto`)."""
    from hivespec.node.model.attention import decide_shared_prompts
    from hivespec.node.training.trainer import Trainer

    tokenizer = load_tokenizer(model_name)
    model = load_model(model_name, dtype=torch.float32, device=str(device))
    completion_tokens = 32 if quick else 96
    samples = _train_samples(tokenizer, model, device, 16, completion_tokens)
    autocast = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    sharing = decide_shared_prompts("auto", model, device=str(device), rows=4, packed=8, prompt_tokens=64, completion_tokens=completion_tokens,
                                    autocast_dtype=autocast, eager=False, threads=torch.get_num_threads(), cache=None)
    trainer = Trainer(model, learning_rate=1e-6, micro_batch_size=8, autocast_dtype=autocast, share_prompts=sharing.share)
    trainer.step(samples)
    times = []
    for _ in range(2 if quick else 4):
        synchronize(device)
        started = time.perf_counter()
        stats = trainer.step(samples)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return {"step_seconds": round(min(times), 4), "tokens": stats.tokens, "samples": len(samples),
            "autocast": str(autocast).replace("torch.", "") if autocast else None, "share_prompts": sharing.describe()}


def delta_part(device: torch.device, model_name: str) -> dict:
    """Delta kernels' bandwidth on the engine's weights after one real optimizer step, and one full sync."""
    import copy

    from hivespec.kernels.delta import extract_delta, write_delta
    from hivespec.node.model.engine import unique_parameters
    from hivespec.node.weights.sync import WeightSync

    trainer = load_model(model_name, dtype=torch.float32, device=str(device))
    engine_model = copy.deepcopy(trainer).to(_engine_dtype(device)).requires_grad_(False)
    sync = WeightSync(trainer, unique_parameters(engine_model))
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    ids = torch.randint(0, trainer.config.vocab_size, (2, 64), device=device)
    trainer.train()
    trainer(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    trainer.eval()
    pairs = [(t, trainer.get_parameter(n).detach().to(t.dtype)) for n, t in sync.engine_params.items()]
    dense = sum(t.numel() * t.element_size() for t, _ in pairs)
    best_extract = best_apply = float("inf")
    changed = 0
    for _ in range(3):
        synchronize(device)
        started = time.perf_counter()
        found = [extract_delta(base, new) for base, new in pairs]
        synchronize(device)
        best_extract = min(best_extract, time.perf_counter() - started)
        changed = sum(i.numel() for i, _ in found)
        scratch = [base.clone() for base, _ in pairs]
        synchronize(device)
        started = time.perf_counter()
        for target, (indices, values) in zip(scratch, found, strict=True):
            write_delta(target, indices, values)
        synchronize(device)
        best_apply = min(best_apply, time.perf_counter() - started)
    stats, _ = sync.sync(1)
    exact = sync.mismatched_elements() == 0 and sync.engine.mirror_mismatches() == 0
    return {
        "ok": exact, "dense_bytes": dense, "changed": changed, "density": round(changed / max(1, sum(t.numel() for t, _ in pairs)), 4),
        "extract_gb_per_s": round(2 * dense / best_extract / 1e9, 2),  # reads base and new
        "apply_melem_per_s": round(changed / best_apply / 1e6, 1) if changed else None,
        "sync_seconds": round(stats.seconds, 3), "delta_bytes": stats.delta_bytes,
    }


def pytest_part(paths: list[str]) -> dict:
    process = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", *paths], check=False, capture_output=True, text=True, cwd=ROOT)
    summary = process.stdout.strip().splitlines()[-1] if process.stdout.strip() else process.stderr[-500:]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    return {"ok": process.returncode == 0, "summary": summary, **counts}


def vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False
    return True


# ----- main ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.device is None:
        if not torch.cuda.is_available():
            print(f"no CUDA device (torch {torch.__version__}): gpu_check measures nothing here; run it on a GPU machine")
            return 0
        args.device = "cuda"
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        configure_threads(None)
    max_new_tokens = args.max_new_tokens or (32 if args.quick else 128)
    result: dict = {"info": device_info(device), "model": args.model}
    print(f"gpu_check on {result['info']}", flush=True)
    parts = {
        "swarm": lambda: swarm_part(device, args.model),
        "engine": lambda: engine_part(device, args.model, max_new_tokens),
        "speculation": lambda: speculation_part(device, args.model, args.quick),
        "trainer": lambda: trainer_part(device, args.model, args.quick),
        "delta": lambda: delta_part(device, args.model),
        "gpu_tests": lambda: pytest_part(["-m", "cuda", "tests"]),
    }
    if vllm_importable() and device.type == "cuda":
        parts["vllm"] = lambda: {"swarm": swarm_part(device, args.model, engine="vllm"),
                                 "tests": pytest_part(["tests/node/test_vllm_engine.py"])}
    else:
        result["vllm"] = {"skipped": "vLLM does not import here" if device.type == "cuda" else "CPU run"}
    for name, run in parts.items():
        if name in args.skip:
            continue
        started = time.perf_counter()
        try:
            result[name] = run()
        except Exception as exc:  # noqa: BLE001 - one broken part must not hide the others' figures
            result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(f"{name} ({time.perf_counter() - started:.1f} s): {json.dumps(result[name])}", flush=True)
    failed = [name for name, part in result.items() if isinstance(part, dict) and (part.get("ok") is False or "error" in part)]
    failed += [f"vllm.{k}" for k, v in result.get("vllm", {}).items() if isinstance(v, dict) and v.get("ok") is False]
    result["failed"] = failed
    print("RESULT " + json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
