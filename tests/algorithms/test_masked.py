"""Masked reductions: hand-computed values, nan-safe padding, empty masks, properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algorithms.masked import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    safe_div,
    zero_masked,
)

NAN = float("nan")
# Rows of length 3, 1 and 4: padding in the middle of the batch. Padded slots hold nan
# to prove that they are never read.
X = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN], [5.0, 6.0, 7.0, 8.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])


def test_masked_sum_and_mean_over_batch():
    # valid entries are 1..8: sum 36, count 8, mean 36 / 8 = 4.5
    assert masked_sum(X, MASK).item() == 36.0
    assert masked_mean(X, MASK).item() == 4.5


def test_masked_sum_and_mean_per_row():
    # row 0: 1+2+3 = 6 over 3; row 1: 4 over 1; row 2: 5+6+7+8 = 26 over 4
    torch.testing.assert_close(masked_sum(X, MASK, dim=-1), torch.tensor([6.0, 4.0, 26.0]))
    torch.testing.assert_close(masked_mean(X, MASK, dim=-1), torch.tensor([2.0, 4.0, 6.5]))
    # per column: col 0 = (1+4+5)/3, col 3 = 8/1
    torch.testing.assert_close(masked_mean(X, MASK, dim=0), torch.tensor([10 / 3, 4.0, 5.0, 8.0]))


def test_bool_mask_equals_float_mask():
    assert masked_mean(X, MASK.bool()).item() == masked_mean(X, MASK).item()
    torch.testing.assert_close(masked_whiten(X, MASK.bool()), masked_whiten(X, MASK))


def test_float_mask_entries_act_as_weights():
    # sum(x * w) / sum(w) = (1 * 1 + 3 * 0.5) / 1.5 = 2.5 / 1.5
    x = torch.tensor([[1.0, 3.0]])
    w = torch.tensor([[1.0, 0.5]])
    assert masked_mean(x, w).item() == pytest.approx(2.5 / 1.5)


def test_masked_var():
    # deviations from 4.5: +-3.5, +-2.5, +-1.5, +-0.5
    # sum of squares = 2 * (12.25 + 6.25 + 2.25 + 0.25) = 42
    # biased 42 / 8 = 5.25 ; unbiased 42 / 7 = 6
    assert masked_var(X, MASK, unbiased=False).item() == pytest.approx(5.25)
    assert masked_var(X, MASK).item() == pytest.approx(6.0)


def test_masked_whiten():
    # (x - 4.5) / sqrt(6 + 1e-8) on valid entries, 0 on padding
    expected = torch.where(MASK.bool(), (X - 4.5) / math.sqrt(6.0 + 1e-8), torch.zeros(()))
    torch.testing.assert_close(masked_whiten(X, MASK), expected)
    # shift_mean=False only rescales: the mean 4.5 is added back
    expected_unshifted = torch.where(MASK.bool(), expected + 4.5, torch.zeros(()))
    torch.testing.assert_close(masked_whiten(X, MASK, shift_mean=False), expected_unshifted)


def test_empty_mask_gives_zeros_not_nan():
    mask = torch.zeros_like(MASK)
    assert masked_sum(X, mask).item() == 0.0
    assert masked_mean(X, mask).item() == 0.0
    assert masked_var(X, mask).item() == 0.0
    torch.testing.assert_close(masked_mean(X, mask, dim=-1), torch.zeros(3))
    torch.testing.assert_close(masked_whiten(X, mask), torch.zeros_like(X))


def test_single_token_has_zero_unbiased_variance():
    # Bessel's n / (n - 1) is undefined for n = 1: defined as 0 (verl raises)
    mask = torch.zeros_like(MASK)
    mask[1, 0] = 1.0
    assert masked_var(X, mask).item() == 0.0
    torch.testing.assert_close(masked_whiten(X, mask), torch.zeros_like(X))


def test_nan_padding_does_not_reach_the_gradient():
    x = X.clone().requires_grad_(True)
    masked_mean(x, MASK).backward()
    # d mean / d x = mask / 8 exactly; padding gets 0, not nan
    torch.testing.assert_close(x.grad, MASK / 8)


def test_zero_masked_and_safe_div():
    torch.testing.assert_close(
        zero_masked(X, MASK),
        torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [5.0, 6.0, 7.0, 8.0]]),
    )
    assert safe_div(torch.tensor(0.0), 0).item() == 0.0
    assert safe_div(torch.tensor(3.0), torch.tensor(2.0)).item() == 1.5


@st.composite
def values_and_mask(draw):
    b, t = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(b, t, generator=gen, dtype=torch.float64) * draw(st.floats(0.1, 100.0))
    mask = torch.rand(b, t, generator=gen) < draw(st.floats(0.1, 1.0))  # arbitrary holes
    return x, mask


@settings(max_examples=50, deadline=None)
@given(values_and_mask())
def test_masked_mean_matches_mean_of_selected(batch):
    x, mask = batch
    selected = x[mask]
    expected = selected.mean() if selected.numel() else torch.tensor(0.0, dtype=x.dtype)
    torch.testing.assert_close(masked_mean(x, mask), expected)
    if selected.numel() > 1:
        torch.testing.assert_close(masked_var(x, mask), selected.var())


@settings(max_examples=50, deadline=None)
@given(values_and_mask())
def test_whitened_values_have_zero_mean_unit_variance(batch):
    x, mask = batch
    selected = x[mask]
    if selected.numel() < 2 or selected.var() < 1e-3:
        return  # nothing to normalise: covered by the degenerate-case tests above
    w = masked_whiten(x, mask)
    assert abs(masked_mean(w, mask).item()) < 1e-9
    assert masked_var(w, mask).item() == pytest.approx(1.0, abs=1e-5)
    assert (w[~mask] == 0).all()
