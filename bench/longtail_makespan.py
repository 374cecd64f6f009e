"""Long-tail rollout makespan: plain vs uniform speculation budget vs the length-aware policy, same seeds.

Workload (chosen to have the long tail DAS targets, and said plainly): one rollout group is a
batch of requests decoded in one engine call, as a node decodes its round. Each group mixes
one-line factual questions ("What is the capital of France?", which the instruct model answers
in a sentence; arithmetic with "answer with only the number" was tried first and rambled to a
median of ~90 tokens), GSM8K-style word problems (a few sentences of working) and a few
enumeration prompts whose completions run long and repeat ("count from 1 to 80", "list the
multiples of 7", ...), each sampled `--generations` times at temperature 1.0 with the
embedded model. Completion lengths then have a long tail
(the bench prints p50, p99 and their ratio; the target workload has p99/p50 >= 5): the few long
rows set the makespan, the batch shrinks as the short rows stop, and the long rows decode the
tail alone. That the long outputs are enumerations (easy to draft from their own history) is
the favourable case for a suffix drafter; RL reasoning traces repeat less. Lengths come from
the prompts' history the way a node's do: epoch 0 is decoded plainly and feeds the drafter,
so the length-aware policy knows which prompts run long.

Every later epoch decodes the same requests (same seeds) three ways, side by side, in an order
that rotates every epoch (plain/uniform/length-aware, uniform/length-aware/plain, ...) so load
from other processes on the box falls on every mode alike; then the plain outputs feed the
drafter. Makespan = wall time of the group's engine call. The uniform mode drafts up to
`--budget` tokens for every row at every step (`UniformPolicy`); the length-aware mode is the
node's `LengthAwarePolicy` on the calibrated verify-cost curve (cached per device/dtype/threads).

    python bench/longtail_makespan.py --quick
    python bench/longtail_makespan.py --epochs 4 --groups 2

Ends with ``RESULT {json}``: vs_plain and vs_uniform (length-aware makespan / the other's,
summed over timed groups; target <= 0.65 and <= 0.90), identical_fraction (sequences identical
in all three modes), plus per-mode forwards and the workload's length tail.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence

import torch

from hivespec.node.model.loader import (
    EMBEDDED_MODEL,
    configure_threads,
    load_model,
    load_tokenizer,
)
from hivespec.node.tasks import GSM_MINI_PATH, TaskSource
from hivespec.node.tasks.base import Task
from hivespec.node.tasks.source import chat_prompt_ids

MODES = ("plain", "uniform", "length-aware")

SHORT_QUESTIONS = (
    "What is the capital of France?",
    "What color is the sky on a clear day?",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
    "What is the largest planet in our solar system?",
    "Which animal is known as the king of the jungle?",
    "What do bees make?",
    "What is frozen water called?",
)

# Long, repetitive completions: the tail.
LONG_QUESTIONS = (
    "Count from 1 to 80, writing the numbers separated by commas.",
    "List the first 40 multiples of 7, separated by commas.",
    "Write the numbers from 150 down to 100, one per line.",
    "Write the sentence 'The quick brown fox jumps over the lazy dog.' ten times, one per line.",
    "Write the English alphabet in capital letters, with a comma between letters, three times.",
    "List the even numbers from 2 to 120, separated by commas.",
)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one group of 12 requests, two timed epochs, 160 new tokens (a few minutes on 2 idle cores)")
    parser.add_argument("--groups", type=int, help="rollout groups (engine calls) per epoch (default 2, quick 1)")
    parser.add_argument("--epochs", type=int, help="epochs incl. the warm-up one (default 4, quick 3)")
    parser.add_argument("--short", type=int, default=4, help="short-answer prompts per group")
    parser.add_argument("--medium", type=int, help="word problems per group (default 2, quick 1)")
    parser.add_argument("--long", type=int, default=1, help="enumeration prompts per group")
    parser.add_argument("--generations", type=int, default=2, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, help="default 320, quick 160")
    parser.add_argument("--budget", type=int, default=16, help="max draft tokens per step (uniform: every row; length-aware: long rows)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.groups = args.groups or (1 if args.quick else 2)
    args.epochs = args.epochs or (3 if args.quick else 4)
    args.max_new_tokens = args.max_new_tokens or (160 if args.quick else 320)
    args.medium = args.medium if args.medium is not None else (1 if args.quick else 2)
    if args.epochs < 2:
        parser.error("--epochs must be >= 2: the first one only warms the drafter")
    return args


def _groups(args: argparse.Namespace, tokenizer) -> list[list[tuple[tuple[int, ...], str]]]:
    """Each group's (prompt token ids, kind): short, medium and long prompts, shuffled (fixed by --seed)."""
    rng = random.Random(args.seed)
    jsonl = TaskSource([("jsonl", 1, 1.0)], jsonl_path=GSM_MINI_PATH).families["jsonl"]
    groups = []
    for g in range(args.groups):
        tasks = []
        for i in range(args.short):
            question = SHORT_QUESTIONS[(g * args.short + i) % len(SHORT_QUESTIONS)]
            tasks.append(Task(f"short:{g}:{i}", "short", question, ""))
        for i in range(args.medium):
            tasks.append(jsonl.make(g * args.medium + i, 1))  # type: ignore[attr-defined]
        for i in range(args.long):
            question = LONG_QUESTIONS[(g * args.long + i) % len(LONG_QUESTIONS)]
            tasks.append(Task(f"long:{g}:{i}", "long", question, ""))
        rng.shuffle(tasks)
        groups.append([(tuple(chat_prompt_ids(tokenizer, task)), task.family) for task in tasks])
    return groups


