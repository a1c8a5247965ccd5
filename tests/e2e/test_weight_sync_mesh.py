"""Actor and rollout as real server processes: after a sync, rollout's log-probs of fixed
sequences equal the actor's (fp32 on CPU, 1e-4), and they did not before the sync."""

from __future__ import annotations

import pytest
import torch

from meshrl.config import build_config, config_to_yaml
from meshrl.launcher.local import LocalLauncher
from meshrl.ragged import Ragged
from services.coordinator.generation.weight_sync import WeightSyncer
from services.rollout.client import RolloutClient
from services.trainer.client import TrainerClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _config(tiny_model, tmp_path, replicas=1):
    return build_config(
        {},
        [
            f"actor_rollout_ref.model.path={tiny_model}",
            f"trainer.default_local_dir={tmp_path}",
            f"actor_rollout_ref.rollout.replicas={replicas}",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.optim.lr=0.05",
            "critic.enable=false",
        ],
    )


def _fixed_sequences():
    prompts = Ragged.from_lists(
        [[1, 20, 21, 19, 6, 7, 14, 9, 12, 17], [1, 20, 21, 19, 5, 5, 14, 5, 5, 17]]
    )
    responses = Ragged.from_lists([[6, 9, 14, 9, 12, 17, 8, 5], [5, 5, 14, 2]])
    return prompts, responses


@pytest.mark.parametrize("replicas", [1, 2])
def test_rollout_matches_actor_after_sync(tiny_model, tmp_path, replicas):
    cfg = _config(tiny_model, tmp_path, replicas)
    with LocalLauncher(cfg, tmp_path) as launcher:
        endpoints = launcher.start()
        actor = TrainerClient(endpoints.actor, 120, "actor")
        rollouts = [RolloutClient(a, 120) for a in endpoints.rollout]
        text = config_to_yaml(cfg)
        for client in [actor, *rollouts]:
            client.initialize(text)
        syncer = WeightSyncer(cfg, actor, rollouts)
        prompts, responses = _fixed_sequences()

        # Move the actor away from the weights the rollout loaded: one PPO update.
        old, _ = actor.compute_log_probs(prompts, responses, 1.0)
        adv = responses.with_values(torch.ones_like(old.values))
        actor.update_policy(prompts, responses, old, adv, global_step=1)
        new, _ = actor.compute_log_probs(prompts, responses, 1.0)
        before = rollouts[0].compute_log_probs(prompts, responses, 1.0)
        assert (before.values - new.values).abs().max() > 1e-3, "the update should change log-probs"

        metrics = syncer.sync(version=1)
        assert metrics["weight_sync/bytes"] > 0
        for rollout in rollouts:
            after = rollout.compute_log_probs(prompts, responses, 1.0)
            assert torch.allclose(after.values, new.values, atol=1e-4), (
                (after.values - new.values).abs().max()
            )
            assert rollout.info().weight_version == 1
        syncer.close()
