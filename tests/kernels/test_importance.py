"""importance_weights: hand-computed weights and masks per mode, stats, forged behaviour log-probs, properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hivespec.kernels.importance import (
    ImportanceStats,
    ImportanceWeights,
    importance_weights,
)

torch.set_num_threads(1)

E = math.e


def _all(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bool)


def test_token_truncation_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0])
    behaviour = torch.tensor([-1.0, -1.0, -2.0, -3.5, -9.0])
    valid = torch.tensor([True, True, True, True, False])
    iw = importance_weights(logp, behaviour, valid, clip=2.0)
    expected = torch.tensor([1.0, math.exp(-1.0), 2.0, math.exp(0.5), 0.0])
    assert torch.allclose(iw.weights, expected, atol=1e-6, rtol=0)
    assert iw.kept.tolist() == [True, True, True, True, False]
    assert iw.truncated.tolist() == [False, False, True, False, False]
    kept = expected[:4].double()
    assert iw.stats() == ImportanceStats(
        tokens=4,
        kept_fraction=1.0,
        masked_fraction=0.0,
        vetoed_fraction=0.0,
        truncated_fraction=0.25,
        mean_weight=pytest.approx(kept.mean().item(), abs=1e-6),
        max_weight=2.0,
        ess_fraction=pytest.approx((kept.sum() ** 2 / (4 * (kept**2).sum())).item(), abs=1e-6),
    )


def test_token_mask_bounds_are_inclusive_and_masked_tokens_leave_the_count():
    # log-ratios: 0, -1 (0.37 < 0.5), 1.5 (4.48 > 2), 0.5 (1.65), log 0.5 and log 2 exactly (kept).
    log_ratio = torch.tensor([0.0, -1.0, 1.5, 0.5, math.log(0.5), math.log(2.0)])
    iw = importance_weights(log_ratio, torch.zeros(6), _all(6), clip=2.0, token_bounds=(0.5, 2.0))
    assert iw.kept.tolist() == [True, False, False, True, True, True]
    assert torch.allclose(iw.weights, torch.tensor([1.0, 0.0, 0.0, math.exp(0.5), 0.5, 2.0]), atol=1e-6)
    stats = iw.stats()
    assert stats.tokens == 6 and stats.kept_fraction == pytest.approx(4 / 6) and stats.masked_fraction == pytest.approx(2 / 6)
    assert stats.truncated_fraction == 0.0  # log 2 is at the cap, not above it
    kept = torch.tensor([1.0, math.exp(0.5), 0.5, 2.0], dtype=torch.float64)
    # masked tokens count in n with weight 0: ESS/n <= kept fraction
    assert stats.ess_fraction == pytest.approx((kept.sum() ** 2 / (6 * (kept**2).sum())).item(), abs=1e-6)
    assert stats.ess_fraction <= stats.kept_fraction


def test_token_mask_without_clip_keeps_raw_ratios():
    iw = importance_weights(torch.tensor([0.5, 1.2]), torch.zeros(2), _all(2), clip=None, token_bounds=(0.5, 3.0))
    assert torch.allclose(iw.weights, torch.tensor([math.exp(0.5), 0.0]), atol=1e-6)
    assert iw.kept.tolist() == [True, False]


def test_sequence_mask_on_geometric_mean_by_hand():
    # sequence 0: log-ratios 0.2, -0.2, 1.0 -> mean 1/3, geometric mean 1.40: kept, third token truncated at 2
    # sequence 1: 1.0, 1.0, 1.0 -> geometric mean e > 2: all masked
    # sequence 2: -1.0, 0.4 (+ one padding position with a wild ratio that must not count) -> mean -0.3: kept
    log_ratio = torch.tensor([0.2, -0.2, 1.0, 1.0, 1.0, 1.0, -1.0, 0.4, 50.0])
    sequence_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    valid = torch.tensor([True] * 8 + [False])
    iw = importance_weights(log_ratio, torch.zeros(9), valid, sequence_ids=sequence_ids, clip=2.0, sequence_bounds=(0.5, 2.0))
    assert iw.kept.tolist() == [True, True, True, False, False, False, True, True, False]
    expected = [math.exp(0.2), math.exp(-0.2), 2.0, 0, 0, 0, math.exp(-1.0), math.exp(0.4), 0]
    assert torch.allclose(iw.weights, torch.tensor(expected), atol=1e-6)
    stats = iw.stats()
    assert stats.tokens == 8 and stats.masked_fraction == pytest.approx(3 / 8) and stats.truncated_fraction == pytest.approx(1 / 8)


def test_sequence_ids_default_to_rows():
    log_ratio = torch.tensor([[0.1, 0.1], [1.0, 1.0]])
    iw = importance_weights(log_ratio, torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), sequence_bounds=(0.5, 2.0))
    assert iw.kept.tolist() == [[True, True], [False, False]]


def test_veto_masks_tokens_with_tiny_behaviour_probability():
    behaviour = torch.tensor([-1.0, -12.0, -3.0, -9.0])  # veto 1e-4 = exp(-9.21): token 1 only
    logp = torch.tensor([-1.0, -2.0, -3.0, -9.0])
    iw = importance_weights(logp, behaviour, _all(4), clip=2.0, veto=1e-4)
    assert iw.kept.tolist() == [True, False, True, True] and iw.vetoed.tolist() == [False, True, False, False]
    assert iw.weights.tolist() == [1.0, 0.0, 1.0, 1.0]
    stats = iw.stats()
    assert stats.vetoed_fraction == 0.25 and stats.masked_fraction == 0.25


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clip": 2.0},
        {"clip": 2.0, "token_bounds": (0.5, 2.0)},
        {"clip": 2.0, "sequence_bounds": (0.5, 2.0)},
        {"clip": None, "token_bounds": (0.5, 2.0), "veto": 1e-4},
    ],
)
def test_equal_logprobs_give_exactly_one(kwargs):
    logp = torch.randn(4, 9, dtype=torch.float64) - 3
    iw = importance_weights(logp, logp.clone(), torch.ones(4, 9, dtype=torch.bool), **kwargs)
    assert iw.weights.dtype == torch.float32 and torch.equal(iw.weights, torch.ones(4, 9))
    stats = iw.stats()
    assert stats.ess_fraction == 1.0 and stats.mean_weight == 1.0 and stats.max_weight == 1.0
    assert stats.kept_fraction == 1.0 and stats.truncated_fraction == 0.0


def test_weights_are_detached():
    logp = torch.randn(6, requires_grad=True)
    assert not importance_weights(logp, torch.zeros(6), _all(6)).weights.requires_grad


@pytest.mark.parametrize("forged", [-20.0, 0.0, float("-inf"), float("inf"), float("nan"), -1e30, 1e30])
@pytest.mark.parametrize("mode", ["truncate", "token", "sequence"])
def test_forged_behaviour_logprobs_stay_bounded_and_are_counted(forged, mode):
    logp = torch.tensor([-0.1, -5.0, -15.0, -2.0])
    kwargs = {"truncate": {"clip": 2.0}, "token": {"clip": 2.0, "token_bounds": (0.5, 2.0)},
              "sequence": {"clip": 2.0, "sequence_bounds": (0.5, 2.0)}}[mode]
    iw = importance_weights(logp, torch.full((4,), forged), _all(4), **kwargs)
    assert bool(torch.isfinite(iw.weights).all()) and bool((iw.weights >= 0).all()) and bool((iw.weights <= 2.0).all())
    stats = iw.stats()
    assert stats.tokens == 4 and all(math.isfinite(v) for v in (stats.mean_weight, stats.max_weight, stats.ess_fraction))
    assert stats.kept_fraction + stats.masked_fraction == pytest.approx(1.0)
    if math.isnan(forged):
        assert stats.masked_fraction == 1.0  # no information: never trained on
    elif forged == -20.0 and mode == "truncate":
        assert stats.truncated_fraction == 1.0 and stats.max_weight == 2.0  # every pi/mu is astronomically large
    elif forged == -20.0:
        assert stats.masked_fraction == 1.0


def test_empty_and_all_invalid():
    iw = importance_weights(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.bool), sequence_bounds=(0.5, 2.0))
    assert bool((iw.weights == 0).all()) and iw.stats() == ImportanceStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    empty = importance_weights(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool), sequence_bounds=(0.5, 2.0))
    assert empty.weights.numel() == 0 and empty.stats().tokens == 0


def test_stats_of_a_subset_and_concatenation():
    a = importance_weights(torch.tensor([0.0, 1.0]), torch.zeros(2), _all(2), clip=2.0)
    b = importance_weights(torch.tensor([-1.0]), torch.zeros(1), _all(1), clip=2.0)
    merged = ImportanceWeights.cat([a, b])
    assert merged.weights.shape == (3,) and merged.stats().truncated_fraction == pytest.approx(1 / 3)
    assert merged.stats(torch.tensor([False, False, True])).mean_weight == pytest.approx(math.exp(-1.0))


def test_bad_arguments():
    ones = _all(3)
    with pytest.raises(ValueError, match="clip"):
        importance_weights(torch.zeros(3), torch.zeros(3), ones, clip=0.0)
    with pytest.raises(ValueError, match="unbounded"):
        importance_weights(torch.zeros(3), torch.zeros(3), ones, clip=None)
    with pytest.raises(ValueError, match="one shape"):
        importance_weights(torch.zeros(3), torch.zeros(2), ones)
    with pytest.raises(ValueError, match="bool"):
        importance_weights(torch.zeros(3), torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match="token_bounds"):
        importance_weights(torch.zeros(3), torch.zeros(3), ones, token_bounds=(2.0, 0.5))
    with pytest.raises(ValueError, match="veto"):
        importance_weights(torch.zeros(3), torch.zeros(3), ones, veto=1.5)


_logprob = st.one_of(
    st.floats(min_value=-1e6, max_value=0.0),
    st.sampled_from([float("-inf"), float("nan"), 0.0, -20.0, 1e30, -1e30, float("inf")]),
)
_bounds = st.one_of(st.none(), st.tuples(st.floats(1e-3, 1.0), st.floats(1.0, 1e3)))


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.tuples(_logprob, _logprob, st.booleans(), st.integers(0, 3)), min_size=1, max_size=24),
    clip=st.one_of(st.none(), st.floats(min_value=1e-3, max_value=1e3)),
    token_bounds=_bounds,
    sequence_bounds=_bounds,
    veto=st.one_of(st.none(), st.floats(1e-9, 0.5)),
)
def test_weights_always_finite_and_bounded(rows, clip, token_bounds, sequence_bounds, veto):
    if clip is None and token_bounds is None:
        clip = 2.0
    logp, behaviour, valid, seq = (torch.tensor(col) for col in zip(*rows))
    iw = importance_weights(
        logp.float(), behaviour.float(), valid.bool(), sequence_ids=seq, clip=clip,
        token_bounds=token_bounds, sequence_bounds=sequence_bounds, veto=veto,
    )
    cap = min(c for c in (clip, token_bounds[1] if token_bounds else None) if c is not None)
    assert bool(torch.isfinite(iw.weights).all())
    assert bool((iw.weights >= 0).all()) and bool((iw.weights <= cap * (1 + 1e-6)).all())
    assert bool((iw.weights[~iw.kept] == 0).all()) and not bool((iw.kept & ~valid.bool()).any())
    stats = iw.stats()
    for value in (stats.kept_fraction, stats.masked_fraction, stats.truncated_fraction, stats.vetoed_fraction):
        assert 0.0 <= value <= 1.0
    assert stats.kept_fraction + stats.masked_fraction == pytest.approx(1.0) or stats.tokens == 0
    assert 0.0 <= stats.ess_fraction <= stats.kept_fraction + 1e-9
    assert stats.max_weight <= cap * (1 + 1e-6)
