"""What a step costs a node when its groups have no reward spread: before and after they stopped being run.

A group whose rewards are all equal carries no GRPO gradient. A step used to run one forward of
it anyway, for the importance statistics; after a step that moved no weight the sync still cast
every trainer weight to the engine's dtype and compared it with the engine, and every round
checked the result with another cast and compare. None of that runs now
(`train.flat_sample_stats: false`, the default; `WeightSync.sync(..., trainer_moved=False)`;
the runtime checks the engine after a sync that moved a weight). This times a step's training,
sync and check both ways on the embedded model, side by side in one process, for the fast node
of bench/hetero_swarm.py (1 prompt x 2 completions a step, a bfloat16 engine, 1 thread):

- flat: its own group alone, both completions with the same reward (most of its steps alone);
- mixed: that flat own group plus a foreign group of 2 with a reward spread (its usual step in
  a swarm: the foreign samples carry the gradient).

Token ids are drawn at random at the lengths of that node's steps (a prompt of --prompt-tokens,
completions of --completion-tokens): what a forward or a sync costs depends on the lengths and on
how many weights move, not on which tokens.

    python bench/flat_steps.py --quick   # 3 repeats
    python bench/flat_steps.py           # 7 repeats

Ends with ``RESULT {json}``: best seconds per kind and way (`flat_before_s`, `flat_now_s`,
`mixed_before_s`, `mixed_now_s`), their ratios (`flat_speedup`, `mixed_speedup`) and differences
(`flat_saved_s`, `mixed_saved_s`), the parts of each (train, sync, check) and the machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hivespec.node.model.loader import configure_threads, load_model
from hivespec.node.model.precision import cpu_facts
from hivespec.node.training.trainer import Trainer, TrainSample
from hivespec.node.weights.sync import WeightSync


def samples(vocab: int, prompt_tokens: int, completion_tokens: int, *, mixed: bool, seed: int) -> list[TrainSample]:
    """The fast node's own flat group, plus (mixed) a foreign group with a reward spread; behaviour log-probs to fill in."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    prompt = ids(prompt_tokens)
    draft = [TrainSample(prompt, ids(completion_tokens), [0.0] * completion_tokens, 1.0, "own") for _ in range(2)]
    if mixed:
        peer_prompt = ids(prompt_tokens)
        draft += [TrainSample(peer_prompt, ids(completion_tokens), [0.0] * completion_tokens, reward, "peer", "peer-a",
                              advantage=advantage) for reward, advantage in ((1.0, 0.7071), (0.0, -0.7071))]
    return draft


def on_policy(trainer: Trainer, draft: list[TrainSample]) -> list[TrainSample]:
    """`draft` with the trainer's log-probs as behaviour, as fresh rollouts of its policy have: the same batch
    trained on again and again would leave the importance filter's band and stop moving weights."""
    behaviour = trainer.logprobs(draft)
    return [TrainSample(s.prompt_ids, s.completion_ids, b, s.reward, s.group, s.source, s.advantage) for s, b in zip(draft, behaviour, strict=True)]


def one_round(trainer: Trainer, sync: WeightSync, batch: list[TrainSample], *, before: bool) -> dict[str, float]:
    """Train, sync and check as a round did before (`before`) or does now; seconds of each."""
    mark = time.perf_counter()
    step = trainer.step(batch)
    train = time.perf_counter() - mark
    assert step.optimizer_steps == (1 if any(s.advantage for s in batch) else 0), "a step with a gradient must move the weights"
    mark = time.perf_counter()
    moved = before or step.optimizer_steps > 0
    sync.sync(step.version, encode=False, trainer_moved=moved)
    synced = time.perf_counter() - mark
    mark = time.perf_counter()
    if moved:
        assert sync.mismatched_elements() == 0, "the engine must equal the trainer's cast after a sync"
    check = time.perf_counter() - mark
    return {"train": train, "sync": synced, "check": check, "total": train + synced + check}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a node of 3 on 2 cores has 1)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens of a prompt")
    parser.add_argument("--completion-tokens", type=int, default=80, help="tokens of a completion (the fast node made 150-160 a step)")
    parser.add_argument("--autocast", choices=("bfloat16", "off"), default="bfloat16", help="the trainer's autocast (what `auto` chose on a CPU with avx512_bf16)")
    args = parser.parse_args()
    configure_threads(args.threads)
    repeats = 3 if args.quick else 7
    model = load_model().float()
    cpu = cpu_facts()["cpu"]
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {args.threads} thread(s), {cpu}, "
          f"torch {torch.__version__}, trainer autocast {args.autocast}, bfloat16 engine", flush=True)
    autocast = torch.bfloat16 if args.autocast == "bfloat16" else None
    engine = {name: p.detach().to(torch.bfloat16).clone() for name, p in model.named_parameters()}
    sync = WeightSync(model, engine)
    trainers = {way: Trainer(model, learning_rate=2e-5, micro_batch_size=8, autocast_dtype=autocast, flat_sample_stats=way == "before")
                for way in ("before", "now")}
    best: dict[str, dict[str, float]] = {}
    for kind in ("flat", "mixed"):
        draft = samples(model.config.vocab_size, args.prompt_tokens, args.completion_tokens, mixed=kind == "mixed", seed=1)
        for repeat in range(repeats + 1):  # the first of each is a warm-up
            for way in ("before", "now"):  # interleaved: both see the machine as it is
                seconds = one_round(trainers[way], sync, on_policy(trainers[way], draft), before=way == "before")
                key = f"{kind}_{way}"
                if repeat and (key not in best or seconds["total"] < best[key]["total"]):
                    best[key] = seconds
        print(f"{kind:>5}: before {best[f'{kind}_before']['total']:.3f} s "
              f"({', '.join(f'{k} {v:.3f}' for k, v in best[f'{kind}_before'].items() if k != 'total')}), "
              f"now {best[f'{kind}_now']['total']:.3f} s ({', '.join(f'{k} {v:.3f}' for k, v in best[f'{kind}_now'].items() if k != 'total')})",
              flush=True)
    result = {
        **{f"{key}_s": round(row["total"], 3) for key, row in best.items()},
        "flat_speedup": round(best["flat_before"]["total"] / best["flat_now"]["total"], 2),
        "mixed_speedup": round(best["mixed_before"]["total"] / best["mixed_now"]["total"], 2),
        "flat_saved_s": round(best["flat_before"]["total"] - best["flat_now"]["total"], 3),
        "mixed_saved_s": round(best["mixed_before"]["total"] - best["mixed_now"]["total"], 3),
        "parts_s": {key: {k: round(v, 3) for k, v in row.items() if k != "total"} for key, row in best.items()},
        "repeats": repeats, "threads": args.threads, "autocast": args.autocast, "cpu": cpu,
        "tokens": {"prompt": args.prompt_tokens, "completion": args.completion_tokens},
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
