"""An update's peak GPU memory (``perf/max_memory_*_gb/<role>``): what the update itself
held, not what a pass before it did; nothing off a GPU."""

import pytest
import torch

from services.trainer.mfu import UpdateTimer, peak_memory_metrics


def test_no_memory_metrics_off_a_gpu():
    with UpdateTimer(torch.device("cpu")):
        torch.ones(1000)
    assert peak_memory_metrics("actor", torch.device("cpu")) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_is_the_updates_own():
    device = torch.device("cuda")
    gib = 1024**3
    before = torch.empty(gib // 2, dtype=torch.uint8, device=device)  # a pass before: 0.5 GiB
    del before
    with UpdateTimer(device):
        held = torch.empty(gib // 8, dtype=torch.uint8, device=device)  # the update: 0.125 GiB
    metrics = peak_memory_metrics("critic", device)
    assert set(metrics) == {
        "perf/max_memory_allocated_gb/critic",
        "perf/max_memory_reserved_gb/critic",
    }
    assert 0.125 <= metrics["perf/max_memory_allocated_gb/critic"] < 0.5
    assert metrics["perf/max_memory_reserved_gb/critic"] >= 0.125
    del held
