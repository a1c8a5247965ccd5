"""Counting a run's GPUs, and verl's per-GPU perf/throughput."""

from __future__ import annotations

import pytest
import torch

from meshrl.gpus import count_gpus, gathered_gpu_names, gpu_names, per_gpu_throughput


def test_a_gpu_shared_by_several_roles_counts_once():
    # actor on two GPUs, rollout co-located with its first one, reward on the CPU
    assert count_gpus([["GPU-a", "GPU-b"], ["GPU-a"], []]) == 2
    assert count_gpus([[], []]) == 0


def test_throughput_is_per_gpu_as_verls_and_the_whole_runs_without_a_gpu():
    assert per_gpu_throughput(8000.0, 2.0, 4) == 1000.0
    assert per_gpu_throughput(8000.0, 2.0, 1) == 4000.0
    assert per_gpu_throughput(8000.0, 2.0, 0) == 4000.0  # a CPU run


def test_a_cpu_device_names_no_gpu_and_gathers_without_a_process_group():
    assert gpu_names(torch.device("cpu")) == []
    assert gathered_gpu_names(torch.device("cpu")) == []  # no collective: none is set up


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_is_named_by_its_uuid_whatever_its_index():
    (name,) = gpu_names(torch.device("cuda", 0))
    assert name == str(torch.cuda.get_device_properties(0).uuid)
    assert gpu_names(torch.device("cuda")) == [name]  # no index: the current device
