"""How long a demo round takes under each precision policy, and how close trainer and engine are to bare transformers.

Three parts, one run, on the embedded SmolLM2-135M-Instruct:

1. Kernels against bare transformers, at the precision ``auto`` picks on this machine:
   - trainer_vs_bare: one `Trainer.step` (GRPO with importance weights, micro batches, AdamW)
     over real completions against a bare step on the same tokens: the same micro batches
     through transformers' backbone, the LM head at the completion tokens, cross entropy,
     backward and an AdamW step, in the trainer's dtypes: the backbone under the trainer's
     own autocast (``Trainer.autocast_dtype``, what ``auto`` picked), the head's forward in
     float32 and its backward matmuls in the autocast dtype, as the trainer's
     `kernels.logprobs.token_logprobs` runs them (``model(..., labels=...)`` would run the
     head in bf16 over every position). Every sample gets a non-zero advantage, so the trainer
     runs backward on all of them, as the bare step does. Target <= 1.3.
   - engine_vs_hf_generate: the native engine's tokens/s against ``model.generate`` at the same
     batch (the demo's decode batch), dtype and length (every row decodes max_new_tokens: no
     stop tokens; sampling at temperature 1, no top-k/top-p). Target >= 1.0.
   Each side of a pair runs once untimed (a first call builds kernels and state the later ones
   reuse), then the two alternate; each keeps its fastest timed run (1 in --quick, else 2).
2. The demo preset's round (generate, gossip with 2 peers, train, sync) as a real 3-node swarm (2 in --quick)
   of `hivespec join` processes on 127.0.0.1 (bench/swarm_harness.py), once per precision:
   ``auto`` (the default), ``bf16`` (engine bfloat16 + bf16 autocast: the old default) and
   ``fp32`` (engine float32, no autocast), one after the other, never together. Per-phase
   seconds are the mean over the nodes; rounds after the first are the steady state (the
   first also waits for the slowest node to start). Speculation is off unless --speculation
   (it is lossless and benched in bench/spec_rollout.py; its one-time calibration would
   otherwise be part of the first start).
3. What ``auto`` chose on this machine, with its measured reason (node-0's ready event).

    python bench/round_time.py --quick   # 2 nodes, 1 prompt x 4 completions x 16 tokens, 1 round per setting: < 3 min
    python bench/round_time.py --quick --kernels-only   # part 1 alone: about a minute
    python bench/round_time.py           # the demo preset as shipped, 2 rounds per setting

Ends with ``RESULT {"round_s_auto", "round_s_bf16", "round_s_fp32", "trainer_vs_bare", "engine_vs_hf_generate", ...}``.
Run it alone (``/work/shared/tools/heavy``): it measures wall time on all cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from swarm_harness import SwarmNode, prepare_model, wait_ready

PRECISIONS = {  # name: (model.engine_dtype, model.autocast)
    "auto": ("auto", "auto"),
    "bf16": ("bfloat16", "true"),
    "fp32": ("float32", "false"),
}
PHASES = ("rollout", "gossip", "train", "sync", "round")


class DemoNode(SwarmNode):
    preset: ClassVar[str] = "demo"
    join_flags: ClassVar[tuple[str, ...]] = ("--linger", "0")  # rounds come from --set rounds=N


# ----- part 1: trainer and engine against bare transformers -----------------------------------


def _prompts(count: int) -> list[list[int]]:
    from hivespec.node.config import load_config
    from hivespec.node.model.loader import load_tokenizer
    from hivespec.node.tasks.source import TaskSource

    tokenizer = load_tokenizer()
    tasks = TaskSource.from_config(load_config("demo", environ={}).tasks)
    return [tasks.chat_prompt_ids(tokenizer, task) for task in tasks.prompts(seed=1, round=0, count=count)]


def best_seconds(runs: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Each run's fastest of `repeats` timed calls, after one untimed call of each, in alternating order.

    A first call pays for what later ones reuse (kernels built for new shapes and dtypes, the
    optimizer's state, first-touched pages); timed, it would charge whichever side ran first
    in the process, and `--quick` times one call a side.
    """
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, float("inf"))
    names = list(runs)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            start = clock()
            runs[name]()
            best[name] = min(best[name], clock() - start)
    return best


