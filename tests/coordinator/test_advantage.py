"""compute_advantages: the coordinator's dispatch from scores to advantages, numbers by hand."""

import pytest
import torch

from meshrl.config.schema import AlgorithmConfig
from services.coordinator.advantage import AdvantageInputs, compute_advantages


def _two_responses_one_prompt(scores=(1.0, 1.0)) -> AdvantageInputs:
    # Two responses of one prompt, 2 tokens each, both scored 1. Response 0 drifted from
    # the reference: log pi - log pi_ref = 1 on each token (k1 KL = 2 over the response);
    # response 1 did not (KL 0).
    return AdvantageInputs(
        scores=torch.tensor(scores),
        mask=torch.ones(2, 2),
        group_ids=torch.tensor([0, 0]),
        values=None,
        old_logprobs=torch.zeros(2, 2),
        ref_logprobs=torch.tensor([[-1.0, -1.0], [0.0, 0.0]]),
        baseline_scores=None,
    )


# With beta = 0.5 the whole-response rewards are 1 - 0.5*2 = 0 and 1 - 0 = 1: mean 0.5.
#   rloo:  A_i = n/(n-1) (R_i - mean) = 2 * (-0.5, 0.5)                 = (-1, 1)
#   grpo:  A_i = (R_i - mean) / (std + 1e-6), std (unbiased) = sqrt(0.5) ~ (-0.7071, 0.7071)
#   reinforce_plus_plus_baseline: R_i - mean on 4 tokens (-0.5, -0.5, 0.5, 0.5), whitened with
#          the unbiased variance 4 * 0.25 / 3 = 1/3: -0.5 / sqrt(1/3) ~ (-0.8660, 0.8660)
@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("rloo", (-1.0, 1.0)),
        ("grpo", (-0.7071, 0.7071)),
        ("reinforce_plus_plus_baseline", (-0.8660, 0.8660)),
    ],
)
def test_outcome_estimators_baseline_the_kl_penalised_reward(estimator, expected):
    cfg = AlgorithmConfig(adv_estimator=estimator, use_kl_in_reward=True, kl_penalty="kl")
    out = compute_advantages(cfg, _two_responses_one_prompt(), kl_coef=0.5)
    assert out.token_rewards.sum(-1).tolist() == [0.0, 1.0]
    assert out.kl_mean == pytest.approx(0.5)  # per-sequence means (1, 0), averaged
    expected_rows = torch.tensor(expected)[:, None].expand(2, 2)
    torch.testing.assert_close(out.advantages, expected_rows, atol=1e-4, rtol=0)


@pytest.mark.parametrize("estimator", ["rloo", "grpo", "reinforce_plus_plus_baseline"])
def test_outcome_estimators_use_the_score_alone_without_kl_in_reward(estimator):
    # Equal scores, so no advantage at all, however far response 0 drifted.
    cfg = AlgorithmConfig(adv_estimator=estimator, use_kl_in_reward=False)
    out = compute_advantages(cfg, _two_responses_one_prompt(), kl_coef=0.5)
    assert out.kl_mean == 0.0
    assert torch.count_nonzero(out.advantages) == 0


def test_gae_by_hand():
    # One response of 2 tokens, score 1, values (0.5, 0.5), gamma = lam = 1, no whitening:
    #   t=1: delta = 1 - 0.5 = 0.5, A_1 = 0.5;  t=0: delta = 0 + 0.5 - 0.5 = 0, A_0 = 0.5
    #   returns = A + V = (1, 1)
    inputs = AdvantageInputs(
        scores=torch.tensor([1.0]),
        mask=torch.ones(1, 2),
        group_ids=torch.tensor([0]),
        values=torch.tensor([[0.5, 0.5]]),
        old_logprobs=torch.zeros(1, 2),
        ref_logprobs=None,
        baseline_scores=None,
    )
    cfg = AlgorithmConfig(adv_estimator="gae", gamma=1.0, lam=1.0, whiten_advantages=False)
    out = compute_advantages(cfg, inputs, kl_coef=0.0)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(out.returns, torch.tensor([[1.0, 1.0]]))
