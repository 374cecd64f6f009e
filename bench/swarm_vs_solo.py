"""Does sharing help? N real nodes trained as one swarm vs the same N nodes alone, same budget, one run.

Both conditions run N `hivespec join` processes on 127.0.0.1 with the embedded SmolLM2-135M and
the demo preset's task mix (arith:d1 35% and count:d1 19% base success at T = 1.0,
bench/base_rates.py), with the same per-node seeds, so each node draws the same prompts and
makes the same number of rollouts per round in both:
- shared: one swarm; every node waits for the others' batches each round (expected_peers N-1)
  and trains on its own rollouts plus admitted foreign ones, SAPO-style (train.foreign_fraction);
  with --no-wait it waits for nobody (expected_peers 0, the public preset's rule: a step fetches what
  its pool has room for, from what its peers published lately, and trains on what it has);
- solo: every node in a swarm of its own (no peers, nothing to wait for), foreign_fraction 0.
A share of the questions (tasks.heldout_fraction, split by a hash of the question text) is never
drawn for training; after the last round every node's checkpoint is scored on the same held-out
set (greedy by default, the nodes' engine dtype, the task's verifier), as is the untrained model.
Rewards per round are means of binary rewards; both conditions see the same prompts and sampling
seeds round by round, so the per-round difference is paired (round 0, before any training, must
be identical: `round0_paired`), and its standard error over rounds is printed.

Speculation on vs off: the main runs have speculation off; afterwards a node with node 0's seed
runs alone with speculation on for --spec-rounds, and its per-round rewards, token counts and
policy hashes are compared with solo node 0's (solo nodes are deterministic: same seed, same
thread count, no foreign input). bf16's K+1-token verify forwards round differently from 1-token
decode, so `--only-spec --spec-dtype float32` runs a float32 pair (on and off) by itself.

Why processes, not Node objects in one process: this is the real system (gossip, intake, the
round wait, checkpoint at exit), and each node's torch runs in its own interpreter, so N nodes
on 2 cores do not queue on one GIL. Memory decides N: a demo-preset node process (fp32 trainer +
Adam + bf16 engine + interpreter) measured 3.7-4.1 GB resident here and up to 4.9 GB in
bench/nat_nodes.py (`swarm_harness.NODE_GB`), so N = 4 needs ~20 GB; on a 24 GiB box shared with
other jobs N = 3 is what fits (`check_memory` refuses to start nodes that do not fit in the
memory available, a container's limit included: a swapping box stalls every job on it). The two conditions run one
after the other, never together, and the parent holds no model while nodes run. Each node gets
cores // N torch threads (--local-nodes N), the same in both conditions and in the speculation
runs, which keeps solo numerics reproducible.

`--config rg` runs the same design on the rg preset's reasoning-gym mix (the evaluator scores the
held-out questions with the same receiver-side verifier the nodes use).

    python bench/swarm_vs_solo.py --quick   # 2 nodes x 2 rounds: 16 min on a loaded 2-core box (3.5 of it a one-time calibration)
    nice -n 5 python bench/swarm_vs_solo.py --nodes 3 --rounds 12 --workdir /tmp/svs | tee svs.log
    nice -n 5 python bench/swarm_vs_solo.py --only-spec --spec-dtype float32 --nodes 3

Writes <workdir>/progress.log (one line per node-round, as they happen), <workdir>/curves.json
(after each phase) and the plot (--plot, default <workdir>/swarm_vs_solo.png; `--plot docs/swarm_vs_solo.png` redraws
the README's). Ends with
`RESULT {"cumulative_reward_ratio", "heldout_shared", "heldout_solo", "spec_identical_curves", ...}`, with standard
errors: the ratio's by the delta method over paired rounds, held-out accuracies' over questions (each question's
score averaged over a condition's nodes; shared - solo paired by question).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from swarm_harness import SwarmNode, check_memory, prepare_model, wait_ready

SEED_BASE = 1000  # node i runs with seed SEED_BASE + i in every condition
EVAL_SEED = 7  # sampling seed of the held-out evaluation (the same requests for every model)


# ----- nodes --------------------------------------------------------------------------------------


@dataclass
class Settings:
    nodes: int
    rounds: int
    prompts: int
    generations: int
    max_new_tokens: int
    learning_rate: float
    foreign_fraction: float
    heldout_fraction: float
    engine_dtype: str
    wait: bool = True  # the shared condition's steps wait for every peer's new batch (expected_peers N-1)


class BenchNode(SwarmNode):
    """A `hivespec join` process on the bench's preset (--config, default demo) that runs a fixed number of rounds, then serves until stopped."""

    preset: ClassVar[str] = "demo"
    join_flags: ClassVar[tuple[str, ...]] = ("--linger", "-1", "--no-resume")

    def done(self) -> bool:
        return any(e["event"] == "done" for e in self.events)