def _percentile(values: Sequence[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]) if ordered else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    threads = configure_threads(args.threads)
    from hivespec.node.model.engine import (
        GenerationRequest,
        SamplingParams,
        SpeculationStats,
        TorchEngine,
    )
    from hivespec.node.speculation.curve import device_verify_cost
    from hivespec.node.speculation.drafter import SuffixDrafter
    from hivespec.node.speculation.policy import LengthAwarePolicy, UniformPolicy

    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=getattr(torch, args.dtype)).requires_grad_(False)
    groups = _groups(args, tokenizer)
    batch = max(len(g) for g in groups) * args.generations
    params = SamplingParams(args.temperature, 1.0, args.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))

    plain_engine = TorchEngine(model, max_batch_size=batch)
    mark = time.perf_counter()
    curve = device_verify_cost(plain_engine, model.config, args.dtype, "cpu", batch)
    print(f"model {args.model} {args.dtype}, {threads} threads; {args.groups} group(s) of {batch} requests "
          f"({args.short} short + {args.medium} medium + {args.long} long prompts x {args.generations}), "
          f"max_new_tokens {args.max_new_tokens}, T={args.temperature}; verify cost ready in {time.perf_counter() - mark:.1f}s")
    for b in curve.batches:
        print(f"  B={b:<3} T(k+1)/T(1) for k=1,2,4,8,16: " + " ".join(f"{curve.ratio(b, k + 1):.2f}" for k in (1, 2, 4, 8, 16)))

    drafter = SuffixDrafter()
    engines = {
        "plain": plain_engine,
        "uniform": TorchEngine(model, max_batch_size=batch, drafter=drafter, policy=UniformPolicy(args.budget)),
        "length-aware": TorchEngine(
            model, max_batch_size=batch, drafter=drafter, policy=LengthAwarePolicy(curve, drafter, max_budget=args.budget)
        ),
    }

    def requests(group: int, epoch: int) -> list[GenerationRequest]:
        prompts = groups[group]
        return [
            GenerationRequest(prompt, seed=args.seed * 1000 + epoch, sample_index=p * args.generations + k)
            for p, (prompt, _) in enumerate(prompts)
            for k in range(args.generations)
        ]

    lengths: list[int] = []
    by_kind: dict[str, list[int]] = {}
    mark = time.perf_counter()
    for group in range(args.groups):
        kinds = [kind for _, kind in groups[group] for _ in range(args.generations)]
        for sample, kind in zip(plain_engine.generate(requests(group, 0), params), kinds, strict=True):
            drafter.observe(sample.prompt_ids, sample.completion_ids)
            lengths.append(len(sample.completion_ids))
            by_kind.setdefault(kind, []).append(len(sample.completion_ids))
    print(f"warm-up epoch (plain, feeds the drafter): {sum(lengths)} tokens in {time.perf_counter() - mark:.1f}s; lengths by kind: "
          + ", ".join(f"{kind} {sorted(v)}" for kind, v in sorted(by_kind.items())), flush=True)

    wall = dict.fromkeys(MODES, 0.0)
    totals = {mode: SpeculationStats() for mode in MODES}
    identical = sequences = 0
    print(f"{'epoch':>5} {'group':>5} {'tokens':>6} {'p50':>5} {'p99':>5} " + " ".join(f"{m + ' s':>15}" for m in MODES)
          + f" {'la/plain':>8} {'la/unif':>8} {'same':>5}")
    turn = 0
    for epoch in range(1, args.epochs):
        for group in range(args.groups):
            group_requests = requests(group, epoch)
            order = MODES[turn % 3 :] + MODES[: turn % 3]
            turn += 1
            outputs, seconds = {}, {}
            for mode in order:
                stats = SpeculationStats()
                start = time.perf_counter()
                outputs[mode] = engines[mode].generate(group_requests, params, stats=stats)
                seconds[mode] = time.perf_counter() - start
                wall[mode] += seconds[mode]
                totals[mode].add(stats)
            plain = outputs["plain"]
            same = sum(
                a.completion_ids == b.completion_ids == c.completion_ids
                for a, b, c in zip(plain, outputs["uniform"], outputs["length-aware"], strict=True)
            )
            identical += same
            sequences += len(plain)
            group_lengths = [len(s.completion_ids) for s in plain]
            lengths += group_lengths
            for sample in plain:
                drafter.observe(sample.prompt_ids, sample.completion_ids)
            print(
                f"{epoch:>5} {group:>5} {sum(group_lengths):>6} {_percentile(group_lengths, 0.5):>5.0f} "
                f"{_percentile(group_lengths, 0.99):>5.0f} " + " ".join(f"{seconds[m]:>15.2f}" for m in MODES)
                + f" {seconds['length-aware'] / seconds['plain']:>8.3f} {seconds['length-aware'] / seconds['uniform']:>8.3f} "
                f"{same:>2}/{len(plain):<2}",
                flush=True,
            )

    p50, p99 = _percentile(lengths, 0.5), _percentile(lengths, 0.99)
    for mode in MODES:
        t = totals[mode]
        print(
            f"{mode:>12}: makespan {wall[mode]:7.2f}s  batch forwards {t.batch_forwards:5d}  tokens/forward "
            f"{t.tokens_per_forward:5.2f}  drafted {t.drafted:6d} accepted {t.accepted:6d}  draft {t.draft_seconds:5.2f}s"
        )
    result = {
        "vs_plain": round(wall["length-aware"] / wall["plain"], 4),
        "vs_uniform": round(wall["length-aware"] / wall["uniform"], 4),
        "identical_fraction": round(identical / sequences, 4),
        "uniform_vs_plain": round(wall["uniform"] / wall["plain"], 4),
        "makespan_seconds": {mode: round(wall[mode], 2) for mode in MODES},
        "batch_forwards": {mode: totals[mode].batch_forwards for mode in MODES},
        "tokens_per_forward": {mode: round(totals[mode].tokens_per_forward, 3) for mode in MODES},
        "acceptance": {mode: round(totals[mode].acceptance_rate, 4) for mode in ("uniform", "length-aware")},
        "length_p50": p50,
        "length_p99": p99,
        "tail_ratio": round(p99 / p50, 2) if p50 else None,
        "sequences": sequences,
        "batch_size": batch,
        "budget": args.budget,
        "model": args.model,
        "dtype": args.dtype,
        "threads": threads,
        "temperature": args.temperature,
    }
    print(
        f"length-aware makespan: {result['vs_plain']:.3f}x plain (target <= 0.65), {result['vs_uniform']:.3f}x uniform "
        f"(target <= 0.90); identical {identical}/{sequences}; lengths p50 {p50:.0f}, p99 {p99:.0f} (ratio {result['tail_ratio']})"
    )
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
