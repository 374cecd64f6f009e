"""Training on foreign samples: filtered TIS step cost vs a plain step, and ESS/n of samples k policy versions old.

Two measurements on the embedded SmolLM2-135M-Instruct (bf16 engine, fp32 trainer with bf16
autocast, as a node runs it):

1. Overhead. One trainer steps on one mixed batch (own rollouts plus the same number of rollouts
   labelled as two peers' samples) alternately with importance sampling on (the defaults: token
   truncation at C = 2, sequence mask on the geometric-mean ratio in [0.5, 2], per-peer stats)
   and off (RL Swarm's plain on-policy step: weight 1, no filter, no stats), in ABBA order, in
   this run. overhead = median CPU time (this process, all threads) of a TIS step / of a plain
   step - 1 (``overhead_wall``: the same in wall time). The CPU time of the IS code inside the
   TIS steps is also measured (``overhead_attributed``); the load of a shared machine blurs it less.
2. ESS/n. Policy A (version 0) samples a batch with its engine. A copy B of A is trained k steps
   (GRPO on its own fresh rollouts, the node's learning rate), then B's trainer scores A's batch:
   those are foreign samples k versions old. Reported for k = 1 and k = 4 under each correction:
   none (raw ratios), token TIS, token mask, sequence mask (+ TIS, the default).

    python bench/foreign_tis.py            # 6 prompts x 4 completions x 48 tokens, 4 + 4 timed steps
    python bench/foreign_tis.py --quick    # 4 x 4 x 24, 2 + 2 timed steps

Ends with ``RESULT {json}`` with keys overhead, ess_frac_k1, ess_frac_k4 (filtered ESS/n of the
default settings, masked tokens counted at weight 0) and more.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Sequence

import torch

from hivespec.kernels.importance import importance_weights
from hivespec.node.model.engine import GenerationRequest, SamplingParams, TorchEngine
from hivespec.node.model.loader import (
    EMBEDDED_MODEL,
    configure_threads,
    load_model,
    load_tokenizer,
)
from hivespec.node.tasks.source import TaskSource
from hivespec.node.training.trainer import OWN, ImportanceSettings, Trainer, TrainSample

PLAIN = ImportanceSettings(enabled=False)
DEFAULT = ImportanceSettings()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts, shorter completions, fewer timed steps")
    parser.add_argument("--model", default=EMBEDDED_MODEL, help="model name ('tiny' for a smoke run)")
    parser.add_argument("--prompts", type=int, help="prompts per batch (default 6, quick 4)")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, help="default 48, quick 24")
    parser.add_argument("--repeats", type=int, help="timed steps per mode (default 4, quick 2)")
    parser.add_argument("--learning-rate", type=float, default=2e-5, help="the node default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (4 if args.quick else 6)
    args.max_new_tokens = args.max_new_tokens or (24 if args.quick else 48)
    args.repeats = args.repeats or (2 if args.quick else 4)
    return args


class _Policy:
    """A trainer model with its bf16 engine copy, kept equal to the trainer after every step."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace, tokenizer, tasks: TaskSource) -> None:
        self.model = model
        self.engine_model = copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)
        self.engine = TorchEngine(self.engine_model, max_batch_size=16)
        self.trainer = Trainer(model, learning_rate=args.learning_rate, micro_batch_size=8, flat_sample_stats=True)  # ESS of every sample
        self.args, self.tokenizer, self.tasks = args, tokenizer, tasks
        eos = tokenizer.eos_token_id
        self.sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=(eos,))

    def rollouts(self, round_index: int, source: str = OWN) -> list[TrainSample]:
        tasks = self.tasks.prompts(seed=self.args.seed, round=round_index, count=self.args.prompts)
        requests, owners = [], []
        for g, task in enumerate(tasks):
            prompt_ids = tuple(self.tasks.chat_prompt_ids(self.tokenizer, task))
            for i in range(self.args.generations):
                requests.append(GenerationRequest(prompt_ids, seed=1000 + round_index, sample_index=g * self.args.generations + i))
                owners.append(task)
        samples = self.engine.generate(requests, self.sampling)
        return [
            TrainSample(s.prompt_ids, s.completion_ids, s.logprobs,
                        self.tasks.reward(task, self.tokenizer.decode(s.completion_ids, skip_special_tokens=True)),
                        f"{source}:{task.prompt_id}", source)
            for s, task in zip(samples, owners)
        ]

    def sync(self) -> None:
        with torch.no_grad():
            trained = dict(self.model.named_parameters())
            for name, param in self.engine_model.named_parameters():
                param.copy_(trained[name].to(param.dtype))


