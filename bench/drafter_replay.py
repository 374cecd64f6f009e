"""Replay recorded rollout traces through the drafter alone: how many tokens would each verification emit?

SuffixDecoding's simulator for `hivespec.node.speculation.drafter.SuffixDrafter` (the drafter the engine
uses, built with the config's defaults unless flags say otherwise). Each recording node's own
rollouts are decoded again against their recorded tokens, fed in trace order as the node fed
its drafter (a round's own rollouts draft against the drafter as it was before the round, then
are observed; accepted foreign rollouts are observed where they arrived). At each step the
drafter proposes up to `--budget` tokens and the longest prefix equal to the recorded
continuation is accepted plus one bonus token: what lossless verification would keep. No model
runs, so this isolates the drafter: if the engine gets fewer tokens per forward than the replay
with a uniform budget, the engine (or its policy) loses them.

Feedings, side by side on the same trace:
  own          the drafter sees only the node's own rollouts
  own+foreign  also the peers' accepted rollouts (what the swarm adds)
  sequential   own+foreign, but each own rollout is observed as soon as it is done, as if a
               round's samples were generated one after another (siblings draft for each other)

    python bench/drafter_replay.py                          # the shipped trace(s) in bench/data/
    python bench/drafter_replay.py --trace run.jsonl --budget 16
    python bench/drafter_replay.py --quick --sweep          # also a small min_prob x spec_factor grid

Prints, per feeding: mean accepted tokens per verification step (accepted drafts + bonus),
tokens per target forward (prefill counted, as the engine counts), draft acceptance, drafting
cost per proposed token (target <= 50 us). Ends with ``RESULT {json}``: mean_accepted (own+foreign
feeding), tokens_per_forward, draft_us_per_token, mean_accepted_own_only, foreign_gain, and more.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from hivespec.node.config import SpeculationConfig
from hivespec.node.speculation.drafter import SuffixDrafter
from hivespec.node.speculation.trace import ReplayResult, TraceRecord, read_trace, replay

DATA = Path(__file__).resolve().parent / "data"
FEEDINGS = ("own", "own+foreign", "sequential")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = SpeculationConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="append", help="trace file (.jsonl or .jsonl.gz; repeatable); default: bench/data/trace-*.jsonl.gz")
    parser.add_argument("--node", action="append", help="replay only this recording node (repeatable; default: every node in the traces)")
    parser.add_argument("--quick", action="store_true", help="only the first node's first half of rounds")
    parser.add_argument("--budget", type=int, default=defaults.num_speculative_tokens, help="most draft tokens per step")
    parser.add_argument("--min-prob", type=float, default=defaults.min_prob)
    parser.add_argument("--spec-factor", type=float, default=defaults.spec_factor)
    parser.add_argument("--window", type=int, default=defaults.window)
    parser.add_argument("--sweep", action="store_true", help="also replay a min_prob x spec_factor grid (own+foreign)")
    args = parser.parse_args(argv)
    if not args.trace:
        args.trace = sorted(str(p) for p in DATA.glob("trace-*.jsonl*"))
        if not args.trace:
            parser.error(f"no --trace given and no trace-*.jsonl* in {DATA}")
    return args


def _load(paths: Sequence[str]) -> tuple[dict, list[TraceRecord]]:
    metas, records = [], []
    for path in paths:
        file_metas, file_records = read_trace(path)
        metas += file_metas
        records += file_records
    limits = {m.get("max_new_tokens") for m in metas if m.get("max_new_tokens")}
    meta = {"max_new_tokens": min(limits) if limits else None, "models": sorted({str(m.get("model")) for m in metas})}
    return meta, records


def _run(records, nodes, feeding, args, max_new_tokens, *, min_prob=None, spec_factor=None) -> ReplayResult:
    """Each node replays its own view with a fresh drafter; the totals are summed over nodes."""
    total = ReplayResult(feeding=feeding)
    for node in nodes:
        drafter = SuffixDrafter(
            window=args.window,
            min_prob=args.min_prob if min_prob is None else min_prob,
            spec_factor=args.spec_factor if spec_factor is None else spec_factor,
        )
        part = replay(records, drafter, budget=args.budget, node=node, feeding=feeding, max_new_tokens=max_new_tokens)
        for name in ("rollouts", "tokens", "steps", "accepted", "proposed", "draft_seconds", "observed"):
            setattr(total, name, getattr(total, name) + getattr(part, name))
        for round_index, counts in part.per_round.items():
            entry = total.per_round.setdefault(round_index, [0, 0, 0])
            for k, count in enumerate(counts):
                entry[k] += count
    return total


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    meta, records = _load(args.trace)
    nodes = args.node or list(dict.fromkeys(r.node for r in records if r.own))
    if args.quick:
        nodes = nodes[:1]
        rounds = sorted({r.round for r in records if r.node == nodes[0]})
        keep = set(rounds[: max(2, len(rounds) // 2)])
        records = [r for r in records if r.round in keep]
    own = [r for r in records if r.own and r.node in nodes]
    foreign = [r for r in records if not r.own and r.node in nodes]
    prompts = {r.prompt_key for r in own}
    repeats = sum(1 for key in prompts if len({r.round for r in own if r.prompt_key == key}) > 1)
    lengths = sorted(len(r.completion_ids) for r in own)
    print(
        f"trace {', '.join(Path(p).name for p in args.trace)}: model {', '.join(meta['models'])}, nodes {len(nodes)}, "
        f"own rollouts {len(own)} ({len(prompts)} prompts, {repeats} seen in more than one round), foreign {len(foreign)}, "
        f"completion length p50 {lengths[len(lengths) // 2] if lengths else 0}, max_new_tokens {meta['max_new_tokens']}"
    )
    print(f"drafter: budget {args.budget}, min_prob {args.min_prob}, spec_factor {args.spec_factor}, window {args.window}")
    print(f"{'feeding':<12} {'rollouts':>8} {'tokens':>7} {'steps':>6} {'mean_acc':>9} {'tok/fwd':>8} {'accept':>7} {'us/tok':>7}")
    results: dict[str, ReplayResult] = {}
    for feeding in FEEDINGS:
        result = results[feeding] = _run(records, nodes, feeding, args, meta["max_new_tokens"])
        print(
            f"{feeding:<12} {result.rollouts:>8} {result.tokens:>7} {result.steps:>6} {result.mean_accepted:>9.3f} "
            f"{result.tokens_per_forward:>8.3f} {result.acceptance:>7.3f} {result.us_per_proposed_token:>7.1f}",
            flush=True,
        )
    main_result = results["own+foreign"]
    per_round = {r: round((t - n) / s, 3) if s else None for r, (n, t, s) in sorted(main_result.per_round.items())}
    print("own+foreign, mean accepted by round: " + json.dumps(per_round))
    sweep = []
    if args.sweep:
        print(f"{'min_prob':>8} {'spec_factor':>11} {'mean_acc':>9} {'tok/fwd':>8} {'accept':>7}")
        for min_prob in (0.0, 0.05, 0.1, 0.2, 0.4):
            for spec_factor in (1.0, 2.0, 4.0, 16.0):
                result = _run(records, nodes, "own+foreign", args, meta["max_new_tokens"], min_prob=min_prob, spec_factor=spec_factor)
                sweep.append({"min_prob": min_prob, "spec_factor": spec_factor, "mean_accepted": round(result.mean_accepted, 4)})
                print(f"{min_prob:>8} {spec_factor:>11} {result.mean_accepted:>9.3f} {result.tokens_per_forward:>8.3f} {result.acceptance:>7.3f}", flush=True)
    own_only = results["own"]
    output = {
        "mean_accepted": round(main_result.mean_accepted, 4),
        "tokens_per_forward": round(main_result.tokens_per_forward, 4),
        "acceptance": round(main_result.acceptance, 4),
        "draft_us_per_token": round(main_result.us_per_proposed_token, 2),
        "mean_accepted_own_only": round(own_only.mean_accepted, 4),
        "foreign_gain": round(main_result.mean_accepted / own_only.mean_accepted, 4) if own_only.mean_accepted else None,
        "mean_accepted_sequential": round(results["sequential"].mean_accepted, 4),
        "rollouts": main_result.rollouts,
        "tokens": main_result.tokens,
        "foreign_rollouts": len(foreign),
        "nodes": len(nodes),
        "budget": args.budget,
        "min_prob": args.min_prob,
        "spec_factor": args.spec_factor,
        "traces": [Path(p).name for p in args.trace],
    }
    if sweep:
        output["sweep_best"] = max(sweep, key=lambda row: row["mean_accepted"])
    print("RESULT " + json.dumps(output), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
