"""Lossless speculative rollouts on an RL-epoch workload: plain vs speculative, same seeds, one process.

P GSM8K-style prompts x G samples x E epochs on the embedded model. Epoch 0 is decoded plainly
and warms the drafter (as in RL, the same prompt set comes back every epoch); every later
epoch is decoded twice with the same seeds, plain and speculative, side by side, and then fed
to the drafter. Prints per epoch and in total: wall ratio plain / speculative, tokens per target
forward (per sequence; plain = 1.0), acceptance, the fraction of sequences identical token for
token, the drafter's share of the speculative wall time and its cost per draft token.

Variant ("swarm"): a second drafter is also fed with other nodes' rollouts of the same prompts
(different seeds, generated in the warm-up epoch), and the last epoch is decoded with it too,
to show what the swarm's rollouts add to acceptance.

    python bench/spec_rollout.py --quick
    python bench/spec_rollout.py --prompts 12 --generations 2 --epochs 3 --max-new-tokens 96
    python bench/spec_rollout.py --quick --model tiny       # smoke run, random weights
    python bench/spec_rollout.py --quick --policy uniform --trace t.jsonl   # always draft; save the trace

It also replays the same rollouts through the drafter alone (node/speculation/trace.py) and prints the
tokens per forward a uniform budget would give: with `--policy uniform` the engine must match it.
And it prints a reference ceiling for drafters that cannot see the sampling noise: how often the
sampled token is the target's own argmax, and the tokens per forward a perfect greedy draft
model (one that always proposes that argmax) would reach on the same rollouts.

Ends with one line ``RESULT {json}``: wall_ratio, tokens_per_forward, identical_fraction,
drafter_share, plus details (oracle_tokens_per_forward and argmax_agreement: the ceiling).
"""

from __future__ import annotations

