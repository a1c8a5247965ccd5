"""Loss aggregation modes, and the micro-batch / global-count equivalence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, sequence_count

NAN = float("nan")
# Rows of length 3, 1 and 4 (padding in the middle of the batch); nan under padding.
LOSS = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN], [5.0, 6.0, 7.0, 8.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
# per-row sums: 6, 4, 26 (total 36); lengths 3, 1, 4 (total 8); per-row means 2, 4, 6.5


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, 36 / 8),  # 4.5
        ("token-mean", {"global_token_count": 16}, 36 / 16),
        ("seq-mean-token-sum", {}, 36 / 3),  # 12
        ("seq-mean-token-sum", {"global_seq_count": 6}, 36 / 6),
        ("seq-mean-token-mean", {}, (2 + 4 + 6.5) / 3),
        ("seq-mean-token-mean", {"global_seq_count": 5}, (2 + 4 + 6.5) / 5),
        ("seq-mean-token-sum-norm", {}, 36 / (3 * 4)),  # t = 4 -> 3
        ("seq-mean-token-sum-norm", {"norm_length": 6}, 36 / (3 * 6)),  # 2
        ("seq-mean-token-sum-norm", {"global_seq_count": 6, "norm_length": 6}, 36 / 36),
    ],
)
def test_hand_computed(mode, kwargs, expected):
    assert aggregate_loss(LOSS, MASK, mode, **kwargs).item() == pytest.approx(expected)


def test_empty_row_and_empty_batch():
    mask = MASK.clone()
    mask[1] = 0.0  # row 1 now has no token: token-mean 32 / 7
    assert aggregate_loss(LOSS, mask, "token-mean").item() == pytest.approx(32 / 7)
    # The seq-means leave the empty row out of N_seq (verl 0.9.1): rows 0 and 2 remain,
    # sums 6 and 26, means 2 and 6.5 (before, N_seq was 3: 8.5 / 3 and 32 / 3).
    assert sequence_count(mask).item() == 2
    assert aggregate_loss(LOSS, mask, "seq-mean-token-mean").item() == pytest.approx(8.5 / 2)
    assert aggregate_loss(LOSS, mask, "seq-mean-token-sum").item() == pytest.approx(32 / 2)
    # T = 4 (the width): 32 / (2 * 4)
    assert aggregate_loss(LOSS, mask, "seq-mean-token-sum-norm").item() == pytest.approx(4.0)
    for mode in LOSS_AGG_MODES:
        assert aggregate_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0


def test_gradient_is_mask_over_count_and_finite_under_nan_padding():
    loss = LOSS.clone().requires_grad_(True)
    aggregate_loss(loss, MASK, "token-mean").backward()
    torch.testing.assert_close(loss.grad, MASK / 8)


def test_unknown_mode_and_bad_shape():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match=r"\(b, t\)"):
        aggregate_loss(LOSS[0], MASK[0], "token-mean")


@st.composite
def mini_batches(draw):
    b, t = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    loss = torch.randn(b, t, generator=gen, dtype=torch.float64)
    if draw(st.booleans()):  # right padding, rows may be empty
        lengths = torch.randint(0, t + 1, (b,), generator=gen)
        mask = (torch.arange(t) < lengths[:, None]).double()
    else:  # arbitrary holes
        mask = (torch.rand(b, t, generator=gen) < 0.6).double()
    cuts = sorted(draw(st.lists(st.integers(1, b), max_size=3, unique=True)))
    bounds = [0, *[c for c in cuts if c < b], b]
    return loss, mask, bounds


@settings(max_examples=50, deadline=None)
@given(mini_batches(), st.sampled_from(LOSS_AGG_MODES), st.booleans())
def test_micro_batches_with_global_counts_sum_to_mini_batch_loss(batch, mode, trim):
    loss, mask, bounds = batch
    full = aggregate_loss(loss, mask, mode)
    counts = {
        "global_token_count": mask.sum(),
        "global_seq_count": sequence_count(mask),
        "norm_length": loss.shape[1],
    }
    total = torch.zeros((), dtype=loss.dtype)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        micro_loss, micro_mask = loss[lo:hi], mask[lo:hi]
        if trim:  # dynamic padding: each micro-batch cut to its own last valid column
            width = int(micro_mask.any(0).nonzero().max()) + 1 if micro_mask.any() else 1
            micro_loss, micro_mask = micro_loss[:, :width], micro_mask[:, :width]
        total = total + aggregate_loss(micro_loss, micro_mask, mode, **counts)
    torch.testing.assert_close(total, full)