def node_sets(
    s: Settings, *, index: int, shared: bool, speculation: bool, engine_dtype: str, checkpoint: bool, rounds: int | None = None
) -> list[str]:
    """The config overrides of node `index` in one condition (everything else is the demo preset)."""
    return [
        f"seed={SEED_BASE + index}",
        f"rounds={rounds if rounds is not None else s.rounds}",
        f"rollout.prompts_per_round={s.prompts}",
        f"rollout.num_generations={s.generations}",
        f"rollout.max_completion_length={s.max_new_tokens}",
        f"train.learning_rate={s.learning_rate}",
        f"train.foreign_fraction={s.foreign_fraction if shared else 0.0}",
        f"tasks.heldout_fraction={s.heldout_fraction}",
        f"model.engine_dtype={engine_dtype}",
        f"speculation.enabled={'true' if speculation else 'false'}",
        f"swarm.swarm={'svs-shared' if shared else f'svs-solo-{index}'}",
        f"swarm.expected_peers={s.nodes - 1 if shared and s.wait else 0}",
        "swarm.bootstrap_timeout=0" if not shared or index == 0 else "swarm.bootstrap_timeout=20",
        "swarm.round_timeout=600",
        "status.enabled=false",
        "checkpoint.every_rounds=0",
        f"checkpoint.at_exit={'true' if checkpoint else 'false'}",
    ]


def run_phase(name: str, nodes: list[BenchNode], *, bootstrap_first: bool, progress: Path) -> dict[str, list[dict]]:
    """Start the nodes (the first alone, the rest from its addresses when `bootstrap_first`), log every
    round as it comes, wait until all are done, stop them; returns each node's round events."""
    started = time.monotonic()
    try:
        if bootstrap_first:
            nodes[0].start([])
            first = wait_ready(nodes[0])
            for node in nodes[1:]:
                node.start(first)
        else:
            for node in nodes:
                node.start([])
        while not all(node.done() for node in nodes):
            for node in nodes:
                for event in node.poll():
                    if event["event"] == "round":
                        line = (
                            f"{name} {node.name} round {event['round']:>3} reward {event['reward_mean']:.3f} "
                            f"foreign_used {event['foreign_used']:>3} trained {event['trained_samples']:>3} "
                            f"loss {event['loss']:+.4f} spec_drafted {event['spec_drafted']} "
                            f"{event['seconds'].get('round', 0.0):.1f}s (t={time.monotonic() - started:.0f}s)"
                        )
                        print(line, flush=True)
                        with progress.open("a") as f:
                            f.write(line + "\n")
                if not node.alive() and not node.done():
                    raise RuntimeError(f"{name}: {node.name} exited with {node.process.returncode}:\n{node.log_text()[-3000:]}")
            time.sleep(0.5)
    finally:
        for node in nodes:
            node.stop(timeout=60)
    return {node.name: node.rounds() for node in nodes}


# ----- curves -------------------------------------------------------------------------------------


def reward_curve(rounds_by_node: dict[str, list[dict]]) -> list[float]:
    """Mean over nodes of each round's own-rollout reward, for the rounds every node finished."""
    per_node = [{r["round"]: r["reward_mean"] for r in rounds} for rounds in rounds_by_node.values()]
    if not per_node:
        return []
    common = sorted(set.intersection(*(set(p) for p in per_node)))
    return [sum(p[i] for p in per_node) / len(per_node) for i in common]


