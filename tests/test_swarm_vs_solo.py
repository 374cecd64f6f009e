"""The swarm-vs-solo bench's helper logic: held-out split, curve aggregation and comparison, the plot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from PIL import Image

from hivespec.node.config import ConfigError, TaskConfig
from hivespec.node.tasks import TaskSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # the bench folder only; the repo root stays off sys.path

import swarm_vs_solo as svs


def test_heldout_questions_never_drawn_for_training():
    tasks = TaskSource(heldout_fraction=0.25)
    heldout = tasks.heldout(seed=0, count=32)
    assert len({t.question for t in heldout}) == 32
    assert all(tasks.is_heldout(t) for t in heldout)
    settings = svs.Settings(4, 30, 4, 4, 48, 2e-5, 0.5, 0.25, "bfloat16")
    trained = svs.training_questions(settings, tasks)
    assert len(trained) > 100
    assert svs.heldout_disjoint({t.question for t in heldout}, trained)
    # The split is by question text: every arith:d1 seed that renders a held-out question is held out.
    arith = tasks.families["arith"]
    held_texts = {t.question for t in heldout if t.family == "arith"}
    same_text = [arith.make(seed, 1) for seed in range(2000) if arith.make(seed, 1).question in held_texts]
    assert same_text and all(tasks.is_heldout(t) for t in same_text)
    assert not svs.heldout_disjoint({"What is 1 + 2?"}, {"What is 1 + 2?", "What is 3 + 4?"})


def test_heldout_fraction_zero_keeps_the_prompt_stream():
    assert TaskSource().prompts(seed=5, round=3, count=40) == TaskSource(heldout_fraction=0.0).prompts(seed=5, round=3, count=40)
    with pytest.raises(ValueError, match="no held-out questions"):
        TaskSource().heldout(seed=0, count=1)
    with pytest.raises(ValueError, match="heldout_fraction"):
        TaskSource(heldout_fraction=1.0)
    with pytest.raises(ConfigError, match="tasks.heldout_fraction"):
        TaskConfig(heldout_fraction=-0.1)
    with pytest.raises(ValueError, match="distinct held-out questions"):
        TaskSource([("arith", 1, 1.0)], heldout_fraction=0.25).heldout(seed=0, count=101)  # arith:d1 has 100 questions


def _round(i: int, reward: float, **extra) -> dict:
    return {"round": i, "reward_mean": reward, **extra}


def test_reward_curve_and_cumulative():
    rounds = {"a": [_round(0, 0.25), _round(1, 0.5), _round(2, 1.0)], "b": [_round(0, 0.75), _round(1, 0.0)]}
    assert svs.reward_curve(rounds) == [0.5, 0.25]  # only rounds every node finished
    assert svs.cumulative([0.5, 0.25, 0.25]) == [0.5, 0.75, 1.0]
    assert svs.reward_curve({}) == []
    mean, se = svs.paired_difference([0.5, 0.25, 0.75], [0.25, 0.25, 0.5])
    assert mean == pytest.approx(1 / 6) and se == pytest.approx((1 / 48) ** 0.5 / 3**0.5)  # diffs .25, 0, .25
    assert svs.paired_difference([0.5], [0.25]) == (0.25, 0.0)


def test_compare_curves_is_exact_and_names_the_first_difference():
    a = [_round(0, 0.5, tokens_generated=10), _round(1, 0.25, tokens_generated=12), _round(2, 0.5, tokens_generated=9)]
    same = [dict(r) for r in a]
    assert svs.compare_curves(a, same) == {"rounds": 3, "identical": True, "first_difference": None}
    off = [dict(r) for r in a]
    off[1]["reward_mean"] = 0.25 + 1e-12
    assert svs.compare_curves(a, off) == {"rounds": 3, "identical": False, "first_difference": 1}
    off[2]["tokens_generated"] = 8
    assert svs.compare_curves(a, off, ("tokens_generated",))["first_difference"] == 2
    assert svs.compare_curves(a, a[:2])["rounds"] == 2  # a run cut short compares its common rounds
    assert svs.compare_curves(a, [])["identical"] is False  # nothing to compare is not "identical"


def test_plot_writes_a_valid_png(tmp_path):
    path = tmp_path / "plot.png"
    svs.plot_curves(path, {"shared": ([0.3, 0.4, 0.6], (31, 119, 180)), "solo": ([0.3, 0.35, 0.4], (255, 127, 14))}, "reward")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (640, 400)
        colors = {color for _, color in image.convert("RGB").getcolors(maxcolors=1 << 20)}
    assert (31, 119, 180) in colors and (255, 127, 14) in colors  # both curves were drawn


def test_ratio_of_sums_and_its_delta_method_standard_error():
    shared, solo = [0.5, 0.25, 0.75, 0.5], [0.25, 0.25, 0.5, 0.5]
    ratio, se = svs.ratio_of_sums(shared, solo)
    assert ratio == pytest.approx(2.0 / 1.5)
    residuals = [a - ratio * b for a, b in zip(shared, solo, strict=True)]  # 1/6, -1/12, 1/12, -1/6
    assert se == pytest.approx((sum(e * e for e in residuals) * 4 / 3) ** 0.5 / 1.5)
    assert svs.ratio_of_sums([0.5, 1.0], [0.25, 0.5]) == (2.0, 0.0)  # proportional rounds: no spread around the ratio
    assert svs.ratio_of_sums([0.5], [0.0]) == (None, 0.0)  # solo earned nothing: no ratio
    assert svs.ratio_of_sums([0.5], [0.25]) == (2.0, 0.0)


def test_heldout_standard_errors_are_over_questions():
    mean, se = svs.mean_and_se([1.0, 0.0, 1.0, 0.0])
    assert mean == 0.5 and se == pytest.approx((1 / 3 / 4) ** 0.5)  # 0/1 scores: the binomial SE (n - 1 denominator)
    assert svs.mean_and_se([1.0]) == (1.0, 0.0)
    # Two nodes answer the same three questions: each question's score is the mean over the nodes.
    assert svs.question_means([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]) == [0.5, 0.0, 1.0]
    with pytest.raises(ValueError):
        svs.question_means([[1.0, 0.0], [1.0]])  # nodes scored on different question lists


def test_only_the_shared_condition_waits_and_no_wait_waits_for_nobody():
    """The shared nodes wait for their N-1 peers' new batches unless --no-wait (the public preset's rule); solo nodes never."""
    def expected(settings: svs.Settings, shared: bool) -> list[str]:
        sets = svs.node_sets(settings, index=1, shared=shared, speculation=False, engine_dtype="bfloat16", checkpoint=True)
        return [s for s in sets if s.startswith("swarm.expected_peers=")]

    waits = svs.Settings(3, 24, 2, 4, 48, 2e-5, 0.5, 0.25, "bfloat16")
    public = svs.Settings(3, 24, 2, 4, 48, 2e-5, 0.5, 0.25, "bfloat16", wait=False)
    assert expected(waits, True) == ["swarm.expected_peers=2"]
    assert expected(public, True) == expected(public, False) == expected(waits, False) == ["swarm.expected_peers=0"]
