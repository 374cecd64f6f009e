"""bench/round_time.py's part 1: ours against bare transformers, each side timed warm."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # the bench folder only; the repo root stays off sys.path

import round_time

from hivespec.node.model.loader import load_model
from hivespec.node.training.trainer import Trainer, TrainSample


def test_best_seconds_times_no_first_call_and_alternates():
    now = [0.0]
    calls: list[str] = []

    def run(name: str, first: float, later: float):
        def call() -> None:
            now[0] += first if name not in calls else later
            calls.append(name)
        return call

    # Ours pays 9 ticks at its first call (kernels for new shapes), 1 after; the baseline 1 always.
    best = round_time.best_seconds({"ours": run("ours", 10.0, 1.0), "bare": run("bare", 1.0, 1.0)}, 1, clock=lambda: now[0])
    assert best == {"ours": 1.0, "bare": 1.0}
    calls.clear()
    round_time.best_seconds({"a": run("a", 1.0, 1.0), "b": run("b", 1.0, 1.0)}, 3, clock=lambda: now[0])
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then the order alternates


def test_trainer_vs_bare_with_one_repeat_times_a_warm_trainer_step(monkeypatch):
    # --quick times one repeat: that step was the process's first backward (a tiny model in bf16
    # autocast: 0.20 s cold against 0.13 s warm, trainer_vs_bare 1.58 where warm it is 0.93-0.97).
    steps = []
    real_step = Trainer.step

    def counted(self, samples):
        steps.append(len(samples))
        return real_step(self, samples)

    monkeypatch.setattr(Trainer, "step", counted)
    model = load_model("tiny").requires_grad_(True)
    generator = torch.Generator().manual_seed(0)
    samples = [TrainSample(torch.randint(0, 1000, (12,), generator=generator).tolist(),
                           torch.randint(0, 1000, (6,), generator=generator).tolist(), [-5.0] * 6, float(i % 2), str(i // 2))
               for i in range(4)]
    result = round_time.trainer_vs_bare(model, None, samples, 4, repeats=1)
    assert steps == [4, 4]  # one untimed, one timed
    assert result["samples"] == 4 and result["trainer_step_s"] > 0 and result["bare_step_s"] > 0