def engine_vs_generate(model, dtype, prompts: list[list[int]], batch: int, new_tokens: int, repeats: int) -> dict:
    """Best tokens/s of TorchEngine.generate and of model.generate on the same left-padded batch, dtype and length."""
    import torch

    from hivespec.node.model.engine import GenerationRequest, SamplingParams, TorchEngine

    engine_model = model.to(dtype).eval().requires_grad_(False)
    engine = TorchEngine(engine_model, max_batch_size=batch)
    requests = [GenerationRequest(tuple(prompts[i % len(prompts)]), seed=3, sample_index=i) for i in range(batch)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, stop_token_ids=())
    width = max(len(r.prompt_ids) for r in requests)
    input_ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, r in enumerate(requests):
        input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids):] = 1
    tokens = batch * new_tokens

    def ours() -> None:
        samples = engine.generate(requests, params)
        assert sum(len(s.completion_ids) for s in samples) == tokens

    def hf() -> None:
        with torch.inference_mode():
            out = engine_model.generate(
                input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
            )
        assert out.shape[1] == width + new_tokens

    best = best_seconds({"engine": ours, "hf": hf}, repeats)
    best_engine, best_hf = best["engine"], best["hf"]
    return {
        "batch": batch, "new_tokens": new_tokens, "dtype": str(dtype).removeprefix("torch."),
        "engine_tokens_per_s": round(tokens / best_engine, 1), "hf_generate_tokens_per_s": round(tokens / best_hf, 1),
        "engine_vs_hf_generate": round(best_hf / best_engine, 3),
    }


def _head_matmul():
    """``hidden @ weight.T`` in float32 whose backward matmuls run in ``grad_dtype``: the trainer's head, in plain torch."""
    import torch

    class HeadMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, grad_dtype):
            ctx.save_for_backward(hidden, weight)
            ctx.grad_dtype = grad_dtype
            return hidden @ weight.T

        @staticmethod
        def backward(ctx, grad):
            hidden, weight = ctx.saved_tensors
            dtype = ctx.grad_dtype or grad.dtype
            grad = grad.to(dtype)
            return (grad @ weight.to(dtype)).to(hidden.dtype), (grad.T @ hidden.to(dtype)).to(weight.dtype), None

    return HeadMatmul.apply


def trainer_vs_bare(model, autocast, samples, micro_batch: int, repeats: int) -> dict:
    """Best seconds of Trainer.step and of a bare step (backbone, head, cross entropy, backward, AdamW) on the same tokens.

    The bare step runs in the trainer's dtypes, read from the `Trainer` itself: its autocast for
    the backbone, float32 for the head's forward and the autocast dtype for the head's backward.
    """
    import torch
    import torch.nn.functional as F

    from hivespec.node.training.trainer import Trainer

    trainer = Trainer(model, learning_rate=1e-7, micro_batch_size=micro_batch, autocast_dtype=autocast)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-7)
    backbone = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings().weight
    head_matmul = _head_matmul()
    dtype, device = trainer.autocast_dtype, trainer.device  # the trainer's, whatever it was given
    ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.completion_ids))  # the trainer's batching
    batches = []
    for start in range(0, len(ordered), micro_batch):
        chunk = ordered[start:start + micro_batch]
        width = max(len(s.prompt_ids) + len(s.completion_ids) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        rows, cols, targets = [], [], []
        for row, s in enumerate(chunk):
            tokens = list(s.prompt_ids) + list(s.completion_ids)
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(tokens)] = 1
            for col in range(len(s.prompt_ids), len(tokens)):  # the position before each completion token predicts it
                rows.append(row)
                cols.append(col - 1)
                targets.append(tokens[col])
        batches.append((ids.to(device), mask.to(device), *(torch.tensor(v, device=device) for v in (rows, cols, targets))))

    def bare_step() -> None:
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for ids, mask, rows, cols, targets in batches:
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                hidden = backbone(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]
            logits = head_matmul(hidden.float(), head, dtype)  # float32 forward, outside autocast
            F.cross_entropy(logits, targets).backward()
        optimizer.step()
        model.eval()

    def trainer_step() -> None:
        stats = trainer.step(samples)
        assert stats.trained_samples == len(samples), stats

    best = best_seconds({"trainer": trainer_step, "bare": bare_step}, repeats)
    best_trainer, best_bare = best["trainer"], best["bare"]
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    return {
        "samples": len(samples), "tokens": tokens, "micro_batch": micro_batch,
        "autocast": str(dtype).removeprefix("torch.") if dtype is not None else "off",
        "head": f"float32 forward, {str(dtype or torch.float32).removeprefix('torch.')} backward (trainer and bare alike)",
        "trainer_step_s": round(best_trainer, 3), "bare_step_s": round(best_bare, 3),
        "trainer_vs_bare": round(best_trainer / best_bare, 3),
    }