def _ess(log_ratio: torch.Tensor) -> float:
    w = torch.exp(log_ratio.double())
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))


def _correction_table(trainer: Trainer, foreign: list[TrainSample]) -> dict[str, dict]:
    """ESS/n and kept fraction of the foreign batch under each correction, scored by ``trainer``."""
    logp = torch.tensor([v for row in trainer.logprobs(foreign) for v in row])
    behaviour = torch.tensor([v for s in foreign for v in s.behaviour_logprobs], dtype=torch.float32)
    sequence_ids = torch.tensor([i for i, s in enumerate(foreign) for _ in s.completion_ids])
    valid = torch.ones_like(logp, dtype=torch.bool)
    table = {"none": {"ess_fraction": _ess(logp - behaviour), "kept_fraction": 1.0, "mean_log_ratio": float((logp - behaviour).mean())}}
    modes = {
        "token_tis": {"clip": 2.0},
        "token_mask": {"clip": 2.0, "token_bounds": (0.5, 2.0)},
        "sequence_mask": {"clip": 2.0, "sequence_bounds": (0.5, 2.0)},
    }
    for name, kwargs in modes.items():
        stats = importance_weights(logp, behaviour, valid, sequence_ids=sequence_ids, **kwargs).stats()
        table[name] = {"ess_fraction": stats.ess_fraction, "kept_fraction": stats.kept_fraction,
                       "truncated_fraction": stats.truncated_fraction, "mean_weight": stats.mean_weight}
    return table


