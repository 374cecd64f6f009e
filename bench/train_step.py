"""What a training step costs, before and after a group's prompt ran once and short sequences got eager attention.

A GRPO group is several completions of one prompt. The trainer used to run the prompt again in
every row of a micro batch, and torch's fused SDPA attention kernel. Now four or more samples of
one prompt in a micro batch run it once, their completions on its keys and values (the same
log-probs: `Trainer.share_prompts`, SHARED_PROMPT_MIN_SAMPLES), and a CPU micro batch runs the
model's eager attention where every layer's attention probabilities fit `EAGER_ATTENTION_BYTES`
(`hivespec.node.model.attention`).
This times one step on the embedded model both ways, interleaved in one process, for groups of
--small (the hetero bench's fast node: 2 completions of 1 prompt) and --large samples (the
`public` preset: 8 completions of each prompt), and for a round of --round-groups groups of --large
(micro batches of max(8, --large), as a node's: whole rows of several prompts fill a micro batch, a
shared one holds one prompt's samples; `--large 4` is the demo's round of 4 x 4). It says whether the
node's start-up decision (`decide_shared_prompts`) agrees with the round measured here, and what eager attention costs in accuracy:
the mean |log-prob error| of the trainer's bf16-autocast log-probs against float32, with SDPA and
with eager attention.

Completions are sampled from the model itself at temperature 1 (realistic log-probs), then
behaviour log-probs are set to the trainer's own before each step (weights 1: every token kept).

    python bench/train_step.py --quick   # 3 repeats
    python bench/train_step.py           # 7 repeats
    python bench/train_step.py --quick --device cuda   # on a GPU: "now" keeps the model's own attention there

Ends with ``RESULT {json}``: best seconds per group size and way (`small_before_s`, `small_now_s`,
`large_before_s`, `large_now_s`, `round_*`), `small_speedup`, `large_speedup`, `round_speedup`, the split of each
speedup (`eager_only_s`: eager attention without the shared prompt), `round_shared_vs_whole` (the round's step with
the prompt once over every row whole, both on the node's attention), `node_shares_prompts` and `decision_agrees`
(it shares where that ratio is below 1 and keeps rows whole where it is above MARGIN; between, either is right),
`logp_error` (sdpa, eager) and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hivespec.kernels.host_transfer import synchronize
from hivespec.node.model.attention import decide_shared_prompts
from hivespec.node.model.loader import configure_threads, load_model
from hivespec.node.model.precision import MARGIN, cpu_facts
from hivespec.node.training.trainer import Trainer, TrainSample


def ways(device: torch.device) -> dict[str, tuple[bool, bool]]:
    """way: (share_prompts, eager_attention). "now": the prompt once, and eager attention on a CPU (where this CPU
    measured it faster). A node runs the prompt once only where `attention.decide_shared_prompts` measures it faster
    on its device (RESULT's `node_shares_prompts`, at the large group): on a 2-core EPYC it does, on an H100 it did not."""
    return {"before": (False, False), "eager_only": (False, True), "now": (True, device.type == "cpu")}


def sampled_group(model: torch.nn.Module, size: int, prompt_tokens: int, completion_tokens: int, seed: int,
                  name: str = "g") -> list[TrainSample]:
    """`size` completions of one random prompt, sampled from the model; rewards alternate so every sample has an advantage."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=generator)
    torch.manual_seed(seed)
    ids = prompt[None].repeat(size, 1).to(model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             do_sample=True, temperature=1.0, top_k=0, max_new_tokens=completion_tokens, min_new_tokens=completion_tokens // 2,
                             pad_token_id=model.config.eos_token_id)
    group = []
    for row in range(size):
        completion = out[row, prompt_tokens:].tolist()
        if model.config.eos_token_id in completion:  # generate pads a finished row with eos
            completion = completion[: completion.index(model.config.eos_token_id) + 1]
        group.append(TrainSample(prompt.tolist(), completion, [0.0] * len(completion), float(row % 2), name))
    return group


def on_policy(trainer: Trainer, draft: list[TrainSample]) -> list[TrainSample]:
    behaviour = trainer.logprobs(draft)
    return [TrainSample(s.prompt_ids, s.completion_ids, b, s.reward, s.group) for s, b in zip(draft, behaviour, strict=True)]


def logp_error(model: torch.nn.Module, draft: list[TrainSample]) -> dict[str, float]:
    """Mean |log-prob - float32's| of the bf16-autocast trainer's log-probs, with SDPA and with eager attention."""
    reference = Trainer(model, learning_rate=0.0, autocast_dtype=None, share_prompts=False)
    truth = [v for row in reference.logprobs(draft) for v in row]
    errors = {}
    for attention, eager in (("sdpa", False), ("eager", True)):
        trainer = Trainer(model, learning_rate=0.0, autocast_dtype=torch.bfloat16, eager_attention=eager)
        got = [v for row in trainer.logprobs(draft) for v in row]
        errors[attention] = round(statistics.fmean(abs(a - b) for a, b in zip(got, truth, strict=True)), 5)
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a node of 3 on 2 cores has 1)")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens of a prompt (the task prompts of the presets: 50-70)")
    parser.add_argument("--completion-tokens", type=int, default=96, help="at most this many tokens a completion (the presets' max_completion_length)")
    parser.add_argument("--small", type=int, default=2, help="samples of a small group")
    parser.add_argument("--large", type=int, default=8, help="samples of a large group")
    parser.add_argument("--round-groups", type=int, default=4, help="groups of --large samples in a round (the presets' prompts_per_round)")
    args = parser.parse_args()
    configure_threads(args.threads)
    device = torch.device(args.device)
    repeats = 3 if args.quick else 7
    model = load_model(dtype=torch.float32, device=str(device))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} thread(s)"
    cpu = cpu_facts()["cpu"]
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {where}, {cpu}, "
          f"torch {torch.__version__}, trainer autocast bfloat16", flush=True)
    micro_batch_size = max(8, args.large)
    trainers = {way: Trainer(model, learning_rate=1e-6, micro_batch_size=micro_batch_size, autocast_dtype=torch.bfloat16,
                             share_prompts=share, eager_attention=eager) for way, (share, eager) in ways(device).items()}
    groups = {kind: sampled_group(model, size, args.prompt_tokens, args.completion_tokens, seed=size)
              for kind, size in (("small", args.small), ("large", args.large))}
    groups["round"] = [sample for g in range(args.round_groups)
                       for sample in sampled_group(model, args.large, args.prompt_tokens, args.completion_tokens, seed=100 + g, name=f"g{g}")]
    # On the loaded weights, before the timed steps move them (each way's trainer steps the same model).
    errors = logp_error(model, groups["large"])
    print(f"mean |log-prob error| against float32, bf16 autocast: sdpa {errors['sdpa']}, eager {errors['eager']}", flush=True)
    best: dict[str, float] = {}
    for kind, draft in groups.items():
        size = len(draft)
        tokens = sum(len(s.completion_ids) for s in draft)
        for repeat in range(repeats + 1):  # the first is a warm-up
            for way, trainer in trainers.items():  # interleaved: every way sees the machine as it is
                batch = on_policy(trainer, draft)
                synchronize(device)
                mark = time.perf_counter()
                stats = trainer.step(batch)
                synchronize(device)
                seconds = time.perf_counter() - mark
                assert stats.optimizer_steps == 1 and stats.kept_tokens == tokens, "every token must be trained on"
                key = f"{kind}_{way}_s"
                if repeat:
                    best[key] = min(best.get(key, float("inf")), seconds)
        print(f"{kind} ({size} samples, {tokens} completion tokens): " + ", ".join(f"{way} {best[f'{kind}_{way}_s']:.3f} s" for way in trainers),
              flush=True)
    sharing = decide_shared_prompts("auto", model, device=str(device), rows=args.large, packed=micro_batch_size, prompt_tokens=args.prompt_tokens,
                                    completion_tokens=args.completion_tokens, autocast_dtype=torch.bfloat16,
                                    eager=device.type == "cpu", threads=args.threads, cache=None)
    print(sharing.describe(), flush=True)
    # The shared prompt alone: "now" and the whole way on the same attention (eager on a CPU, the model's own on a GPU).
    whole = "eager_only" if device.type == "cpu" else "before"
    ratio = best["round_now_s"] / best[f"round_{whole}_s"]
    agrees = ratio < 1 if sharing.share else ratio > MARGIN
    print(f"a round of {args.round_groups} x {args.large}: the prompt once {ratio:.3f}x of every row whole; the node "
          f"{'shares' if sharing.share else 'keeps rows whole'}: {'agrees' if agrees else 'DISAGREES'}", flush=True)
    result = {
        **{key: round(value, 3) for key, value in best.items()},
        "small_speedup": round(best["small_before_s"] / best["small_now_s"], 2),
        "large_speedup": round(best["large_before_s"] / best["large_now_s"], 2),
        "round_speedup": round(best["round_before_s"] / best["round_now_s"], 2),
        "round_shared_vs_whole": round(ratio, 3),
        "logp_error": errors,
        "node_shares_prompts": sharing.share,
        "decision_agrees": agrees,
        "groups": {"small": args.small, "large": args.large, "round": [args.round_groups, args.large], "micro_batch": micro_batch_size},
        "repeats": repeats, "threads": args.threads, "cpu": cpu, "device": where if device.type == "cuda" else "cpu",
        "tokens": {"prompt": args.prompt_tokens, "completion_max": args.completion_tokens},
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
