"""`hivespec eval`: accuracy on held-out questions, the base model and the trained policy side by side.

The questions: `TaskSource.heldout(seed, n)` over a task mix with its ``tasks.heldout_fraction``:
questions the split never lets `prompts()` draw, so no node training with that mix and split saw
them. The mix and split are the ones the policy trained with (its record) unless the caller
passes others; a split of 0 has no held-out questions.

Per model and question, with the same requests for every model (keyed sampling: the seed and
sample index fix each completion's randomness):

- greedy: one completion at temperature 0, scored by the task's own verifier (0 or 1);
- sampled: ``samples`` completions at ``temperature``; pass@k for each k by the unbiased
  estimator 1 - C(n-c, k) / C(n, k) of Chen et al. (2021), n samples of which c are right.

An accuracy is the mean over questions; its standard error the sample standard deviation over
questions / sqrt(questions). A difference between two models is paired by question (same
questions, same sampling keys): its standard error comes from the per-question differences.

A question whose chat prompt leaves less than ``max_new_tokens`` of the model's positions is
skipped, as a training round skips it (`fitting_questions`; the engine refuses such a prompt): the
scores are over the questions that fit, and the caller says how many were skipped.

`score_model` runs a model (any `TorchEngine`-able causal LM), saying how it goes every `PROGRESS_EVERY_S` to whoever
asks (a CPU takes minutes for the defaults); `compare` and `format_table` are pure.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

EVAL_SEED = 7  # sampling seed of the evaluation: the same requests for every model
PROGRESS_EVERY_S = 10.0  # score_model's progress reports at most this often


@dataclass(frozen=True)
class EvalSettings:
    questions: int = 32
    samples: int = 8  # sampled completions per question (pass@k needs k <= samples)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    seed: int = 0  # which held-out questions (TaskSource.heldout's seed)
    batch_size: int = 32

    def __post_init__(self) -> None:
        if self.questions < 1 or self.samples < 0 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError(f"questions, max_new_tokens and batch_size must be >= 1 and samples >= 0, got {self}")

    @property
    def ks(self) -> list[int]:
        """The k of each pass@k reported: 1 and the number of samples (and 4 between them, when there are more than 4)."""
        return sorted({k for k in (1, 4, self.samples) if 1 <= k <= self.samples})


@dataclass
class ModelScores:
    """One model's per-question results on the held-out questions."""

    label: str
    model: str
    greedy: list[float] = field(default_factory=list)  # per question: 1.0 right, 0.0 wrong
    correct: list[int] = field(default_factory=list)  # per question: right answers among the sampled completions
    samples: int = 0

    def pass_at(self, k: int) -> list[float]:
        return [pass_at_k(self.samples, c, k) for c in self.correct]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k completions drawn without replacement from n (c of them right) is right."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error over the values (sample standard deviation / sqrt(n); 0 for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def fitting_questions(tasks, tokenizer, questions: Sequence, max_new_tokens: int,
                      max_positions: int | None) -> tuple[list, list]:
    """``questions`` split into (those that fit, those skipped): a question fits when its chat prompt and
    ``max_new_tokens`` fit in ``max_positions`` (None: the model states no limit, every question fits)."""
    fit, skipped = [], []
    for task in questions:
        length = len(tasks.chat_prompt_ids(tokenizer, task))
        (fit if max_positions is None or length + max_new_tokens <= max_positions else skipped).append(task)
    return fit, skipped