def _timed(trainer: Trainer, samples: list[TrainSample], settings: ImportanceSettings) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, CPU seconds in the importance code) of one step under ``settings``.

    CPU time (all of this process's threads) is what the step itself consumed; on a shared
    machine wall time also counts the time other processes held the cores.
    """
    trainer.importance = settings
    spent = [0.0]
    originals = {name: getattr(Trainer, name) for name in ("_weights", "_source_stats")}

    def timing(name):
        def wrapper(*a, **k):
            started = time.process_time()
            try:
                return originals[name](trainer, *a, **k)
            finally:
                spent[0] += time.process_time() - started
        return wrapper

    for name in originals:
        setattr(trainer, name, timing(name))
    cpu = time.process_time()
    try:
        stats = trainer.step(samples)
    finally:
        for name in originals:
            delattr(trainer, name)
    return stats.seconds, time.process_time() - cpu, spent[0]


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    configure_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model)
    tasks = TaskSource()
    base = load_model(args.model, dtype=torch.float32)
    policy_a = _Policy(base, args, tokenizer, tasks)

    started = time.perf_counter()
    old_batch = policy_a.rollouts(0, source="peer-old")
    tokens = sum(len(s.completion_ids) for s in old_batch)
    print(f"policy A sampled {len(old_batch)} completions, {tokens} tokens, reward mean "
          f"{statistics.mean(s.reward for s in old_batch):.2f} ({time.perf_counter() - started:.1f} s)")

    # ESS/n of A's samples under B = A + k steps.
    policy_b = _Policy(copy.deepcopy(base), args, tokenizer, tasks)
    tables = {}
    for k in range(1, 5):
        fresh = policy_b.rollouts(100 + k)
        step = policy_b.trainer.step(fresh)
        policy_b.sync()
        print(f"B step {k}: {step.trained_samples} trained samples, grad norm {step.grad_norm:.3f}, "
              f"own ESS/n {step.own.ess_fraction:.3f}, own mean weight {step.own.mean_weight:.4f}")
        if k in (1, 4):
            tables[k] = _correction_table(policy_b.trainer, old_batch)
    own_check = _correction_table(policy_a.trainer, [TrainSample(s.prompt_ids, s.completion_ids, s.behaviour_logprobs,
                                                                 s.reward, s.group, OWN) for s in old_batch])
    print("\nA's samples scored by          ESS/n: none  token_tis  token_mask  seq_mask(+TIS)   kept: token_mask  seq_mask")
    for label, table in (("A itself (bf16 engine numerics)", own_check), ("B = A + 1 step", tables[1]), ("B = A + 4 steps", tables[4])):
        print(f"  {label:<32} {table['none']['ess_fraction']:.3f}     {table['token_tis']['ess_fraction']:.3f}"
              f"      {table['token_mask']['ess_fraction']:.3f}       {table['sequence_mask']['ess_fraction']:.3f}"
              f"           {table['token_mask']['kept_fraction']:.3f}     {table['sequence_mask']['kept_fraction']:.3f}")

    # Overhead: one batch, own + two peers' samples, TIS and plain steps alternating.
    trainer = policy_a.trainer
    own = policy_a.rollouts(1)
    half = len(old_batch) // 2
    foreign = [TrainSample(s.prompt_ids, s.completion_ids, s.behaviour_logprobs, s.reward, s.group,
                           "peer-1" if i < half else "peer-2") for i, s in enumerate(old_batch)]
    batch = own + foreign
    trainer.step(batch)  # warm-up (allocator, autocast caches)
    runs: dict[str, list[tuple[float, float, float]]] = {"plain": [], "tis": []}
    for repeat in range(args.repeats):
        # ABBA order: a drift of the machine's load over the run hits both modes alike.
        order = ("plain", "tis") if repeat % 2 == 0 else ("tis", "plain")
        for mode in order:
            runs[mode].append(_timed(trainer, batch, PLAIN if mode == "plain" else DEFAULT))
    wall = {mode: statistics.median(r[0] for r in rs) for mode, rs in runs.items()}
    cpu = {mode: statistics.median(r[1] for r in rs) for mode, rs in runs.items()}
    inside = statistics.median(r[2] for r in runs["tis"])
    overhead = cpu["tis"] / cpu["plain"] - 1.0
    attributed = inside / cpu["tis"]
    print(f"\nstep on {len(batch)} samples ({sum(len(s.completion_ids) for s in batch)} completion tokens), "
          f"{args.repeats} of each, ABBA order (wall s / CPU s):")
    for mode in ("plain", "tis"):
        print(f"  {mode:<6} " + "  ".join(f"{w:.2f}/{c:.2f}" for w, c, _ in runs[mode])
              + f"   median {wall[mode]:.2f}/{cpu[mode]:.2f}")
    print(f"  overhead {overhead:+.2%} in CPU time, {wall['tis'] / wall['plain'] - 1.0:+.2%} in wall time; "
          f"importance code: {inside * 1000:.1f} ms CPU = {attributed:.3%} of the TIS step")
    result = {
        "overhead": round(overhead, 4),
        "overhead_wall": round(wall["tis"] / wall["plain"] - 1.0, 4),
        "overhead_attributed": round(attributed, 5),
        "ess_frac_k1": round(tables[1]["sequence_mask"]["ess_fraction"], 4),
        "ess_frac_k4": round(tables[4]["sequence_mask"]["ess_fraction"], 4),
        "raw_ess_frac_k1": round(tables[1]["none"]["ess_fraction"], 4),
        "raw_ess_frac_k4": round(tables[4]["none"]["ess_fraction"], 4),
        "kept_frac_k1": round(tables[1]["sequence_mask"]["kept_fraction"], 4),
        "kept_frac_k4": round(tables[4]["sequence_mask"]["kept_fraction"], 4),
        "own_engine_ess_frac": round(own_check["sequence_mask"]["ess_fraction"], 4),
        "model": args.model,
        "tokens_per_step": sum(len(s.completion_ids) for s in batch),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
