"""verify_drafts: the acceptance rule against a one-position-at-a-time reference, on random logits."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hivespec.kernels.sampling import sample_tokens
from hivespec.kernels.speculative import verify_drafts

torch.set_num_threads(1)


def _reference(logits, drafts, lengths, seeds, sample_ids, positions, temperature, top_p):
    """Plain decoding's view: sample each position alone, stop at the first draft the sample disagrees with."""
    out = []
    for i in range(logits.shape[0]):
        tokens, logprobs = [], []
        for j in range(logits.shape[1]):
            token, logprob = sample_tokens(
                logits[i, j][None], seed=int(seeds[i]), sample_ids=sample_ids[i : i + 1],
                positions=positions[i : i + 1] + j, temperature=temperature, top_p=top_p,
            )
            tokens.append(int(token))
            logprobs.append(float(logprob))
            if j >= int(lengths[i]) or int(drafts[i, j]) != tokens[-1]:
                break
        out.append((tokens, logprobs))
    return out


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 4),
    width=st.integers(0, 6),
    vocab=st.sampled_from([5, 37, 300]),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    agree=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**40),
)
def test_matches_one_position_at_a_time(rows, width, vocab, temperature, top_p, agree, seed):
    gen = torch.Generator().manual_seed(seed % 2**31)
    logits = torch.randn(rows, width + 1, vocab, generator=gen, dtype=torch.float64) * 3
    seeds = torch.randint(0, 2**62, (rows,), generator=gen)
    sample_ids = torch.randint(0, 50, (rows,), generator=gen)
    positions = torch.randint(0, 100, (rows,), generator=gen)
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    # Drafts that agree with the target's own samples with probability `agree` per position.
    truth, _ = sample_tokens(
        logits.reshape(-1, vocab), seed=seeds.repeat_interleave(width + 1),
        sample_ids=sample_ids.repeat_interleave(width + 1),
        positions=(positions[:, None] + torch.arange(width + 1)).reshape(-1),
        temperature=temperature, top_p=top_p,
    )
    truth = truth.view(rows, width + 1)[:, :width]
    wrong = (truth + 1 + torch.randint(0, vocab - 1, truth.shape, generator=gen)) % vocab
    drafts = torch.where(torch.rand(truth.shape, generator=gen) < agree, truth, wrong)

    got = verify_drafts(
        logits, drafts, lengths, seed=seeds, sample_ids=sample_ids, positions=positions,
        temperature=temperature, top_p=top_p,
    )
    for i, (tokens, logprobs) in enumerate(_reference(logits, drafts, lengths, seeds, sample_ids, positions, temperature, top_p)):
        accepted = int(got.accepted[i])
        assert accepted == len(tokens) - 1 <= int(lengths[i])
        assert got.tokens[i, : accepted + 1].tolist() == tokens
        assert got.logprobs[i, : accepted + 1].tolist() == pytest.approx(logprobs, abs=1e-6)


def test_padding_past_the_draft_length_is_never_accepted():
    logits = torch.full((1, 4, 10), -5.0)
    logits[0, :, 3] = 5.0  # greedy picks 3 everywhere
    drafts = torch.tensor([[3, 3, 3]])
    common = {"seed": 1, "sample_ids": torch.tensor([0]), "positions": torch.tensor([0]), "temperature": 0.0, "top_p": 1.0}
    assert verify_drafts(logits, drafts, torch.tensor([3]), **common).accepted.tolist() == [3]
    assert verify_drafts(logits, drafts, torch.tensor([1]), **common).accepted.tolist() == [1]
    wrong_first = torch.tensor([[4, 3, 3]])
    assert verify_drafts(logits, wrong_first, torch.tensor([3]), **common).accepted.tolist() == [0]


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"drafts must be \[B, K\]"):
        verify_drafts(
            torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
            seed=0, sample_ids=torch.zeros(2, dtype=torch.int64), positions=torch.zeros(2, dtype=torch.int64),
            temperature=1.0, top_p=1.0,
        )
