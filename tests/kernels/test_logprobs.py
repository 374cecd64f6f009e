"""token_logprobs against the naive full-logits reference: forward, gradients, dtypes, chunking."""

import pytest
import torch
import torch.nn.functional as F

from hivespec.kernels.logprobs import token_logprobs

torch.set_num_threads(1)


def _reference(hidden, weight, targets, temperature=1.0):
    logits = (hidden @ weight.T).float() if hidden.dtype != torch.float64 else hidden @ weight.T
    return F.log_softmax(logits / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)


def _inputs(dtype=torch.float64, lead=(3, 7), hidden_size=16, vocab=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    targets = torch.randint(0, vocab, lead, generator=gen)
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [1, 4, 21, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_forward_and_gradients_match_reference_float64(chunk_size, temperature):
    hidden, weight, targets = _inputs()
    grad_out = torch.randn(targets.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = token_logprobs(h1, w1, targets, temperature=temperature, chunk_size=chunk_size)
    (out * grad_out).sum().backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = _reference(h2, w2, targets, temperature)
    (ref * grad_out).sum().backward()
    assert out.shape == targets.shape and out.dtype == torch.float64
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    assert torch.allclose(h1.grad, h2.grad, atol=1e-12, rtol=0)
    assert torch.allclose(w1.grad, w2.grad, atol=1e-12, rtol=0)


def test_gradcheck():
    hidden, weight, targets = _inputs(lead=(5,), hidden_size=4, vocab=7)
    hidden.requires_grad_()
    weight.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, w: token_logprobs(h, w, targets, temperature=0.9, chunk_size=2), (hidden, weight)
    )


def test_only_hidden_requires_grad():
    hidden, weight, targets = _inputs()
    hidden.requires_grad_()
    token_logprobs(hidden, weight, targets, chunk_size=5).sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_bf16_hidden_with_fp32_weight_promotes_and_returns_grads_in_own_dtypes():
    hidden, weight, targets = _inputs(dtype=torch.float32)
    hidden_bf16 = hidden.bfloat16().requires_grad_()
    weight = weight.requires_grad_()
    out = token_logprobs(hidden_bf16, weight, targets, chunk_size=8)
    out.sum().backward()
    assert out.dtype == torch.float32
    assert hidden_bf16.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    # The matmul ran in fp32 on the bf16-rounded hidden, so it matches that reference closely.
    ref = _reference(hidden_bf16.detach().float(), weight.detach(), targets)
    assert torch.allclose(out, ref, atol=1e-5)


def test_bf16_inputs_under_autocast_are_close_to_fp32():
    hidden, weight, targets = _inputs(dtype=torch.float32)
    h, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = token_logprobs(h, w, targets, chunk_size=8)
    out.sum().backward()
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert torch.allclose(out, _reference(hidden, weight, targets), atol=0.1)
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


def test_bad_arguments():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match=r"\[V, H\]"):
        token_logprobs(hidden, weight.T, targets)
    with pytest.raises(ValueError, match="leading shape"):
        token_logprobs(hidden, weight, targets[:, :3])


def test_bf16_backward_keeps_forward_values_and_approximates_gradients():
    hidden, weight, targets = _inputs(dtype=torch.float32, lead=(4, 9), hidden_size=32, vocab=300)
    grad_out = torch.randn(targets.shape, generator=torch.Generator().manual_seed(3))
    results = []
    for grad_dtype in (None, torch.bfloat16):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = token_logprobs(h, w, targets, chunk_size=7, grad_dtype=grad_dtype)
        (out * grad_out).sum().backward()
        results.append((out.detach(), h.grad, w.grad))
    (out32, h32, w32), (out16, h16, w16) = results
    assert torch.equal(out32, out16)  # the forward (what importance ratios read) is untouched
    assert h16.dtype == torch.float32 and w16.dtype == torch.float32
    for exact, approx in ((h32, h16), (w32, w16)):
        assert (approx - exact).norm() / exact.norm() < 2e-2


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
@pytest.mark.parametrize("scale, softcap", [(1.0, 2.0), (0.125, None), (3.0, 1.5)], ids=["gemma-cap", "granite-scale", "both"])
def test_model_logit_transforms_match_reference_float64(chunk_size, scale, softcap):
    """A head with a bias, its logits scaled and soft-capped before the temperature (Phi, Granite, Cohere, Gemma 2/3):
    values and every gradient (bias included) are the full-logits reference's."""
    hidden, weight, targets = _inputs()
    bias = torch.randn(weight.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    grad_out = torch.randn(targets.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    results = []
    for kernel in (True, False):
        h, w, b = hidden.clone().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()
        if kernel:
            out = token_logprobs(h, w, targets, temperature=0.7, bias=b, scale=scale, softcap=softcap, chunk_size=chunk_size)
        else:
            logits = (h @ w.T + b) * scale
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            out = F.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
        (out * grad_out).sum().backward()
        results.append((out.detach(), h.grad, w.grad, b.grad))
    for got, want in zip(*results):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(
        lambda h, w, b: token_logprobs(h, w, targets[0], temperature=0.9, bias=b, scale=scale, softcap=softcap, chunk_size=2),
        (hidden[0].clone().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()),
    )


def test_bad_head_arguments():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="scale and softcap"):
        token_logprobs(hidden, weight, targets, scale=0.0)
    with pytest.raises(ValueError, match="scale and softcap"):
        token_logprobs(hidden, weight, targets, softcap=float("inf"))
    with pytest.raises(ValueError, match="bias"):
        token_logprobs(hidden, weight, targets, bias=torch.zeros(weight.shape[0] + 1, dtype=weight.dtype))
