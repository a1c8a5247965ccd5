"""A multi-turn batch's advantages, by hand: observation tokens are skipped, the final score
sits on the last token the model sampled, each turn's environment reward on the last token
of its turn; with GAE and with a group estimator."""

import pytest
import torch

from meshrl.config.sections import AlgorithmConfig
from meshrl.ragged import Ragged
from services.coordinator.generation.generated import GeneratedBatch
from services.coordinator.step.advantage import AdvantageInputs, compute_advantages

# Two samples of one prompt, 5 response tokens each. Sample 0: turn 1 (tokens 0-1), an
# observation (tokens 2-3, mask 0), turn 2 (token 4); its tool step earned 0.5 (on token 1)
# and the reward service scored it 1. Sample 1: one turn of 5 tokens, scored 0.
MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
TURN_REWARDS = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.0], [0.0] * 5])
SCORES = torch.tensor([1.0, 0.0])


def _inputs(values=None):
    return AdvantageInputs(
        scores=SCORES,
        mask=MASK,
        group_ids=torch.tensor([0, 0]),
        values=values,
        old_logprobs=torch.zeros(2, 5),
        ref_logprobs=None,
        baseline_scores=None,
        turn_rewards=TURN_REWARDS,
    )


def test_gae_skips_observations_and_sees_the_turn_reward_where_it_was_earned():
    # gamma = lam = 1, values 0, no whitening. Token rewards of sample 0: (0, 0.5, -, -, 1).
    #   t=4: A = 1;  t=3, t=2: observations, skipped (A carried, stored as 0)
    #   t=1: delta = 0.5 + V_4 - V_1 = 0.5, A = 0.5 + A_4 = 1.5;  t=0: A = 0 + 1.5 = 1.5
    cfg = AlgorithmConfig(adv_estimator="gae", gamma=1.0, lam=1.0, whiten_advantages=False)
    out = compute_advantages(cfg, _inputs(values=torch.zeros(2, 5)), kl_coef=0.0)
    assert out.advantages[0].tolist() == [1.5, 1.5, 0.0, 0.0, 1.0]
    assert out.advantages[1].tolist() == [0.0] * 5
    assert out.token_rewards[0].tolist() == [0.0, 0.5, 0.0, 0.0, 1.0]


def test_a_group_estimator_counts_the_turn_rewards_in_the_episode_total():
    # episode totals 1 + 0.5 = 1.5 and 0: mean 0.75, unbiased std 1.0607 -> +-0.7071,
    # on the model's tokens only
    cfg = AlgorithmConfig(adv_estimator="grpo")
    out = compute_advantages(cfg, _inputs(), kl_coef=0.0)
    a = 0.70710
    assert out.advantages[0].tolist() == pytest.approx([a, a, 0.0, 0.0, a], abs=1e-4)
    assert out.advantages[1].tolist() == pytest.approx([-a] * 5, abs=1e-4)


def test_a_multi_turn_batch_masks_its_observations_and_keeps_them_through_selection():
    batch = GeneratedBatch(
        prompts=Ragged.from_lists([[1], [1]]),
        responses=Ragged.from_lists([[5, 6, 7, 8, 9], [5, 6]]),
        rollout_logprobs=Ragged.from_lists([[0.0] * 5, [0.0] * 2], torch.float32),
        finish_reasons=["stop", "stop"],
        group_ids=torch.tensor([0, 1]),
        data_sources=["a", "a"],
        ground_truths=["", ""],
        extra_infos=[{}, {}],
        weight_version=0,
        loss_mask=Ragged.from_lists([[1, 1, 0, 0, 1], [1, 1]], torch.uint8),
        turn_rewards=Ragged.from_lists([[0, 0.5, 0, 0, 0], [0, 0]], torch.float32),
    )
    assert batch.response_mask().tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    assert batch.padded_turn_rewards(5)[0].tolist() == [0, 0.5, 0, 0, 0]
    picked = batch.select_groups([1, 0])
    assert picked.loss_mask.tolist() == [[1, 1], [1, 1, 0, 0, 1]]
    joined = GeneratedBatch.concat([batch, batch])
    assert joined.turn_rewards.tolist()[2] == [0, 0.5, 0, 0, 0]