def cumulative(curve: Sequence[float]) -> list[float]:
    total, out = 0.0, []
    for value in curve:
        total += value
        out.append(total)
    return out


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean of the per-round differences a - b and its standard error (rounds are paired: same prompts, same seeds)."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    return mean, (var / n) ** 0.5


def ratio_of_sums(a: Sequence[float], b: Sequence[float]) -> tuple[float | None, float]:
    """sum(a) / sum(b) over paired rounds and its delta-method standard error (None when sum(b) is 0).

    The cumulative reward ratio R = sum a_i / sum b_i; with e_i = a_i - R b_i, SE(R) = sqrt(n/(n-1) sum e_i^2) / sum b_i
    (the ratio estimator's linearisation; rounds are the paired units, so correlation between a_i and b_i is kept)."""
    n, total_b = len(a), sum(b)
    if n != len(b) or total_b <= 0:
        return None, 0.0
    ratio = sum(a) / total_b
    if n < 2:
        return ratio, 0.0
    residual = sum((x - ratio * y) ** 2 for x, y in zip(a, b, strict=True))
    return ratio, (residual * n / (n - 1)) ** 0.5 / total_b


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n)); for 0/1 values this is the binomial SE."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, (var / n) ** 0.5


def question_means(per_node: Sequence[Sequence[float]]) -> list[float]:
    """Per held-out question, the mean score over a condition's nodes (every node answers the same questions, so
    questions, not node-question pairs, are the independent units of the held-out standard errors)."""
    return [sum(col) / len(col) for col in zip(*per_node, strict=True)]


def compare_curves(a: Sequence[dict], b: Sequence[dict], keys: Sequence[str] = ("reward_mean",)) -> dict:
    """Round-by-round exact comparison of two nodes' round events on `keys` over their common rounds."""
    by_round = {r["round"]: r for r in b}
    common = [r for r in a if r["round"] in by_round]
    differing = [r["round"] for r in common if any(r[k] != by_round[r["round"]][k] for k in keys)]
    return {"rounds": len(common), "identical": bool(common) and not differing, "first_difference": differing[0] if differing else None}


def heldout_disjoint(heldout_questions: set[str], training_questions: set[str]) -> bool:
    return not heldout_questions & training_questions


def training_questions(s: Settings, tasks) -> set[str]:
    """Every question any node draws in any round (the nodes' prompts are a function of seed and round)."""
    return {
        t.question
        for i in range(s.nodes)
        for r in range(s.rounds)
        for t in tasks.prompts(seed=SEED_BASE + i, round=r, count=s.prompts)
    }


# ----- held-out evaluation ------------------------------------------------------------------------


