"""Explained variance and masked stats."""

from __future__ import annotations

import pytest
import torch

from meshrl.algorithms.metrics import explained_variance, masked_stats

NAN = float("nan")
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])  # lengths 3 and 1
RETURNS = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN]], dtype=torch.float64)


def test_explained_variance_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [3.0, NAN, NAN]], dtype=torch.float64)
    # R - V = [0, 0, 0, 1]: mean 0.25, unbiased var (3 * 0.0625 + 0.5625) / 3 = 0.25
    # Var[R] of [1, 2, 3, 4] = 5/3 -> EV = 1 - 0.25 / (5/3 + 1e-5) ~ 0.85
    ev = explained_variance(values, RETURNS, MASK)
    assert ev.item() == pytest.approx(1 - 0.25 / (5 / 3 + 1e-5))


def test_explained_variance_extremes():
    assert explained_variance(RETURNS, RETURNS, MASK).item() == pytest.approx(1.0)
    # a constant critic explains nothing: 1 - var / (var + 1e-5) ~ 0
    assert explained_variance(torch.zeros_like(RETURNS), RETURNS, MASK).item() == pytest.approx(
        0.0, abs=1e-4
    )


def test_masked_stats():
    stats = masked_stats(RETURNS, MASK, "critic/returns")
    assert stats == {
        "critic/returns/mean": 2.5,
        "critic/returns/max": 4.0,
        "critic/returns/min": 1.0,
    }
    # 1-D works too, e.g. per-sequence scores with an all-ones mask
    per_seq = masked_stats(torch.tensor([1.0, -2.0]), torch.ones(2), "critic/score")
    assert per_seq == {"critic/score/mean": -0.5, "critic/score/max": 1.0, "critic/score/min": -2.0}
    empty = masked_stats(RETURNS, torch.zeros(2, 3), "critic/values")
    assert empty == {"critic/values/mean": 0.0, "critic/values/max": 0.0, "critic/values/min": 0.0}
