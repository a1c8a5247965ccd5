"""Staleness of a sample (from its oldest token) and its histogram metrics, by hand."""

from __future__ import annotations

import pytest
import torch

from services.coordinator.generation.staleness import sample_lags, staleness_metrics


def test_lags_and_histogram_by_hand():
    # step 7 trains the actor of version 6; samples first sampled by versions 6, 5, 5, 4
    lags = sample_lags(torch.tensor([6, 5, 5, 4]), actor_version=6)
    assert lags.tolist() == [0, 1, 1, 2]
    metrics = staleness_metrics(lags, max_staleness=2)
    assert metrics == pytest.approx(
        {
            "async/staleness/mean": 1.0,  # (0 + 1 + 1 + 2) / 4
            "async/staleness/max": 2.0,
            "async/staleness/lag_0": 0.25,
            "async/staleness/lag_1": 0.5,
            "async/staleness/lag_2": 0.25,
        }
    )


def test_no_samples_no_metrics():
    assert staleness_metrics(torch.zeros(0, dtype=torch.int64), 1) == {}
