"""Token-level rewards: score on the last valid token, KL penalty, kl_mean."""

from __future__ import annotations

import pytest
import torch

from meshrl.algorithms.kl import kl_penalty
from meshrl.algorithms.rewards import last_token_index, place_on_last_token, token_level_rewards

NAN = float("nan")
# Rows of length 3, 1 and 4: padding in the middle of the batch.
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
SCORES = torch.tensor([1.0, 2.0, 3.0])


def test_last_token_index_any_mask():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    # a hole in row 2 (verl's sum - 1 would say 1); an empty row 3 -> -1
    assert last_token_index(mask).tolist() == [2, 0, 2, -1]


def test_scores_on_last_valid_token_without_kl():
    out = token_level_rewards(SCORES, MASK)
    expected = torch.tensor([[0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    torch.testing.assert_close(out.rewards, expected)
    torch.testing.assert_close(out.kl, torch.zeros(3, 4))
    assert out.kl_mean.item() == 0.0


def test_empty_row_drops_its_score():
    mask = MASK.clone()
    mask[1] = 0.0
    out = token_level_rewards(SCORES, mask)
    assert out.rewards[1].abs().sum().item() == 0.0
    assert out.rewards.sum().item() == 4.0  # 1 + 3


def test_kl_in_reward_hand_computed():
    # logp - ref = d: row 0 [0.1, 0.2, 0.3 | pad], row 1 [0.4 | pad], row 2 [0.1] * 4
    ref = torch.zeros(3, 4)
    logp = torch.tensor([[0.1, 0.2, 0.3, NAN], [0.4, NAN, NAN, NAN], [0.1, 0.1, 0.1, 0.1]])
    out = token_level_rewards(
        SCORES, MASK, logprobs=logp, ref_logprobs=ref, kl_coef=0.5, kl_kind="kl"
    )
    # rewards = score on last token - 0.5 * d
    expected = torch.tensor(
        [
            [-0.05, -0.10, 1.0 - 0.15, 0.0],
            [2.0 - 0.20, 0.0, 0.0, 0.0],
            [-0.05, -0.05, -0.05, 3.0 - 0.05],
        ]
    )
    torch.testing.assert_close(out.rewards, expected)
    torch.testing.assert_close(out.kl, torch.where(MASK.bool(), logp, torch.zeros(())))
    # per-seq mean KL: 0.6 / 3 = 0.2, 0.4, 0.1 -> mean over sequences 0.7 / 3
    assert out.kl_mean.item() == pytest.approx(0.7 / 3)


def test_kl_kind_is_forwarded_and_output_has_no_grad():
    logp = torch.full((3, 4), -1.0, requires_grad=True)
    ref = torch.full((3, 4), -1.5)
    out = token_level_rewards(
        SCORES, MASK, logprobs=logp, ref_logprobs=ref, kl_coef=1.0, kl_kind="low_var_kl"
    )
    k3 = kl_penalty(logp.detach(), ref, "low_var_kl")[0, 0]
    assert out.kl[0, 0].item() == pytest.approx(k3.item())
    assert out.rewards[1, 0].item() == pytest.approx(2.0 - k3.item())
    assert not out.rewards.requires_grad


def test_holes_put_score_on_last_valid_token():
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    torch.testing.assert_close(
        place_on_last_token(torch.tensor([5.0]), mask), torch.tensor([[0.0, 0.0, 5.0, 0.0]])
    )


def test_needs_both_logprobs():
    with pytest.raises(ValueError, match="both"):
        token_level_rewards(SCORES, MASK, ref_logprobs=torch.zeros(3, 4))


def test_scores_keep_their_float64_dtype():
    # Rewards are built in the scores' dtype (at least float32): float64 scores stay float64.
    scores = torch.tensor([0.1, 0.2], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    placed = place_on_last_token(scores, mask)
    assert placed.dtype == torch.float64
    assert placed.tolist() == [[0.0, 0.1, 0.0], [0.0, 0.0, 0.0]]  # an empty row gets nothing
    assert token_level_rewards(scores, mask).rewards.dtype == torch.float64


def test_integer_scores_give_float32_rewards_and_the_kl_takes_the_rewards_dtype():
    mask = torch.ones(1, 2)
    assert token_level_rewards(torch.tensor([1]), mask).rewards.dtype == torch.float32
    out = token_level_rewards(
        torch.tensor([1.0], dtype=torch.float64),
        mask,
        logprobs=torch.zeros(1, 2),
        ref_logprobs=torch.full((1, 2), -0.5),
        kl_coef=0.1,
    )
    assert out.rewards.dtype == out.kl.dtype == torch.float64


def test_defaults_are_no_penalty_and_the_k1_estimator():
    # Without kl_coef the log-probs change nothing; the KL reported is k1 = log pi - log pi_ref.
    out = token_level_rewards(
        torch.tensor([1.0]),
        torch.ones(1, 2),
        logprobs=torch.zeros(1, 2),
        ref_logprobs=torch.tensor([[0.5, -0.5]]),
    )
    assert out.rewards.tolist() == [[0.0, 1.0]]
    assert out.kl.tolist() == [[-0.5, 0.5]]


def test_log_probs_come_in_pairs():
    with pytest.raises(ValueError, match="^pass both logprobs and ref_logprobs, or neither$"):
        token_level_rewards(torch.tensor([1.0]), torch.ones(1, 2), logprobs=torch.zeros(1, 2))