class Evaluator:
    """Scores a model on the held-out tasks: `samples` completions each at `temperature` (0: greedy),
    fixed seeds (the same requests for every model), engine dtype as the nodes', the task's verifier."""

    def __init__(self, tasks, heldout: list, *, samples: int, temperature: float, max_new_tokens: int, engine_dtype: str) -> None:
        import torch

        from hivespec.node.model.engine import GenerationRequest, SamplingParams
        from hivespec.node.model.loader import EMBEDDED_MODEL, load_model, load_tokenizer

        self.torch = torch
        self.tasks = tasks
        self.heldout = heldout
        self.tokenizer = load_tokenizer(EMBEDDED_MODEL)
        self.model = load_model(EMBEDDED_MODEL, dtype=torch.float32)
        self.base_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.dtype = getattr(torch, engine_dtype)
        self.params = SamplingParams(
            temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens, stop_token_ids=(self.tokenizer.eos_token_id,)
        )
        self.requests = [
            GenerationRequest(tuple(tasks.chat_prompt_ids(self.tokenizer, task)), seed=EVAL_SEED, sample_index=i * samples + j)
            for i, task in enumerate(heldout)
            for j in range(samples)
        ]
        self.samples = samples

    def score(self, checkpoint_dir: Path | None) -> list[float]:
        """Per held-out question, the mean reward of its samples for the newest checkpoint in `checkpoint_dir`
        (None: the untrained model); the accuracy is the mean of the list."""
        import copy

        from hivespec.node.model.engine import TorchEngine
        from hivespec.node.training.checkpoint import (
            MODEL_FILE,
            CheckpointManager,
            restore_model,
        )

        if checkpoint_dir is None:
            self.model.load_state_dict(self.base_state)
        else:
            checkpoint = CheckpointManager(checkpoint_dir).load_latest()
            if checkpoint is None:
                raise RuntimeError(f"no checkpoint in {checkpoint_dir}: the node did not save at exit")
            restore_model(self.model, checkpoint.tensors[MODEL_FILE])
        engine_model = copy.deepcopy(self.model).to(self.dtype).eval()
        engine = TorchEngine(engine_model, max_batch_size=min(32, len(self.requests)))  # one batch: fewer decode steps
        with self.torch.no_grad():
            out = engine.generate(self.requests, self.params)
        rewards = [
            self.tasks.reward(self.heldout[k // self.samples], self.tokenizer.decode(o.completion_ids, skip_special_tokens=True))
            for k, o in enumerate(out)
        ]
        return [sum(rewards[i : i + self.samples]) / self.samples for i in range(0, len(rewards), self.samples)]


# ----- plot ---------------------------------------------------------------------------------------

def plot_curves(path: Path, curves: dict[str, tuple[list[float], tuple[int, int, int]]], title: str) -> None:
    """Reward per round (y 0..1) for each named curve (RGB color 0..255), with axes, grid, tick labels and a legend (matplotlib)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(6.4, 4.0), dpi=100, layout="constrained")
    ax = figure.subplots()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for name, (curve, color) in curves.items():
        ax.plot(range(len(curve)), curve, marker="o", linewidth=2.5, color=tuple(c / 255 for c in color), label=name)
    ax.set(title=title, xlabel="round", ylabel="mean reward", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", metadata={"Software": None})


# ----- main ---------------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 nodes x 2 rounds, 8 held-out questions, 2 speculation rounds")
    parser.add_argument("--config", default="demo", help="the nodes' preset (demo; rg: reasoning-gym tasks); its task mix is trained and held out")
    parser.add_argument("--nodes", type=int, default=None, help="nodes per condition (default 4, quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per node (default 12, quick 2)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per node per round")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the demo preset's completion cap")
    parser.add_argument("--lr", type=float, default=2.0e-5, help="learning rate (the demo preset's)")
    parser.add_argument("--foreign-fraction", type=float, default=0.5, help="shared condition's train.foreign_fraction")
    parser.add_argument("--no-wait", action="store_true",
                        help="shared nodes wait for nobody (expected_peers 0, as on the public preset), not for each peer's new batch")
    parser.add_argument("--heldout-fraction", type=float, default=0.25, help="share of questions kept out of training")
    parser.add_argument("--heldout", type=int, default=None, help="held-out questions scored (default 32, quick 8)")
    parser.add_argument("--heldout-samples", type=int, default=1, help="completions per held-out question")
    parser.add_argument("--heldout-temperature", type=float, default=0.0, help="held-out sampling temperature (0: greedy)")
    parser.add_argument("--engine-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--spec-dtype", choices=["same", "float32"], default="same",
                        help="engine dtype of the speculation on/off check (same: reuse solo node 0 as the 'off' curve)")
    parser.add_argument("--skip-spec", action="store_true", help="no speculation on/off check")
    parser.add_argument("--only-spec", action="store_true", help="only the speculation pair (with --spec-dtype float32)")
    parser.add_argument("--spec-rounds", type=int, default=None, help="rounds of the speculation check (default min(rounds, 4))")
    parser.add_argument("--workdir", default=None, help="node homes, logs and curves (default runs/swarm-vs-solo-<time>)")
    parser.add_argument("--plot", default=None, help="PNG of reward per round (default <workdir>/swarm_vs_solo.png, "
                        "swarm_vs_solo_<config>.png for another --config; docs/ holds the README's)")
    args = parser.parse_args(argv)
    args.nodes = args.nodes or (2 if args.quick else 4)
    args.rounds = args.rounds or (2 if args.quick else 12)
    args.heldout = args.heldout or (8 if args.quick else 32)
    args.spec_rounds = args.spec_rounds or min(args.rounds, 4)
    if args.only_spec and (args.spec_dtype == "same" or args.skip_spec):
        parser.error("--only-spec needs --spec-dtype float32 (there is no solo node 0 run to compare with) and no --skip-spec")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    BenchNode.preset = args.config
    from hivespec.node.config import load_config
    from hivespec.node.model.loader import configure_threads
    from hivespec.node.tasks import TaskSource

    configure_threads()  # the parent scores checkpoints while no node runs: all cores

    s = Settings(args.nodes, args.rounds, args.prompts, args.generations, args.max_new_tokens, args.lr,
                 args.foreign_fraction, args.heldout_fraction, args.engine_dtype, wait=not args.no_wait)
    root = Path(args.workdir or time.strftime("runs/swarm-vs-solo-%Y%m%d-%H%M%S"))
    root.mkdir(parents=True, exist_ok=True)
    progress = root / "progress.log"
    bench_started = time.monotonic()
    print(f"swarm vs solo: {json.dumps(vars(args))}, data in {root}/", flush=True)
    prepare_model()

    # The preset's mix (demo: arith:d1 + count:d1; rg: its reasoning-gym datasets), split like the nodes split it.
    tasks = TaskSource.from_config(dataclasses.replace(load_config(args.config).tasks, heldout_fraction=s.heldout_fraction))
    heldout = tasks.heldout(seed=0, count=args.heldout)
    trained = training_questions(s, tasks)
    disjoint = heldout_disjoint({t.question for t in heldout}, trained)
    if not disjoint:
        raise RuntimeError("held-out questions appear in the training prompts: the split is broken")
    kinds = collections.Counter(":".join(t.prompt_id.split(":")[:2]) if t.family == "rg" else t.family for t in heldout)
    print(f"held-out: {len(heldout)} questions ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), "
          f"none among the {len(trained)} training questions", flush=True)

    def evaluator() -> Evaluator:  # built for each scoring pass and dropped after: no model held while nodes run
        return Evaluator(tasks, heldout, samples=args.heldout_samples, temperature=args.heldout_temperature,
                         max_new_tokens=s.max_new_tokens, engine_dtype=s.engine_dtype)

    summary: dict = {"settings": vars(args), "heldout_questions": len(heldout)}

    def save_summary() -> None:
        (root / "curves.json").write_text(json.dumps(summary, indent=1))

    def make_nodes(tag: str, *, shared: bool) -> list[BenchNode]:
        return [
            BenchNode(f"{tag}-{i}", root / tag / f"node-{i}",
                      node_sets(s, index=i, shared=shared, speculation=False, engine_dtype=s.engine_dtype, checkpoint=True),
                      local_nodes=s.nodes)
            for i in range(s.nodes)
        ]

    def evaluate(nodes: list[BenchNode]) -> list[list[float]]:
        scorer, scores = evaluator(), []
        for node in nodes:
            mark = time.monotonic()
            scores.append(scorer.score(node.home / "checkpoints"))
            print(f"held-out accuracy {node.name}: {mean_and_se(scores[-1])[0]:.3f} ({time.monotonic() - mark:.0f}s)", flush=True)
            shutil.rmtree(node.home / "checkpoints", ignore_errors=True)  # ~1.6 GB each
        return scores

    for tag, shared in () if args.only_spec else (("shared", True), ("solo", False)):
        nodes = make_nodes(tag, shared=shared)
        check_memory(len(nodes))
        rounds_by_node = run_phase(tag, nodes, bootstrap_first=shared, progress=progress)
        summary[tag] = {"rounds": rounds_by_node, "curve": reward_curve(rounds_by_node)}
        save_summary()
        summary[tag]["heldout_per_question"] = evaluate(nodes)
        summary[tag]["heldout"] = [mean_and_se(q)[0] for q in summary[tag]["heldout_per_question"]]
        save_summary()
    if not args.only_spec:
        mark = time.monotonic()
        base_scores = summary["heldout_base_per_question"] = evaluator().score(None)
        heldout_base = summary["heldout_base"] = mean_and_se(base_scores)[0]
        print(f"held-out accuracy of the untrained model: {heldout_base:.3f} ({time.monotonic() - mark:.0f}s)", flush=True)
        save_summary()

    # speculation on vs off: node 0's seed alone; the 'off' curve is solo node 0's unless another dtype is asked
    spec_dtype = s.engine_dtype if args.spec_dtype == "same" else args.spec_dtype
    spec_rounds: dict[str, list[dict]] = {}
    if not args.skip_spec:
        pair = [True] if args.spec_dtype == "same" else [True, False]
        spec_nodes = [
            BenchNode(f"spec-{'on' if on else 'off'}", root / f"spec-{'on' if on else 'off'}",
                      node_sets(s, index=0, shared=False, speculation=on, engine_dtype=spec_dtype, checkpoint=False,
                                rounds=args.spec_rounds) + [f"swarm.swarm=svs-spec-{'on' if on else 'off'}"],
                      local_nodes=s.nodes)
            for on in pair
        ]
        try:
            check_memory(len(spec_nodes))
            spec_rounds = run_phase("spec", spec_nodes, bootstrap_first=False, progress=progress)
        except (RuntimeError, SystemExit) as exc:  # the main comparison still gets reported
            print(f"speculation check failed: {exc}", flush=True)
            summary["spec_error"] = str(exc)
    spec = None
    if spec_rounds:
        on = spec_rounds["spec-on"]
        off = spec_rounds["spec-off"] if "spec-off" in spec_rounds else summary["solo"]["rounds"]["solo-0"]
        spec = {
            "dtype": spec_dtype,
            "reward": compare_curves(on, off),
            "tokens": compare_curves(on, off, ("tokens_generated",)),
            "weights": compare_curves(on, off, ("policy_hash",)),
            "on_curve": [r["reward_mean"] for r in on],
            "off_curve": [r["reward_mean"] for r in off],
            "drafted": sum(r["spec_drafted"] for r in on),
            "accepted": sum(r["spec_accepted"] for r in on),
        }
        summary["spec"] = spec
    save_summary()
    if spec is not None:
        print(f"speculation on vs off ({spec['dtype']}): rewards identical {spec['reward']}, tokens identical {spec['tokens']}, "
              f"weights identical {spec['weights']}; drafted {spec['drafted']}, accepted {spec['accepted']}")
        print(f"  on  {spec['on_curve']}\n  off {spec['off_curve']}")
    spec_result = {
        "spec_identical_curves": spec["reward"]["identical"] if spec is not None else None,
        "spec_identical_tokens": spec["tokens"]["identical"] if spec is not None else None,
        "spec_identical_weights": spec["weights"]["identical"] if spec is not None else None,
        "spec_rounds": spec["reward"]["rounds"] if spec is not None else 0,
        "spec_dtype": spec_dtype,
    }
    if args.only_spec:
        print("RESULT " + json.dumps(spec_result), flush=True)
        return 0

    shared_curve, solo_curve = summary["shared"]["curve"], summary["solo"]["curve"]
    rounds = min(len(shared_curve), len(solo_curve))
    shared_cum, solo_cum = cumulative(shared_curve[:rounds]), cumulative(solo_curve[:rounds])
    print("\nmean reward per round over nodes (own rollouts, T = 1.0)", flush=True)
    print(f"{'round':>5} {'shared':>8} {'solo':>8} {'shared-solo':>11} {'cum shared':>11} {'cum solo':>9}")
    for i in range(rounds):
        print(f"{i:>5} {shared_curve[i]:>8.3f} {solo_curve[i]:>8.3f} {shared_curve[i] - solo_curve[i]:>+11.3f} "
              f"{shared_cum[i]:>11.3f} {solo_cum[i]:>9.3f}")
    # Held-out: per question, the mean over a condition's nodes; standard errors over questions (the shared unit).
    shared_q = question_means(summary["shared"]["heldout_per_question"])
    solo_q = question_means(summary["solo"]["heldout_per_question"])
    heldout_shared, heldout_shared_se = mean_and_se(shared_q)
    heldout_solo, heldout_solo_se = mean_and_se(solo_q)
    heldout_base_se = mean_and_se(base_scores)[1]
    heldout_diff, heldout_diff_se = paired_difference(shared_q, solo_q)
    ratio, ratio_se = ratio_of_sums(shared_curve[:rounds], solo_curve[:rounds])
    # Round 0 runs before any training: the same seed must give the same rewards in both conditions.
    paired = all(
        compare_curves(summary["shared"]["rounds"][f"shared-{i}"][:1], summary["solo"]["rounds"][f"solo-{i}"][:1],
                       ("reward_mean", "tokens_generated"))["identical"]
        for i in range(s.nodes)
    )
    print(f"round 0 (untrained) identical in both conditions for every node: {paired}")
    diff, diff_se = paired_difference(shared_curve[:rounds], solo_curve[:rounds])
    shared_events = [e for events in summary["shared"]["rounds"].values() for e in events]
    foreign_used = sum(e["foreign_used"] for e in shared_events) / max(1, len(shared_events))
    print(f"shared nodes {'waited for each peer' if s.wait else 'waited for nobody'}; foreign samples trained a node-round: {foreign_used:.2f}")
    print(f"cumulative reward: shared {shared_cum[-1]:.3f}, solo {solo_cum[-1]:.3f}, ratio {ratio} +- {ratio_se:.4f}; "
          f"per-round shared - solo {diff:+.4f} +- {diff_se:.4f} (standard errors over rounds)")
    print(f"held-out accuracy (+- standard error over {len(heldout)} questions): base {heldout_base:.3f} +- {heldout_base_se:.3f}, "
          f"shared {heldout_shared:.3f} +- {heldout_shared_se:.3f} {summary['shared']['heldout']}, "
          f"solo {heldout_solo:.3f} +- {heldout_solo_se:.3f} {summary['solo']['heldout']}; "
          f"shared - solo {heldout_diff:+.3f} +- {heldout_diff_se:.3f} (paired over questions)")
    plot = Path(args.plot) if args.plot else root / ("swarm_vs_solo.png" if args.config == "demo" else f"swarm_vs_solo_{args.config}.png")
    plot_curves(plot, {"shared": (shared_curve[:rounds], (31, 119, 180)), "solo": (solo_curve[:rounds], (255, 127, 14))},
                f"Mean reward per round over {s.nodes} nodes")
    print(f"plot: {plot}; total {time.monotonic() - bench_started:.0f}s", flush=True)
    result = {
        "cumulative_reward_ratio": round(ratio, 4) if ratio is not None else None,
        "cumulative_reward_ratio_se": round(ratio_se, 4),
        "heldout_shared": round(heldout_shared, 4),
        "heldout_solo": round(heldout_solo, 4),
        **spec_result,
        "heldout_base": round(heldout_base, 4),
        "heldout_shared_se": round(heldout_shared_se, 4),
        "heldout_solo_se": round(heldout_solo_se, 4),
        "heldout_base_se": round(heldout_base_se, 4),
        "heldout_difference": round(heldout_diff, 4),
        "heldout_difference_se": round(heldout_diff_se, 4),
        "round_differences": [round(a - b, 4) for a, b in zip(shared_curve[:rounds], solo_curve[:rounds], strict=True)],
        "cumulative_shared": round(shared_cum[-1], 4) if rounds else None,
        "cumulative_solo": round(solo_cum[-1], 4) if rounds else None,
        "rounds": rounds,
        "nodes": s.nodes,
        "rollouts_per_node_round": s.prompts * s.generations,
        "heldout_questions": len(heldout),
        "heldout_disjoint": disjoint,
        "round0_paired": paired,
        "shared_waits": s.wait,
        "foreign_used_per_node_round": round(foreign_used, 2),
        "round_difference": round(diff, 4),
        "round_difference_se": round(diff_se, 4),
        "seconds": round(time.monotonic() - bench_started),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