def kernel_comparison(args: argparse.Namespace, batch: int, threads: int) -> dict:
    """Part 1, at the precision auto picks here; the parent frees the model before the swarms start."""
    from hivespec.node.model.engine import GenerationRequest, SamplingParams, TorchEngine
    from hivespec.node.model.loader import configure_threads, load_model
    from hivespec.node.model.precision import resolve_precision, train_rows, weight_sample
    from hivespec.node.training.trainer import TrainSample

    configure_threads(threads)
    model = load_model()
    plan = resolve_precision(  # what a demo node decides (the same cache entries)
        model.config, engine_dtype="auto", autocast="auto", train_dtype="float32", device="cpu",
        batch=batch, rows=train_rows(8, args.max_new_tokens), threads=threads,
        new_tokens=args.max_new_tokens, sequences=batch, learning_rate=args.learning_rate, weights=weight_sample(model),
        model=model,
    )
    print(f"precision auto at {threads} thread(s): {plan.describe()}", flush=True)
    prompts = _prompts(max(1, batch // 4))
    # Real completions to train on: the policy's own samples, with rewards 0/1 alternating in each
    # group so every sample has an advantage and the trainer runs backward on all of them.
    sampler = TorchEngine(model.eval(), max_batch_size=batch)
    requests = [GenerationRequest(tuple(prompts[i // 4 % len(prompts)]), seed=5, sample_index=i) for i in range(args.train_samples)]
    drawn = sampler.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens))
    samples = [
        TrainSample(s.prompt_ids, s.completion_ids, s.logprobs, reward=float(i % 2), group=str(i // 4))
        for i, s in enumerate(drawn)
    ]
    train = trainer_vs_bare(model.requires_grad_(True), plan.trainer.dtype, samples, 8, args.repeats)
    print(f"trainer vs bare: {json.dumps(train)}", flush=True)
    engine = engine_vs_generate(model, plan.engine.dtype, prompts, batch, args.max_new_tokens, args.repeats)
    print(f"engine vs model.generate: {json.dumps(engine)}", flush=True)
    del model, sampler
    gc.collect()
    return {"precision": plan.describe(), "trainer": train, "engine": engine}


# ----- part 2: the demo round per precision ------------------------------------------------------


def node_sets(args: argparse.Namespace, precision: str, index: int) -> list[str]:
    engine_dtype, autocast = PRECISIONS[precision]
    sets = [
        f"model.engine_dtype={engine_dtype}", f"model.autocast={autocast}", f"rounds={args.rounds}", f"seed={1000 + index}",
        f"swarm.swarm=round-time-{precision}", f"swarm.expected_peers={args.nodes - 1}", "status.enabled=false",
        f"speculation.enabled={'true' if args.speculation else 'false'}",
    ]
    if args.quick:
        sets += [f"rollout.prompts_per_round={args.prompts}", f"rollout.num_generations={args.generations}",
                 f"rollout.max_completion_length={args.max_new_tokens}"]
    return sets


def run_swarm(args: argparse.Namespace, precision: str, root: Path) -> dict:
    """Start the nodes with one precision setting, wait for their rounds, return per-phase means and auto's reason."""
    folder = root / precision
    nodes = [DemoNode(f"node-{i}", folder / f"node-{i}", node_sets(args, precision, i), local_nodes=args.nodes)
             for i in range(args.nodes)]
    started = time.monotonic()
    nodes[0].start([])
    first = wait_ready(nodes[0], timeout=args.timeout)
    for node in nodes[1:]:
        node.start(first)
    try:
        for node in nodes[1:]:
            wait_ready(node, timeout=args.timeout)
        ready_s = time.monotonic() - started
        deadline = time.monotonic() + args.timeout
        while any(n.alive() for n in nodes) and time.monotonic() < deadline:
            for node in nodes:
                for event in node.poll():
                    if event["event"] == "round":
                        s = event.get("seconds", {})
                        print(f"  {precision} {node.name} round {event['round']}: "
                              + " ".join(f"{p} {s.get(p, 0):.1f}s" for p in PHASES), flush=True)
            time.sleep(0.5)
        for node in nodes:
            node.poll()
    finally:
        for node in nodes:
            node.stop(timeout=30)
    rounds = {node.name: node.rounds() for node in nodes}
    missing = [name for name, r in rounds.items() if len(r) < args.rounds]
    if missing:
        tail = nodes[0].log_text()[-2000:]
        raise RuntimeError(f"{precision}: {missing} finished fewer than {args.rounds} rounds in {args.timeout:.0f} s:\n{tail}")
    steady = [e for r in rounds.values() for e in r if e["round"] >= 1] or [e for r in rounds.values() for e in r]
    first_round = [e for r in rounds.values() for e in r if e["round"] == 0]

    def mean(events: list[dict], phase: str) -> float:
        return round(sum(e["seconds"].get(phase, 0.0) for e in events) / len(events), 2)

    chosen = next((e.get("precision", "") for e in nodes[0].events if e["event"] == "ready"), "")
    return {
        "ready_s": round(ready_s, 1),
        "phases": {p: mean(steady, p) for p in PHASES},
        "first_round": {p: mean(first_round, p) for p in PHASES},
        "accepted": [sum(e["accepted"] for e in r) for r in rounds.values()],
        "chosen": chosen,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 nodes, 1 prompt x 4 completions x 16 tokens, 1 round per setting (< 3 min)")
    parser.add_argument("--nodes", type=int, default=None, help="nodes per swarm (default 3, the demo's; --quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per setting (default 2; --quick 1)")
    parser.add_argument("--precisions", default="auto,bf16,fp32", help="settings to run, comma-separated")
    parser.add_argument("--speculation", action="store_true", help="keep speculative rollouts on (off by default)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per swarm before giving up")
    parser.add_argument("--workdir", default=None, help="folder for the nodes' homes and logs (default: a temp dir, removed)")
    parser.add_argument("--kernels-only", action="store_true", help="part 1 only (trainer and engine against bare transformers)")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 2)
    # --quick: 2 nodes, one core each (3 on 2 cores queue for the CPU, which makes every phase longer).
    args.nodes = args.nodes or (2 if args.quick else 3)
    # --quick shrinks the round's work; the full run is the demo preset as shipped (4 x 4 x 48).
    args.prompts, args.generations, args.max_new_tokens = (1, 4, 16) if args.quick else (4, 4, 48)
    args.train_samples = 8 if args.quick else 16
    from hivespec.node.config import load_config

    args.learning_rate = load_config("demo", environ={}).train.learning_rate
    args.repeats = 1 if args.quick else 2
    threads = max(1, (os.cpu_count() or 1) // args.nodes)  # what each demo node gets
    batch = args.prompts * args.generations

    import torch

    from hivespec.node.model.precision import cpu_facts

    facts = cpu_facts()
    print(f"machine: {facts['cpu']}, torch {torch.__version__} capability {facts['capability']}, "
          f"native bf16 flags {facts['native_bf16_flags'] or 'none'}, {os.cpu_count()} cores, {threads} thread(s) per node", flush=True)
    started = time.perf_counter()
    prepare_model()
    kernels = kernel_comparison(args, batch, threads)

    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="round-time-"))
    swarms = {}
    try:
        for precision in [] if args.kernels_only else args.precisions.split(","):
            print(f"swarm {precision}: {args.nodes} nodes, {args.rounds} round(s)", flush=True)
            swarms[precision] = run_swarm(args, precision, root)
            print(f"swarm {precision}: {json.dumps(swarms[precision])}", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)

    if swarms:
        print(f"\nper-phase seconds (mean of {args.nodes} nodes, {'rounds >= 1' if args.rounds > 1 else 'round 0'}):")
        print(f"{'precision':<10}" + "".join(f"{p:>10}" for p in PHASES))
    for precision, result in swarms.items():
        print(f"{precision:<10}" + "".join(f"{result['phases'][p]:>10.1f}" for p in PHASES))
    if "auto" in swarms:
        print(f"auto chose: {swarms['auto']['chosen']}")
    result = {
        "round_s_auto": swarms.get("auto", {}).get("phases", {}).get("round"),
        "round_s_bf16": swarms.get("bf16", {}).get("phases", {}).get("round"),
        "round_s_fp32": swarms.get("fp32", {}).get("phases", {}).get("round"),
        "trainer_vs_bare": kernels["trainer"]["trainer_vs_bare"],
        "engine_vs_hf_generate": kernels["engine"]["engine_vs_hf_generate"],
        "phases": {p: r["phases"] for p, r in swarms.items()},
        "auto_chose": swarms.get("auto", {}).get("chosen", kernels["precision"]),
        "cpu": facts["cpu"], "capability": facts["capability"], "native_bf16_flags": facts["native_bf16_flags"],
        "torch": torch.__version__, "nodes": args.nodes, "threads_per_node": threads, "quick": args.quick,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
