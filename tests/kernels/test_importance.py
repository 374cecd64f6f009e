"""truncated_importance_weights: hand-computed cases, stats, forged behaviour log-probs, properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hivespec.kernels.importance import ImportanceStats, truncated_importance_weights

torch.set_num_threads(1)


def test_hand_computed_weights_and_stats():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0])
    behaviour = torch.tensor([-1.0, -1.0, -2.0, -3.5, -9.0])
    mask = torch.tensor([True, True, True, True, False])
    w, stats = truncated_importance_weights(logp, behaviour, mask, clip=2.0)
    expected = torch.tensor([1.0, math.exp(-1.0), 2.0, math.exp(0.5), 0.0])
    assert torch.allclose(w, expected, atol=1e-6, rtol=0)
    kept = expected[:4].double()
    assert stats == ImportanceStats(
        tokens=4,
        kept_fraction=0.8,
        truncated_fraction=0.25,
        mean_weight=pytest.approx(kept.mean().item(), abs=1e-6),
        max_weight=2.0,
        ess_fraction=pytest.approx((kept.sum() ** 2 / (4 * (kept**2).sum())).item(), abs=1e-6),
    )


def test_equal_logprobs_give_exactly_one_and_full_ess():
    logp = torch.randn(4, 9, dtype=torch.float64) - 3
    w, stats = truncated_importance_weights(logp, logp.clone(), torch.ones(4, 9, dtype=torch.bool))
    assert w.dtype == torch.float32 and bool((w == 1.0).all())
    assert stats.ess_fraction == 1.0 and stats.truncated_fraction == 0.0 and stats.mean_weight == 1.0


def test_weights_are_detached():
    logp = torch.randn(6, requires_grad=True)
    w, _ = truncated_importance_weights(logp, torch.zeros(6), torch.ones(6, dtype=torch.bool))
    assert not w.requires_grad


@pytest.mark.parametrize("forged", [-20.0, 0.0, float("-inf"), float("inf"), float("nan"), -1e30])
def test_forged_behaviour_logprobs_give_finite_bounded_weights(forged):
    logp = torch.tensor([-0.1, -5.0, -30.0, float("-inf")])
    w, stats = truncated_importance_weights(logp, torch.full((4,), forged), torch.ones(4, dtype=torch.bool), clip=3.0)
    assert bool(torch.isfinite(w).all()) and bool((w >= 0).all()) and bool((w <= 3.0).all())
    assert all(math.isfinite(v) for v in (stats.mean_weight, stats.max_weight, stats.ess_fraction))


def test_empty_mask_gives_zero_stats():
    w, stats = truncated_importance_weights(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.bool))
    assert bool((w == 0).all()) and stats == ImportanceStats(0, 0.0, 0.0, 0.0, 0.0, 0.0)


def test_bad_arguments():
    ones = torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="clip"):
        truncated_importance_weights(torch.zeros(3), torch.zeros(3), ones, clip=0.0)
    with pytest.raises(ValueError, match="one shape"):
        truncated_importance_weights(torch.zeros(3), torch.zeros(2), ones)
    with pytest.raises(ValueError, match="bool"):
        truncated_importance_weights(torch.zeros(3), torch.zeros(3), torch.ones(3))


_logprob = st.one_of(
    st.floats(min_value=-1e6, max_value=0.0),
    st.sampled_from([float("-inf"), float("nan"), 0.0, -20.0, 1e30, -1e30]),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(_logprob, _logprob, st.booleans()), min_size=1, max_size=20),
    st.floats(min_value=1e-3, max_value=1e3),
)
def test_weights_always_finite_within_clip(rows, clip):
    logp, behaviour, mask = (torch.tensor(col) for col in zip(*rows))
    w, stats = truncated_importance_weights(logp.float(), behaviour.float(), mask.bool(), clip=clip)
    assert bool(torch.isfinite(w).all())
    assert bool((w >= 0).all()) and bool((w <= clip).all())
    assert bool((w[~mask.bool()] == 0).all())
    assert 0.0 <= stats.ess_fraction <= 1.0 + 1e-9
    assert 0.0 <= stats.truncated_fraction <= 1.0 and 0.0 <= stats.kept_fraction <= 1.0
