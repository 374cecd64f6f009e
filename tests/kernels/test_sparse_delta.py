"""extract_delta / apply_delta: bit-exact round trips in every float width, and input checks."""

import pytest
import torch

from hivespec.kernels import delta as delta_kernels
from hivespec.kernels.delta import apply_delta, extract_delta, mismatch_count, mismatch_counts

torch.set_num_threads(1)

_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _bit_equal(a, b):
    return torch.equal(a.reshape(-1).view(_INT[a.dtype]), b.reshape(-1).view(_INT[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.1, 1.0])
def test_round_trip_is_bit_exact(dtype, density):
    gen = torch.Generator().manual_seed(int(density * 1000))
    base = torch.randn(37, 53, generator=gen).to(dtype)
    new = base.clone()
    changed = torch.rand(base.shape, generator=gen) < density
    new[changed] = (base[changed].float() + torch.randn(int(changed.sum()), generator=gen)).to(dtype)
    indices, values = extract_delta(base, new)
    assert indices.dtype == torch.int64 and values.dtype == dtype
    assert bool((indices[1:] > indices[:-1]).all())
    target = base.clone()
    apply_delta(target, indices, values)
    assert _bit_equal(target, new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_signed_zero_and_nan_payloads_are_bit_exact(dtype):
    int_dtype = _INT[dtype]
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=dtype)
    new = torch.tensor([-0.0, 1.0, 0.0, 2.0], dtype=dtype)
    # A NaN with a different payload from torch's default one.
    new_bits = new.view(int_dtype)
    new_bits[2] = base.view(int_dtype)[2] | 1
    new_bits[3] = base.view(int_dtype)[2]
    indices, values = extract_delta(base, new)
    assert indices.tolist() == [0, 2, 3]
    target = base.clone()
    apply_delta(target, indices, values)
    assert _bit_equal(target, new)
    assert extract_delta(new, new.clone())[0].numel() == 0
    count = mismatch_count(base, new)
    assert count.dtype == torch.int64 and count.dim() == 0 and int(count) == 3  # -0.0 vs 0.0 and NaN payloads count
    assert int(mismatch_count(new, new.clone())) == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_counts_on_the_host_agree_with_torch_across_pieces_threads_and_layouts(monkeypatch, threads):
    """`mismatch_counts` compares CPU tensors with numpy in pieces spread over torch's threads: every tensor's count
    must be torch's, for pieces that split a tensor unevenly, a non-contiguous tensor and every dtype width."""
    monkeypatch.setattr(delta_kernels, "_PIECE", 1000)  # the 37 x 53 tensors below span two pieces, the last one short
    gen = torch.Generator().manual_seed(threads)
    pairs = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8):
        base = (torch.randn(37, 53, generator=gen) * 50).to(dtype)
        new = base.clone()
        new[torch.rand(base.shape, generator=gen) < 0.3] += 1
        pairs.append((base, new))
    base = torch.randn(53, 37, generator=gen).T  # non-contiguous: compared in row-major order
    new = base.clone()
    new[::3, ::2] = 7.0
    pairs += [(base, new), (torch.zeros(0), torch.zeros(0)), (torch.zeros(5), torch.zeros(5))]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        counts = mismatch_counts(pairs)
    finally:
        torch.set_num_threads(previous)
    expected = [int(torch.count_nonzero(a.reshape(-1) != b.reshape(-1))) for a, b in pairs]
    assert [int(c) for c in counts] == expected and expected[0] > 0 and expected[-1] == 0
    assert all(c.dtype == torch.int64 and c.dim() == 0 for c in counts)
    with pytest.raises(ValueError, match="must match"):
        mismatch_counts([(torch.zeros(3), torch.zeros(4))])


def test_apply_into_parameter_that_requires_grad():
    param = torch.nn.Parameter(torch.zeros(4, 3))
    new = param.detach().clone()
    new[1, 2] = 5.0
    apply_delta(param, *extract_delta(param, new))
    assert _bit_equal(param.detach(), new) and param.requires_grad


def test_non_contiguous_inputs_extract_in_row_major_order():
    base = torch.zeros(3, 4).T
    new = base.clone()
    new[0, 2] = 1.0
    indices, values = extract_delta(base, new)
    assert indices.tolist() == [2] and values.tolist() == [1.0]


def test_checks_raise_before_writing():
    target = torch.zeros(6)
    good_idx, good_val = torch.tensor([1, 4]), torch.ones(2)
    cases = [
        (torch.zeros(3, 4).T, good_idx, good_val, "contiguous"),
        (target, good_idx.int(), good_val, "int64"),
        (target, good_idx, torch.ones(3), "one value per index"),
        (target, good_idx, torch.ones(2, dtype=torch.float64), "cast on the sender"),
        (target, torch.tensor([1, 6]), good_val, "6 elements"),
        (target, torch.tensor([-1, 2]), good_val, "span"),
        (target, torch.tensor([4, 1]), good_val, "strictly ascending"),
        (target, torch.tensor([2, 2]), good_val, "strictly ascending"),
    ]
    for tensor, idx, val, match in cases:
        with pytest.raises(ValueError, match=match):
            apply_delta(tensor, idx, val)
    assert bool((target == 0).all())
    with pytest.raises(ValueError, match="shape and dtype"):
        extract_delta(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="shape and dtype"):
        extract_delta(torch.zeros(3), torch.zeros(3, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_returns_what_it_overwrote_so_it_can_be_undone(dtype):
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(64, generator=gen).to(dtype)
    new = base.clone()
    new[::7] += 1
    target = base.clone()
    indices, values = extract_delta(base, new)
    previous = apply_delta(target, indices, values)
    assert _bit_equal(target, new) and previous.dtype == dtype
    apply_delta(target, indices, previous)
    assert _bit_equal(target, base)
