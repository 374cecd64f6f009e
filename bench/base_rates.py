"""Base success rate of the embedded model per task family and difficulty, at the RL sampling defaults.

GRPO learns only from groups whose rewards differ, so a useful difficulty is one where the
untrained model succeeds sometimes (roughly 10-60%). For each (family, difficulty) cell this
draws ``--prompts`` tasks and ``--generations`` completions of each (temperature 1.0, top_p 1.0),
scores them with the family's reward, and reports the success rate and the share of groups with
mixed rewards ("signal").

    python bench/base_rates.py --quick
    python bench/base_rates.py --cells arith:1 arith:2 count:1 --prompts 12 --generations 4
    python bench/base_rates.py --rg --prompts 8 --max-new-tokens 64 --dtype float32

reasoning-gym cells (``rg:<cell>``, needs ``pip install 'hivespec[rg]'``) are the candidate
datasets and configs of `RG_CELLS`; ``--rg`` measures all of them. Their reward is the rg
family's: the extracted final answer, all or nothing under reasoning-gym's scorer.

Ends with one line ``RESULT {json}``; rates are keyed like ``"arith:d1"`` or ``"rg:chain_sum"``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import torch

from hivespec.node.model.loader import EMBEDDED_MODEL, configure_threads, load_model, load_tokenizer, stop_token_ids
from hivespec.node.tasks import GSM_MINI_PATH, SYSTEM_PROMPT, MixEntry, Task, TaskSource

ALL_CELLS = [f"arith:{d}" for d in range(1, 7)] + [f"count:{d}" for d in range(1, 6)] + ["jsonl:1"]
QUICK_CELLS = ["arith:1", "arith:2", "arith:3", "count:1", "count:2", "jsonl:1"]
# reasoning-gym candidates for a small model: (dataset, config). Short questions with numeric
# answers; the configs pick the easy end of each generator.
RG_CELLS: dict[str, tuple[str, dict]] = {
    "chain_sum": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "basic_arithmetic": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                              "operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False}),
    "products": ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "leg_counting": ("leg_counting", {"min_animals": 1, "max_animals": 2, "max_instances": 2}),
    "letter_counting": ("letter_counting", {"min_words": 3, "max_words": 5}),
    "gcd": ("gcd", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 20}),
    "count_bits": ("count_bits", {"min_n": 1, "max_n": 31}),
    "aiw": ("aiw", {"max_entities": 4}),
    "chain_sum_3": ("chain_sum", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cells and samples (a few minutes on 2 cores)")
    parser.add_argument("--cells", nargs="+", help="family:difficulty cells, e.g. arith:1 count:2 jsonl:1, or rg:<RG_CELLS key>")
    parser.add_argument("--rg", action="store_true", help=f"the reasoning-gym cells: {', '.join(RG_CELLS)}")
    parser.add_argument("--prompts", type=int, help="prompts per cell (default 12, quick 6)")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (the GRPO group size)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--system-prompt", default=SYSTEM_PROMPT,
                        help="system prompt text (default: hivespec's choice, the chat template's own)")
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dump", help="write every completion with its reward to this JSONL file")
    args = parser.parse_args(argv)
    if args.prompts is None:
        args.prompts = 6 if args.quick else 12
    if args.cells is None:
        args.cells = [f"rg:{key}" for key in RG_CELLS] if args.rg else QUICK_CELLS if args.quick else ALL_CELLS
    return args


def _cell_tasks(cell: str, prompts: int, seed: int) -> tuple[TaskSource, list[Task]]:
    family, _, difficulty = cell.partition(":")
    if family == "rg":
        dataset, config = RG_CELLS[difficulty]
        source = TaskSource([MixEntry("rg", name=dataset, config=config)])
        return source, source.prompts(seed=seed, round=0, count=prompts)
    source = TaskSource([(family, int(difficulty), 1.0)], jsonl_path=GSM_MINI_PATH if family == "jsonl" else None)
    if family == "jsonl":
        # Cover the file in order instead of drawing with replacement from 20 lines.
        jsonl = source.families["jsonl"]
        return source, [jsonl.make(i, 1) for i in range(min(prompts, len(jsonl)))]  # type: ignore[arg-type]
    return source, source.prompts(seed=seed, round=0, count=prompts)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurement and print the table and the RESULT line."""
    args = _parse_args(argv)
    threads = configure_threads(args.threads)
    from hivespec.node.model.engine import GenerationRequest, SamplingParams, TorchEngine

    dtype = getattr(torch, args.dtype)
    tokenizer = load_tokenizer(args.model)
    started = time.perf_counter()
    model = load_model(args.model, dtype=dtype)
    print(f"model {args.model} {args.dtype} loaded in {time.perf_counter() - started:.2f}s, {threads} threads", flush=True)
    engine = TorchEngine(model, max_batch_size=args.batch_size)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=stop_token_ids(tokenizer, model.generation_config),
    )
    system_prompt = args.system_prompt
    dump = open(args.dump, "w") if args.dump else None  # noqa: SIM115 - closed below

    rates: dict[str, float] = {}
    signal: dict[str, float] = {}
    counts: dict[str, int] = {}
    total_tokens = 0
    bench_started = time.perf_counter()
    print(f"{'cell':<22} {'n':>4} {'rate':>6} {'signal':>7} {'tokens':>7} {'s':>6}", flush=True)
    for cell_index, cell in enumerate(args.cells):
        cell_started = time.perf_counter()
        source, tasks = _cell_tasks(cell, args.prompts, args.seed)
        source.system_prompt = system_prompt
        requests = [
            GenerationRequest(tuple(source.chat_prompt_ids(tokenizer, task)), seed=args.seed * 1000 + cell_index, sample_index=p * args.generations + g)
            for p, task in enumerate(tasks)
            for g in range(args.generations)
        ]
        samples = engine.generate(requests, params)
        rewards = []
        for request, sample in zip(requests, samples, strict=True):
            task = tasks[request.sample_index // args.generations]
            text = tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
            reward = source.reward(task, text)
            rewards.append(reward)
            total_tokens += len(sample.completion_ids)
            if dump is not None:
                dump.write(json.dumps({"cell": cell, "prompt_id": task.prompt_id, "answer": task.answer, "reward": reward, "completion": text}) + "\n")
        groups = [rewards[i : i + args.generations] for i in range(0, len(rewards), args.generations)]
        key = cell if cell.startswith("rg:") else cell.replace(":", ":d")
        rates[key] = round(sum(rewards) / len(rewards), 3)
        signal[key] = round(sum(1 for g in groups if 0 < sum(g) < len(g)) / len(groups), 3)
        counts[key] = len(rewards)
        tokens = sum(len(s.completion_ids) for s in samples)
        print(f"{key:<22} {len(rewards):>4} {rates[key]:>6.3f} {signal[key]:>7.3f} {tokens:>7} {time.perf_counter() - cell_started:>6.1f}", flush=True)
    if dump is not None:
        dump.close()

    seconds = time.perf_counter() - bench_started
    result = {
        "rates": rates,
        "signal": signal,
        "samples": counts,
        "system_prompt": system_prompt,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "dtype": args.dtype,
        "threads": threads,
        "tokens_per_s": round(total_tokens / seconds, 1),
        "seconds": round(seconds, 1),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