import argparse
import json
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


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens (under 2 minutes on 2 cores)")
    parser.add_argument("--prompts", type=int, help="prompts (default 8, quick 4)")
    parser.add_argument("--generations", type=int, default=2, help="samples per prompt per epoch")
    parser.add_argument("--epochs", type=int, help="epochs, the first warms the drafter (default 3, quick 2)")
    parser.add_argument("--max-new-tokens", type=int, help="default 96, quick 64")
    parser.add_argument("--peers", type=int, default=2, help="other nodes whose warm-up rollouts feed the swarm variant (0: skip it)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=1, help="sequences decoded together (the target is batch 1)")
    parser.add_argument("--budget", type=int, default=16, help="num_speculative_tokens (max draft per step)")
    parser.add_argument("--policy", choices=["length-aware", "uniform"], default="length-aware",
                        help="length-aware: the node's calibrated policy; uniform: always draft up to --budget (the replay's setting)")
    parser.add_argument("--trace", help="also write the run's rollouts as a trace (for bench/drafter_replay.py)")
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="torch device of the model (bench/gpu_check.py passes cuda)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (4 if args.quick else 8)
    args.epochs = args.epochs or (2 if args.quick else 3)
    args.max_new_tokens = args.max_new_tokens or (64 if args.quick else 96)
    if args.epochs < 2:
        parser.error("--epochs must be >= 2: the first one only warms the drafter")
    return args


def greedy_oracle(model, records, budget: int, max_new_tokens: int) -> tuple[float, float]:
    """A reference ceiling for drafters that do not see the sampler's noise: (argmax agreement, tokens per forward).

    A draft token is accepted only if it equals the token the keyed sampler draws, so position
    by position no drafter blind to the sampling noise is accepted more often than one that
    proposes the target's most probable token (a perfect greedy draft model). This re-reads
    each completion in one teacher-forced forward and replays it (`replay_rollout`, the
    engine's step rule) with a drafter that proposes those argmax tokens.
    """
    from hivespec.node.speculation.drafter import Draft
    from hivespec.node.speculation.trace import ReplayResult, replay_rollout

    class Argmax:
        def __init__(self, tokens: list[int]) -> None:
            self.tokens = tokens

        def propose(self, completion: Sequence[int], budget: int) -> Draft:
            return Draft(self.tokens[len(completion) : len(completion) + max(budget, 0)], [], len(completion))

    result = ReplayResult(feeding="greedy oracle")
    agree = 0
    for record in records:
        ids = torch.tensor([[*record.prompt_ids, *record.completion_ids]], device=model.device)
        with torch.inference_mode():
            logits = model(ids).logits[0, len(record.prompt_ids) - 1 : -1]
        argmax = logits.argmax(-1).tolist()
        agree += sum(a == t for a, t in zip(argmax, record.completion_ids, strict=True))
        replay_rollout(record, Argmax(argmax), budget, max_new_tokens, result)
    return agree / result.tokens, result.tokens_per_forward


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
    from hivespec.node.speculation.trace import TraceRecord, TraceWriter, replay

    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device).requires_grad_(False)
    source = TaskSource([("jsonl", 1, 1.0)], jsonl_path=GSM_MINI_PATH)
    jsonl = source.families["jsonl"]
    tasks = [jsonl.make(i, 1) for i in range(args.prompts)]  # type: ignore[attr-defined]
    prompts = [tuple(source.chat_prompt_ids(tokenizer, task)) for task in tasks]
    params = SamplingParams(args.temperature, args.top_p, args.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))

    def requests(seed: int) -> list[GenerationRequest]:
        return [
            GenerationRequest(prompt, seed=seed, sample_index=p * args.generations + g)
            for p, prompt in enumerate(prompts)
            for g in range(args.generations)
        ]

    plain_engine = TorchEngine(model, max_batch_size=args.batch_size)
    started = time.perf_counter()
    curve = device_verify_cost(plain_engine, model.config, args.dtype, args.device, args.batch_size)
    print(f"model {args.model} {args.dtype}, {threads} threads, batch {args.batch_size}; verify cost (cached or measured "
          f"in {time.perf_counter() - started:.1f}s):", flush=True)
    for b in curve.batches:
        print(f"  B={b:<3} T(k+1)/T(1) for k=1,2,4,8,16: " + " ".join(f"{curve.ratio(b, k + 1):.2f}" for k in (1, 2, 4, 8, 16)))

    own = SuffixDrafter()
    swarm = SuffixDrafter()
    def policy(drafter: SuffixDrafter):
        if args.policy == "uniform":
            return UniformPolicy(args.budget)
        return LengthAwarePolicy(curve, drafter, max_budget=args.budget)

    spec_engine = TorchEngine(model, max_batch_size=args.batch_size, drafter=own, policy=policy(own))
    swarm_engine = TorchEngine(model, max_batch_size=args.batch_size, drafter=swarm, policy=policy(swarm))
    # The rollouts as the own drafter is fed them, for the replay cross-check below.
    records: list[TraceRecord] = []

    def record(samples, seed: int, epoch: int, node: str = "bench", own_rollout: bool = True) -> None:
        records.extend(
            TraceRecord(node="bench", own=own_rollout, author=node, round=epoch, prompt_key=str(r.sample_index // args.generations),
                        prompt_ids=s.prompt_ids, completion_ids=s.completion_ids, sample_index=r.sample_index, seed=seed,
                        finish_reason=s.finish_reason)
            for r, s in zip(requests(seed), samples, strict=True)
        )

    def feed(drafters: Sequence[SuffixDrafter], samples) -> None:
        for drafter in drafters:
            for sample in samples:
                drafter.observe(sample.prompt_ids, sample.completion_ids)

    warm = plain_engine.generate(requests(args.seed * 1000), params)
    feed([own, swarm], warm)
    record(warm, args.seed * 1000, 0)
    for peer in range(1, args.peers + 1):  # other nodes: same prompts, their own seeds
        peer_samples = plain_engine.generate(requests(args.seed * 1000 + 100 * peer), params)
        feed([swarm], peer_samples)
        record(peer_samples, args.seed * 1000 + 100 * peer, 0, node=f"peer-{peer}", own_rollout=False)
    print(f"warm-up epoch: {sum(len(s.completion_ids) for s in warm)} tokens; swarm drafter also fed {args.peers} peers' rollouts", flush=True)

    total_plain = SpeculationStats()
    total_spec = SpeculationStats()
    identical = sequences = 0
    max_logprob_diff = 0.0
    swarm_stats = SpeculationStats()
    print(f"{'epoch':>5} {'tokens':>7} {'plain s':>8} {'spec s':>7} {'ratio':>6} {'tok/fwd':>8} {'accept':>7} {'same':>6} {'draft%':>7} {'us/tok':>7}")
    for epoch in range(1, args.epochs):
        epoch_requests = requests(args.seed * 1000 + epoch)
        plain_stats, spec_stats = SpeculationStats(), SpeculationStats()
        plain, spec = [], []
        # Prompt by prompt, alternating which runs first: the machine's load drifts (other
        # processes share it), and interleaving gives both sides the same share of it.
        for p in range(args.prompts):
            group = epoch_requests[p * args.generations : (p + 1) * args.generations]
            runs = [(plain_engine, plain_stats, plain), (spec_engine, spec_stats, spec)]
            for engine, stats, out in runs if p % 2 == 0 else runs[::-1]:
                out.extend(engine.generate(group, params, stats=stats))
        same = sum(a.completion_ids == b.completion_ids for a, b in zip(plain, spec, strict=True))
        for a, b in zip(plain, spec, strict=True):
            if a.completion_ids == b.completion_ids and a.logprobs:
                max_logprob_diff = max(max_logprob_diff, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)))
        if epoch == args.epochs - 1 and args.peers:
            swarm_engine.generate(epoch_requests, params, stats=swarm_stats)
        identical += same
        sequences += len(plain)
        total_plain.add(plain_stats)
        total_spec.add(spec_stats)
        feed([own, swarm], plain)
        record(plain, args.seed * 1000 + epoch, epoch)
        print(
            f"{epoch:>5} {plain_stats.tokens:>7} {plain_stats.generate_seconds:>8.2f} {spec_stats.generate_seconds:>7.2f} "
            f"{plain_stats.generate_seconds / spec_stats.generate_seconds:>6.2f} {spec_stats.tokens_per_forward:>8.2f} "
            f"{spec_stats.acceptance_rate:>7.2f} {same / len(plain):>6.2f} "
            f"{100 * spec_stats.draft_seconds / spec_stats.generate_seconds:>6.1f}% {spec_stats.draft_us_per_token:>7.1f}",
            flush=True,
        )

    wall_ratio = total_plain.generate_seconds / total_spec.generate_seconds
    # The drafter alone on the same rollouts, uniform budget, own feeding (no peers): what the
    # engine's tokens per forward would be if every step verified the whole draft.
    replayed = replay(records, SuffixDrafter(), budget=args.budget, feeding="own", max_new_tokens=args.max_new_tokens)
    timed = [r for r in replayed.per_round.items() if r[0] > 0]
    replay_tpf = sum(t for _, (_, t, _) in timed) / sum(n + s for _, (n, _, s) in timed)
    print(f"replay (drafter alone, uniform budget {args.budget}, timed epochs): {replay_tpf:.3f} tokens per forward; "
          f"engine ({args.policy}): {total_spec.tokens_per_forward:.3f}")
    timed_own = [r for r in records if r.own and r.round > 0]
    agreement, oracle_tpf = greedy_oracle(model, timed_own, args.budget, args.max_new_tokens)
    print(f"ceiling: the sampled token is the target's argmax at {100 * agreement:.1f}% of positions; a drafter that "
          f"always proposed the argmax (a perfect greedy draft model) would reach {oracle_tpf:.3f} tokens per forward")
    if args.trace:
        writer = TraceWriter(args.trace, meta={"node": "bench", "model": args.model, "engine_dtype": args.dtype,
                                               "temperature": args.temperature, "top_p": args.top_p,
                                               "max_new_tokens": args.max_new_tokens, "source": "bench/spec_rollout.py"})
        writer.record(records)
        writer.close()
    result = {
        "wall_ratio": round(wall_ratio, 3),
        "tokens_per_forward": round(total_spec.tokens_per_forward, 3),
        "identical_fraction": round(identical / sequences, 4),
        "drafter_share": round(total_spec.draft_seconds / total_spec.generate_seconds, 4),
        "acceptance": round(total_spec.acceptance_rate, 4),
        "draft_us_per_token": round(total_spec.draft_us_per_token, 2),
        "replay_tokens_per_forward": round(replay_tpf, 3),
        "oracle_tokens_per_forward": round(oracle_tpf, 3),
        "argmax_agreement": round(agreement, 4),
        "policy": args.policy,
        "speculative_steps": total_spec.speculative_steps,
        "batch_forwards_plain": total_plain.batch_forwards,
        "batch_forwards_spec": total_spec.batch_forwards,
        "max_logprob_diff_identical": max_logprob_diff,
        "sequences": sequences,
        "tokens": total_plain.tokens,
        "plain_seconds": round(total_plain.generate_seconds, 2),
        "spec_seconds": round(total_spec.generate_seconds, 2),
        "model": args.model,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "temperature": args.temperature,
        "threads": threads,
    }
    if args.peers:
        result["swarm_tokens_per_forward"] = round(swarm_stats.tokens_per_forward, 3)
        result["swarm_acceptance"] = round(swarm_stats.acceptance_rate, 4)
        print(
            f"swarm variant (last epoch, drafter also fed {args.peers} peers' rollouts): tokens/forward "
            f"{swarm_stats.tokens_per_forward:.2f}, acceptance {swarm_stats.acceptance_rate:.2f}, "
            f"wall {swarm_stats.generate_seconds:.2f}s"
        )
    print(
        f"total: wall plain/spec {wall_ratio:.2f}x, {total_spec.tokens_per_forward:.2f} tokens per target forward, "
        f"identical {identical}/{sequences}, drafter {100 * result['drafter_share']:.1f}% of wall, "
        f"{total_spec.draft_us_per_token:.1f} us per draft token"
    )
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
