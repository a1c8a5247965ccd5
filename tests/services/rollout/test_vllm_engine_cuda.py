"""vLLM for real, on a GPU with vllm installed (skipped elsewhere, with the reason): a tiny
Qwen2 generates, sleeps, receives perturbed weights over CUDA IPC from a sender in this
process (the actor's path), wakes, and then serves exactly those weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm installed"),
]


def test_vllm_syncs_over_cuda_ipc_while_asleep_and_serves_the_new_weights(tmp_path):
    from benchmarks.rollout import engines_side_by_side as sbs
    from benchmarks.rollout.engine import random_prompts
    from services.rollout.native.engine import NativeEngine
    from services.rollout.vllm.engine import VllmEngine

    model = sbs.make_folder("tiny", tmp_path, "cuda")
    engine = VllmEngine(
        model, dtype="bfloat16", gpu_memory_utilization=0.2, max_num_seqs=16, max_model_len=128
    )
    prompts = random_prompts(7, 16, 16, 16, 1000)
    before = sbs.greedy(engine, prompts)
    weights = sbs.perturbed_weights(model, "cuda")

    sync = sbs.sync_vllm(engine, weights)

    memory = sync["memory"]
    assert memory["asleep_gib"] < memory["generating_gib"]  # KV cache and weights released
    assert memory["asleep_gib"] < memory["weights_awake_gib"] < memory["awake_gib"]
    assert sync["weight_version"] == 1 and sync["received"][0] == len(weights)
    names = [n for n in sbs.CHECKSUM_NAMES if n in weights]
    sent = [float(weights[n].double().sum()) for n in names]
    assert engine.served_checksums(names) == pytest.approx(sent, rel=0, abs=1e-6)
    after = sbs.greedy(engine, prompts)
    native = NativeEngine(model, dtype="bfloat16", device="cuda")
    native.load_weights(weights.items())
    agree = sbs.agreement(after, sbs.greedy(native, prompts))
    assert agree["first_tokens_equal"] >= 0.9, agree  # the same weights, up to bf16 rounding
    assert sbs.agreement(after, before)["rows_equal"] < 0.5  # and not the old ones
