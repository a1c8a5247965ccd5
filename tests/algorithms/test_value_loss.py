"""Clipped value loss."""

from __future__ import annotations

import pytest
import torch

from meshrl.algorithms.value_loss import clipped_value_loss

NAN = float("nan")
# cliprange 0.2. Rows of length 2, 1, 3 (t = 3), nan under padding.
# token  v     v_old  R     v_clip  (v-R)^2  (v_clip-R)^2  max   clipped branch taken
#  p     1.0   0.5    2.0   0.7     1.00     1.69          1.69  yes
#  q     0.6   0.5    0.0   0.6     0.36     0.36          0.36  no (equal)
#  s     0.0   0.5    1.0   0.3     1.00     0.49          1.00  no
#  u     0.0   0.5    0.0   0.3     0.00     0.09          0.09  yes
# layout: row 0 [p, q | pad], row 1 [s | pad, pad], row 2 [u, q, s]
# sum = 1.69 + 0.36 + 1.0 + 0.09 + 0.36 + 1.0 = 4.5 over 6 tokens -> 0.5 * 4.5 / 6 = 0.375
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float64)
VALUES = torch.tensor([[1.0, 0.6, NAN], [0.0, NAN, NAN], [0.0, 0.6, 0.0]], dtype=torch.float64)
OLD = torch.tensor([[0.5, 0.5, NAN], [0.5, NAN, NAN], [0.5, 0.5, 0.5]], dtype=torch.float64)
RETURNS = torch.tensor([[2.0, 0.0, NAN], [1.0, NAN, NAN], [0.0, 0.0, 1.0]], dtype=torch.float64)


def test_hand_computed():
    out = clipped_value_loss(VALUES, OLD, RETURNS, MASK)
    assert out.loss.item() == pytest.approx(0.375)
    assert out.clipfrac.item() == pytest.approx(2 / 6)  # p and u


def test_gradient():
    values = VALUES.clone().requires_grad_(True)
    clipped_value_loss(values, OLD, RETURNS, MASK).loss.backward()
    # p, u: the clipped branch is constant in v -> 0. q: v is inside the clip range, both
    # branches equal v - R = 0.6 ; s: unclipped branch, v - R = -1. Each times 0.5 * 2 / 6.
    expected = torch.tensor([[0, 0.6, 0], [-1.0, 0, 0], [0, 0.6, -1.0]], dtype=torch.float64) / 6
    torch.testing.assert_close(values.grad, expected)


def test_unclipped_and_seq_mean_mode():
    out = clipped_value_loss(VALUES, OLD, RETURNS, MASK, cliprange_value=None)
    # (v - R)^2: 1, 0.36, 1, 0, 0.36, 1 -> 3.72 ; 0.5 * 3.72 / 6
    assert out.loss.item() == pytest.approx(0.5 * 3.72 / 6)
    assert out.clipfrac.item() == 0.0
    # per-row sums of the clipped losses: 2.05, 1.0, 1.45 -> 0.5 * 4.5 / 3
    out = clipped_value_loss(VALUES, OLD, RETURNS, MASK, loss_agg_mode="seq-mean-token-sum")
    assert out.loss.item() == pytest.approx(0.75)


def test_large_cliprange_is_plain_mse():
    out = clipped_value_loss(
        VALUES, OLD, RETURNS, MASK, cliprange_value=100.0, global_token_count=12
    )
    assert out.loss.item() == pytest.approx(0.5 * 3.72 / 12)
