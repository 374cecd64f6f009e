"""The verify-cost calibration against the engine's real speculative steps, at the demo's rollout shape.

A node decides where drafting pays from its verify-cost curve T(B, W) / T(B, 1), timed once per
machine with `TorchEngine.time_forwards` over a short cache of random tokens. This bench asks
whether that curve prices what the engine really pays: for each batch B (groups of the demo's 4
completions of a task prompt, 48 new tokens, temperature 1), it times the calibration (over a
`CALIBRATION_CONTEXT`-token cache and over a prompt-length one) and then, side by side on the same
requests and seeds, plain decoding against the speculative engine drafting exactly W - 1 tokens every
step (`UniformPolicy`, drafter fed the earlier rounds' completions), with no drafts at all (the
speculative path's own overhead), and as a node drafts: `LengthAwarePolicy` on the curve the node's
calibration measures here (`calibration_timer`), which drafts only where it expects a gain. Rounds alternate the order of the settings; the first round only
warms up. Everything alone on the machine, please (`../shared/tools/heavy`).

    python bench/verify_cost.py [--quick] [--batches 1 4 16] [--dtype bfloat16] [--attention eager] [--threads 1]

Ends with one line `RESULT {json}`: per batch, `calibrated` (W: ratio at the calibration's context),
`calibrated_long` (at --long-context), `real_per_forward` (W: a speculative step's seconds over a plain
step's), `real_per_token` (W: seconds per emitted token over plain decoding's), `no_drafts_per_token`,
`length_aware_per_token` and `length_aware_tokens_per_forward` (the node's policy), and `where_drafting_pays`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 timed rounds and batches 1 and 16")
    parser.add_argument("--batches", type=int, nargs="+", help="rows decoded together (default 1 4 16; quick 1 16)")
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 3], help="tokens a speculative step feeds per row")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per batch (quick: 3)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--attention", default="eager", choices=["eager", "sdpa"], help="the engine's attention (auto picks per machine)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a demo node on 2 cores gets 1)")
    parser.add_argument("--long-context", type=int, default=96, help="cache length of the second calibration (a prompt and answer)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args(argv)
    batches = args.batches or ([1, 16] if args.quick else [1, 4, 16])
    rounds = 3 if args.quick else args.rounds
    if any(b > 4 and b % 4 for b in batches):
        parser.error("a batch above 4 must be whole groups of 4 completions")

    import torch

    from hivespec.node.config import load_config
    from hivespec.node.model.engine import GenerationRequest, SamplingParams, SpeculationStats, TorchEngine
    from hivespec.node.model.loader import configure_threads, load_model, load_tokenizer
    from hivespec.node.model.precision import cpu_facts
    from hivespec.node.speculation.curve import CALIBRATION_CONTEXT, calibrate_verify_cost, calibration_batches
    from hivespec.node.speculation.drafter import SuffixDrafter
    from hivespec.node.speculation.policy import LengthAwarePolicy, UniformPolicy, calibration_timer, where_drafting_pays
    from hivespec.node.tasks.source import TaskSource

    configure_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=getattr(torch, args.dtype)).requires_grad_(False)
    model.set_attn_implementation(args.attention)
    tasks = TaskSource.from_config(load_config("demo").tasks)
    params = SamplingParams(1.0, 1.0, 48, stop_token_ids=(tokenizer.eos_token_id,))
    widths = sorted(set(args.widths))
    plain = TorchEngine(model, max_batch_size=max(batches))
    print(f"{args.model} {args.dtype}, {args.attention} attention, {args.threads} thread(s); {cpu_facts()['cpu']}", flush=True)
    curve = calibrate_verify_cost(calibration_timer(plain), batches=calibration_batches(max(batches)))
    verdict = where_drafting_pays(LengthAwarePolicy(curve, SuffixDrafter()))
    print(f"the node's calibration here: {verdict}", flush=True)

    def ratios(batch: int, context: int) -> dict[str, float]:
        seconds = plain.time_forwards(batch, [1, *widths], context=context, rounds=3)
        return {str(w): round(s / seconds[0], 3) for w, s in zip(widths, seconds[1:], strict=True)}

    result: dict[str, dict] = {}
    for batch in batches:
        groups, per_group = max(1, batch // 4), min(batch, 4)
        drafters = {w: SuffixDrafter() for w in widths}
        engines = {"plain": (plain, None), "no drafts": (TorchEngine(model, max_batch_size=batch, drafter=SuffixDrafter(), policy=UniformPolicy(0)), None)}
        engines |= {f"W{w}": (TorchEngine(model, max_batch_size=batch, drafter=drafters[w], policy=UniformPolicy(w - 1)), drafters[w]) for w in widths}
        node_drafter = SuffixDrafter()
        engines["length-aware"] = (TorchEngine(model, max_batch_size=batch, drafter=node_drafter,
                                               policy=LengthAwarePolicy(curve, node_drafter)), node_drafter)
        seconds, forwards, tokens = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0), dict.fromkeys(engines, 0)
        node_stats = SpeculationStats()
        for index in range(rounds + 1):
            prompts = [tuple(tasks.chat_prompt_ids(tokenizer, task)) for task in tasks.prompts(seed=0, round=index, count=groups)]
            requests = [GenerationRequest(p, seed=index, sample_index=g * per_group + i) for g, p in enumerate(prompts) for i in range(per_group)]
            for name in list(engines) if index % 2 else list(engines)[::-1]:
                engine, drafter = engines[name]
                stats = SpeculationStats()
                started = time.perf_counter()
                out = engine.generate(requests, params, stats=stats)
                if index:  # round 0 warms up
                    seconds[name] += time.perf_counter() - started
                    forwards[name] += stats.batch_forwards
                    tokens[name] += sum(len(s.completion_ids) for s in out)
                    if name == "length-aware":
                        node_stats.add(stats)
                if drafter is not None:
                    for sample in out:
                        drafter.observe(sample.prompt_ids, sample.completion_ids)
        per_forward = {name: seconds[name] / forwards[name] for name in engines}
        per_token = {name: seconds[name] / tokens[name] for name in engines}
        result[str(batch)] = {
            "calibrated": ratios(batch, CALIBRATION_CONTEXT),
            "calibrated_long": ratios(batch, args.long_context),
            "real_per_forward": {str(w): round(per_forward[f"W{w}"] / per_forward["plain"], 3) for w in widths},
            "real_per_token": {str(w): round(per_token[f"W{w}"] / per_token["plain"], 3) for w in widths},
            "no_drafts_per_token": round(per_token["no drafts"] / per_token["plain"], 3),
            "length_aware_per_token": round(per_token["length-aware"] / per_token["plain"], 3),
            "length_aware_tokens_per_forward": round(node_stats.tokens_per_forward, 3),
            "plain_ms_per_forward": round(1000 * per_forward["plain"], 1),
        }
        print(f"batch {batch}: {json.dumps(result[str(batch)])}", flush=True)
    print("RESULT " + json.dumps({"cpu": cpu_facts()["cpu"], "dtype": args.dtype, "attention": args.attention,
                                  "threads": args.threads, "rounds": rounds, "where_drafting_pays": verdict, "batches": result}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
