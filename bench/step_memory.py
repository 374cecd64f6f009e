"""What one training step of the embedded model adds to a CPU node's memory, against what node/model/footprint.py says.

A node sizes its micro batch by `footprint.step_bytes` before every step (node/supervise.py `MicroBatchFit`) and the
demo its node count by the whole bound: where a step takes more than the estimate, the kernel stops a node that was
told it fits. This runs real steps of SmolLM2-135M (the trainer a node builds: AdamW on float32 weights, bf16
autocast or float32, eager attention or SDPA) on 16 samples (4 prompts x 4 completions, rows of prompt + completion
tokens) in micro batches of 8 and of 1, each case in its own process, and reads how far the process's high-water mark
(VmHWM, reset before each step through /proc/self/clear_refs) rose in the step, after one step that made the optimizer's
state. The rise per sample between the two micro batches is the activations' share; what is left at one sample, the
fixed part (gradients, temporaries, the 16-bit weight copy).

    python bench/step_memory.py --quick   # two cases: bf16 and float32, 64 + 96 tokens, SDPA
    python bench/step_memory.py           # rows of 48 to 432 tokens, bf16 and float32, eager and SDPA
    python bench/step_memory.py --quick --shape smollm2-360m   # a larger model than the estimate was measured on:
                                          # random weights in SmolLM2-360M's shape (no hub download here)

Linux only (VmHWM, clear_refs). Ends with ``RESULT {json}``: per case the measured rise and the estimate at each micro
batch and their ratio, `max_ratio` (measured over estimated: at most 1 where the estimate bounds the step),
`mb_per_token` (the activations' rise per token, per case) and the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

QUICK = [(64, 96, "bf16", "sdpa"), (64, 96, "fp32", "sdpa")]
FULL = [(16, 32, "bf16", "sdpa"), (16, 96, "bf16", "sdpa"), (64, 96, "bf16", "sdpa"), (160, 32, "bf16", "sdpa"),
        (400, 32, "bf16", "sdpa"), (64, 96, "fp32", "sdpa"), (64, 96, "bf16", "eager")]
SAMPLES = 16

_CASE = """
import ctypes, json, random, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from hivespec.node.model.footprint import shape_of, step_bytes
from hivespec.node.model.loader import EMBEDDED_MODEL, load_model
from hivespec.node.training.trainer import Trainer, TrainSample

prompt_tokens, completion_tokens, precision, attention, repeats, model_shape = sys.argv[1:7]
prompt_tokens, completion_tokens, repeats = int(prompt_tokens), int(completion_tokens), int(repeats)
autocast = precision == "bf16"

def high_water() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")

model = load_model(EMBEDDED_MODEL)
if model_shape == "smollm2-360m":  # the same vocabulary and family, 2.7x the parameters (its config.json's shape)
    from transformers import LlamaForCausalLM
    config = model.config
    config.update({"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
                   "num_key_value_heads": 5})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
model.requires_grad_(True)
shape = shape_of(model.config.to_dict(), sum(p.numel() for p in model.parameters()))
rng = random.Random(0)
samples = []
for group in range(4):
    prompt = tuple(rng.randrange(1000, 40000) for _ in range(prompt_tokens))
    for i in range(4):
        completion = tuple(rng.randrange(1000, 40000) for _ in range(completion_tokens))
        samples.append(TrainSample(prompt, completion, (-1.0,) * completion_tokens, float(i % 2), f"g{group}"))
trainer = Trainer(model, learning_rate=1e-6, micro_batch_size=8, autocast_dtype=torch.bfloat16 if autocast else None,
                  eager_attention=attention == "eager", share_prompts=False)
# Behaviour log-probs the trainer's own: every token kept, as on-policy samples are.
samples = [TrainSample(s.prompt_ids, s.completion_ids, tuple(lp), s.reward, s.group) for s, lp in zip(samples, trainer.logprobs(samples))]
trainer.step(samples)  # AdamW's moments exist from here on, as in a running node
trim = ctypes.CDLL("libc.so.6").malloc_trim
rises = {}
for _ in range(repeats):
    for size in (8, 1):
        trainer.micro_batch_size = size
        trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from what is resident now
        base = high_water()
        started = time.perf_counter()
        trainer.step(samples)
        seconds = time.perf_counter() - started
        rise = high_water() - base
        best = rises.get(size)
        rises[size] = {"rise": max(rise, best["rise"] if best else 0), "seconds": min(seconds, best["seconds"] if best else seconds)}
row = prompt_tokens + completion_tokens
print(json.dumps({str(size): {**value, "estimate": step_bytes(shape, autocast=autocast, micro_batch_size=size, row_tokens=row)}
                  for size, value in rises.items()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two cases, one repeat each (about 2 minutes)")
    parser.add_argument("--repeats", type=int, default=None, help="steps per micro batch and case (the largest rise kept)")
    parser.add_argument("--shape", choices=("embedded", "smollm2-360m"), default="embedded",
                        help="the embedded SmolLM2-135M, or random weights in SmolLM2-360M's shape")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("bench/step_memory.py reads /proc/self/status and /proc/self/clear_refs: Linux only")
    from hivespec.node.model.precision import cpu_facts

    repeats = args.repeats or (1 if args.quick else 2)
    cases = QUICK if args.quick else FULL
    results, ratios, per_token = {}, [], {}
    for prompt_tokens, completion_tokens, precision, attention in cases:
        name = f"{precision}-{attention}-{prompt_tokens}+{completion_tokens}"
        started = time.perf_counter()
        out = subprocess.run([sys.executable, "-P", "-c", _CASE, str(prompt_tokens), str(completion_tokens), precision,
                              attention, str(repeats), args.shape], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            sys.exit(f"case {name} failed:\n{out.stderr[-3000:]}")
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        row = {size: {"rise_gb": round(m["rise"] / 1e9, 3), "estimate_gb": round(m["estimate"] / 1e9, 3),
                      "ratio": round(m["rise"] / m["estimate"], 3), "seconds": round(m["seconds"], 2)} for size, m in measured.items()}
        per_token[name] = round((measured["8"]["rise"] - measured["1"]["rise"]) / 7 / (prompt_tokens + completion_tokens) / 1e6, 3)
        results[name] = row
        ratios += [r["ratio"] for r in row.values()]
        print(f"{name}: " + "; ".join(f"micro {size}: rose {r['rise_gb']} GB, estimate {r['estimate_gb']} GB "
                                      f"({r['ratio']}), step {r['seconds']} s" for size, r in row.items())
              + f"; {per_token[name]} MB a token ({time.perf_counter() - started:.0f} s)", flush=True)
    facts = cpu_facts()
    print("RESULT " + json.dumps({"shape": args.shape, "cases": results, "max_ratio": max(ratios), "mb_per_token": per_token,
                                  "samples": SAMPLES, "repeats": repeats, "cpu": facts["cpu"],
                                  "bf16_flags": facts["native_bf16_flags"], "torch": facts["torch"]}))


if __name__ == "__main__":
    main()
