"""Entropy and log-probs from logits."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algorithms.entropy import entropy_from_logits, logprobs_from_logits


def test_entropy_hand_computed():
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4
            [1000.0, 0.0, 0.0, 0.0],  # one-hot in practice: 0, and no overflow
            [0.0, 0.0, -math.inf, -math.inf],  # banned tokens: uniform over 2 -> ln 2
        ]
    )
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.tensor([math.log(4), 0.0, math.log(2)])
    )


def test_entropy_gradient_is_finite_with_banned_tokens():
    logits = torch.tensor([[0.5, -0.5, -math.inf]], requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2] == 0


def test_logprobs_hand_computed():
    # log softmax([0, ln 3])= [ln 1/4, ln 3/4]
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)]]])
    labels = torch.tensor([[0, 1]])
    torch.testing.assert_close(
        logprobs_from_logits(logits, labels), torch.tensor([[math.log(0.25), math.log(0.75)]])
    )


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.1, 30.0))
def test_match_torch_reference(seed, scale):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64) * scale
    labels = torch.randint(0, 11, (2, 3), generator=gen)
    reference = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(entropy_from_logits(logits), reference.entropy())
    torch.testing.assert_close(logprobs_from_logits(logits, labels), reference.log_prob(labels))


def test_bf16_is_computed_in_float32_by_chunks():
    gen = torch.Generator().manual_seed(0)
    logits32 = torch.randn(3, 5, 50, generator=gen) * 10
    labels = torch.randint(0, 50, (3, 5), generator=gen)
    logits = logits32.bfloat16().requires_grad_(True)
    logp = logprobs_from_logits(logits, labels, chunk_rows=4)  # 15 rows in 4 chunks
    entropy = entropy_from_logits(logits, chunk_rows=4)
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == entropy.shape == (3, 5)
    exact = logits.detach().float()  # same rounded inputs, full-precision reduction
    torch.testing.assert_close(
        logp, torch.log_softmax(exact, -1).gather(-1, labels[..., None])[..., 0]
    )
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=exact).entropy())
    (logp.sum() + entropy.sum()).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad.float()).all()


def test_logprobs_gradient():
    # d log softmax(z)_y / dz = onehot(y) - softmax(z)
    logits = torch.tensor([[0.0, math.log(3)]], requires_grad=True)
    logprobs_from_logits(logits, torch.tensor([1])).sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.25, 0.25]]))


def test_no_rows_give_an_empty_float32_result():
    # A micro-batch with no response token: (0, vocab) logits, bf16 as the model's.
    logits = torch.zeros(0, 7, dtype=torch.bfloat16)
    for out in (
        entropy_from_logits(logits),
        logprobs_from_logits(logits, torch.zeros(0, dtype=torch.long)),
    ):
        assert out.shape == (0,) and out.dtype == torch.float32
