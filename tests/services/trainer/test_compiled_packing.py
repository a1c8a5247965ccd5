"""Compiled decoder layers (`actor_rollout_ref.actor.use_torch_compile`) with padding-free micro-batches: every
packed micro-batch has its own sequence count and lengths, and nothing may be compiled
again for them once the first update has run (before the varlen attention was left out of
the compiled code, each new count recompiled until dynamo's limit)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from trainer_helpers import make_batch, trainer_config

from meshrl.testing.tiny_model import make_tiny_qwen2_dir
from services.trainer.actor import ActorRole

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        shutil.which("cc") is None and shutil.which("gcc") is None,
        reason="torch.compile on CPU needs a C compiler",
    ),
]


def test_later_packed_updates_compile_nothing_new(world, tmp_path):
    path = make_tiny_qwen2_dir(tmp_path / "qwen2", tokenizer=False, vocab_size=32)
    cfg = trainer_config(str(path), [
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
        "actor_rollout_ref.actor.use_torch_compile=true",
    ])  # fmt: skip
    torch._dynamo.reset()
    actor = ActorRole.build(cfg, world)
    graphs_after = []
    for step in range(1, 5):
        batch = make_batch(12, seed=step, vocab=32)  # new lengths, new packings each step
        old, _ = actor.compute_log_probs(batch)
        adv = old.with_values(torch.randn(old.values.numel()))
        metrics = actor.update_policy(batch, old, adv, None, None, global_step=step)
        assert metrics["actor/grad_norm"] > 0
        graphs_after.append(dynamo_utils.counters["stats"]["unique_graphs"])
    assert graphs_after[0] > 0, "the layers were compiled"
    assert graphs_after[1:] == [graphs_after[0]] * 3, graphs_after