def score_model(model, tokenizer, tasks, questions: Sequence, settings: EvalSettings, *, label: str, name: str,
                on_progress: Callable[[str], None] | None = None, check_stop: Callable[[], None] | None = None) -> ModelScores:
    """Generate and score the greedy and sampled completions of ``model`` on ``questions`` (Task objects of ``tasks``).

    Every question must fit the model's positions with ``settings.max_new_tokens`` (`fitting_questions`).
    ``on_progress`` hears a line such as "greedy: 512 of at most 1536 tokens in 10 s" every `PROGRESS_EVERY_S`;
    ``check_stop`` is called after every decode step and may raise to end the scoring there.
    """
    import torch

    from hivespec.node.model.engine import GenerationRequest, SamplingParams, TorchEngine
    from hivespec.node.model.loader import stop_token_ids

    engine = TorchEngine(model.eval(), max_batch_size=settings.batch_size)
    stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    prompts = [tuple(tasks.chat_prompt_ids(tokenizer, task)) for task in questions]
    scores = ModelScores(label, name, samples=settings.samples)

    def run(temperature: float, per_question: int, what: str) -> list[list[float]]:
        requests = [GenerationRequest(prompt, seed=EVAL_SEED, sample_index=q * per_question + j)
                    for q, prompt in enumerate(prompts) for j in range(per_question)]
        params = SamplingParams(temperature=temperature, top_p=settings.top_p, max_new_tokens=settings.max_new_tokens,
                                stop_token_ids=stops)
        report = _reporting(on_progress, what, len(requests) * settings.max_new_tokens) if on_progress else None

        def on_tokens(added: int) -> None:
            if check_stop is not None:
                check_stop()
            if report is not None:
                report(added)
        with torch.inference_mode():
            out = engine.generate(requests, params, speculative=False, on_tokens=on_tokens)
        rewards = [tasks.reward(questions[i // per_question], tokenizer.decode(o.completion_ids, skip_special_tokens=True))
                   for i, o in enumerate(out)]
        return [rewards[q * per_question:(q + 1) * per_question] for q in range(len(prompts))]

    scores.greedy = [row[0] for row in run(0.0, 1, "greedy")]
    if settings.samples:
        scores.correct = [int(sum(row)) for row in run(settings.temperature, settings.samples, f"{settings.samples} samples a question")]
    return scores


def _reporting(report: Callable[[str], None], what: str, most: int) -> Callable[[int], None]:
    """An engine's ``on_tokens`` that tells ``report`` how ``what`` goes (tokens made of at most ``most``), at most every
    `PROGRESS_EVERY_S`."""
    started = last = time.monotonic()
    made = 0

    def on_tokens(added: int) -> None:
        nonlocal made, last
        made += added
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            report(f"{what}: {made} of at most {most} tokens in {now - started:.0f} s")

    return on_tokens


@dataclass(frozen=True)
class Estimate:
    """One reported number: a mean over questions and its standard error."""

    mean: float
    se: float

    def __str__(self) -> str:
        return f"{self.mean:.3f} ± {self.se:.3f}"


def metrics(scores: ModelScores, ks: Sequence[int]) -> dict[str, Estimate]:
    out = {"greedy": Estimate(*mean_and_se(scores.greedy))}
    if scores.samples:
        for k in ks:
            out[f"pass@{k}"] = Estimate(*mean_and_se(scores.pass_at(k)))
    return out


def paired(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """The mean difference a - b over questions and its standard error (paired: the same questions)."""
    return Estimate(*mean_and_se([x - y for x, y in zip(a, b, strict=True)]))


def compare(base: ModelScores, trained: ModelScores, ks: Sequence[int]) -> dict[str, Estimate]:
    """trained - base for every metric, paired by question."""
    out = {"greedy": paired(trained.greedy, base.greedy)}
    if base.samples and trained.samples:
        for k in ks:
            out[f"pass@{k}"] = paired(trained.pass_at(k), base.pass_at(k))
    return out


def format_table(rows: Sequence[ModelScores], settings: EvalSettings, description: str) -> str:
    """The side-by-side table `hivespec eval` prints; the last row is trained - base when there are two models."""
    ks = settings.ks if settings.samples else []
    names = ["greedy", *(f"pass@{k}" for k in ks)]
    table = [[f"{r.label} ({r.model})", *(str(metrics(r, ks)[n]) for n in names)] for r in rows]
    if len(rows) == 2:
        diff = compare(rows[0], rows[1], ks)
        table.append([f"{rows[1].label} - {rows[0].label} (paired)", *(f"{diff[n].mean:+.3f} ± {diff[n].se:.3f}" for n in names)])
    header = ["model", "greedy", *(f"pass@{k} (T={settings.temperature:g}, n={settings.samples})" for k in ks)]
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(len(header))]
    lines = [description, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.append("± is one standard error over questions")
    return "\n".join(lines)


def to_json(rows: Sequence[ModelScores], settings: EvalSettings, questions: Sequence, skipped: Sequence = ()) -> dict:
    """What `hivespec eval --json` prints: settings, the questions scored and those skipped (`fitting_questions`),
    every metric (mean, se) and the paired difference."""
    ks = settings.ks if settings.samples else []
    result: dict = {
        "settings": {**settings.__dict__, "ks": ks},
        "questions": [t.prompt_id for t in questions],
        "skipped": [t.prompt_id for t in skipped],
        "models": {r.label: {"model": r.model, **{n: f.__dict__ for n, f in metrics(r, ks).items()},
                             "greedy_per_question": r.greedy, "correct_per_question": r.correct} for r in rows},
    }
    if len(rows) == 2:
        result["difference"] = {n: f.__dict__ for n, f in compare(rows[0], rows[1], ks).items()}
    return result
