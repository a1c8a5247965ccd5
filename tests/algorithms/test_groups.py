"""Group statistics for group-relative baselines."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algorithms.groups import group_stats


def test_group_stats_interleaved_and_singleton():
    # group 7: rows 0, 2 (scores 3, 1) -> mean 2, unbiased std sqrt(2)
    # group 0: row 1 alone (score 5) -> mean 5, std 0, size 1
    stats = group_stats(torch.tensor([3.0, 5.0, 1.0]), torch.tensor([7, 0, 7]))
    torch.testing.assert_close(stats.mean, torch.tensor([2.0, 5.0, 2.0]))
    torch.testing.assert_close(stats.std, torch.tensor([math.sqrt(2), 0.0, math.sqrt(2)]))
    assert stats.size.tolist() == [2, 1, 2]


def test_group_stats_std_matches_torch_std_and_accepts_strings():
    scores = torch.tensor([0.1, 0.7, 0.4, 2.0, 2.5], dtype=torch.float64)
    stats = group_stats(scores, ["u1", "u1", "u1", "u2", "u2"])
    torch.testing.assert_close(stats.std[0], scores[:3].std())
    torch.testing.assert_close(stats.std[3], scores[3:].std())


def test_group_stats_shape_check():
    with pytest.raises(ValueError, match=r"\(b,\)"):
        group_stats(torch.zeros(3), torch.tensor([0, 1]))


def test_an_empty_batch_has_no_groups():
    stats = group_stats(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert stats.mean.shape == stats.std.shape == stats.size.shape == (0,)
