"""compute_advantages: the coordinator's dispatch from scores to advantages, numbers by hand."""

import statistics
from types import SimpleNamespace

import pytest
import torch

from meshrl.config.sections import AlgorithmConfig
from meshrl.ragged import Ragged
from services.coordinator.generation.generated import GeneratedBatch
from services.coordinator.step.advantage import AdvantageInputs, compute_advantages
from services.coordinator.step.ppo_step import PPOStep
from services.coordinator.step.stages import Inferred, ScoredBatch, Scores
from services.coordinator.step.timing import PhaseTimer


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


# --- Each config value reaches its own argument --------------------------------------
# gamma = 0.5 and lam = 0.8 differ (a swap, or gamma used twice, changes every number);
# the KL coefficient 0.2 is neither of them.
GAMMA, LAM, BETA = 0.5, 0.8, 0.2


def _one_response(values=(0.2, 0.4, 0.6), old=(0.0, 0.0, 0.0), ref=None) -> AdvantageInputs:
    return AdvantageInputs(
        scores=torch.tensor([1.0]),
        mask=torch.ones(1, 3),
        group_ids=torch.tensor([0]),
        values=torch.tensor([values]),
        old_logprobs=torch.tensor([old]),
        ref_logprobs=None if ref is None else torch.tensor([ref]),
        baseline_scores=None,
    )


def test_gae_gets_gamma_and_lam_each_from_its_own_field():
    # rewards (0, 0, 1), values (0.2, 0.4, 0.6), gamma*lam = 0.4:
    #   t2: d = 1 - 0.6 = 0.4                 A2 = 0.4
    #   t1: d = 0.5*0.6 - 0.4 = -0.1          A1 = -0.1 + 0.4*0.4  = 0.06
    #   t0: d = 0.5*0.4 - 0.2 = 0             A0 = 0.4*0.06        = 0.024
    cfg = AlgorithmConfig(adv_estimator="gae", gamma=GAMMA, lam=LAM, whiten_advantages=False)
    out = compute_advantages(cfg, _one_response(), kl_coef=BETA)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.024, 0.06, 0.4]]))
    torch.testing.assert_close(out.returns, torch.tensor([[0.224, 0.46, 1.0]]))


def test_gae_whitens_when_whiten_advantages_is_set():
    # The raw advantages above, whitened: mean 0.161333, unbiased std 0.2073...
    cfg = AlgorithmConfig(adv_estimator="gae", gamma=GAMMA, lam=LAM, whiten_advantages=True)
    out = compute_advantages(cfg, _one_response(), kl_coef=BETA)
    raw = [0.024, 0.06, 0.4]
    mean = sum(raw) / 3
    std = (sum((a - mean) ** 2 for a in raw) / 2) ** 0.5
    expected = torch.tensor([[(a - mean) / std for a in raw]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.returns, torch.tensor([[0.224, 0.46, 1.0]]))  # raw


def test_reinforce_plus_plus_discounts_by_gamma_not_lam():
    # Return-to-go of (0, 0, 1) at gamma 0.5: (0.25, 0.5, 1).
    cfg = AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=GAMMA, lam=LAM)
    out = compute_advantages(cfg, _one_response(), kl_coef=BETA)
    torch.testing.assert_close(out.returns, torch.tensor([[0.25, 0.5, 1.0]]))


@pytest.mark.parametrize("norm, expected", [(True, 0.7071), (False, 0.5)])
def test_grpo_divides_by_the_std_only_when_norm_adv_by_std_in_grpo(norm, expected):
    # Scores (0, 1) in one group: mean 0.5, unbiased std sqrt(0.5) = 0.7071.
    cfg = AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=norm)
    out = compute_advantages(cfg, _two_responses_one_prompt((0.0, 1.0)), kl_coef=0.0)
    torch.testing.assert_close(
        out.advantages[:, 0], torch.tensor([-expected, expected]), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("kind, per_token", [("kl", 0.5), ("abs", 0.5), ("mse", 0.125)])
def test_kl_in_reward_uses_the_configured_estimator_coefficient_and_direction(kind, per_token):
    # log pi - log pi_ref = -1 - (-1.5) = 0.5 on each token: k1 0.5, |.| 0.5, 0.5*(.)^2 0.125.
    # Token rewards -beta * KL, score 1 on the last token. Reversed log-probs would make k1
    # -0.5 (a reward, not a penalty); the estimator "abs" tells them apart from "kl" below.
    cfg = AlgorithmConfig(
        adv_estimator="reinforce_plus_plus", use_kl_in_reward=True, kl_penalty=kind
    )
    out = compute_advantages(cfg, _one_response(old=(-1.0,) * 3, ref=(-1.5,) * 3), kl_coef=BETA)
    penalty = BETA * per_token
    torch.testing.assert_close(
        out.token_rewards, torch.tensor([[-penalty, -penalty, 1 - penalty]]), atol=1e-6, rtol=0
    )
    assert out.kl_mean == pytest.approx(per_token)


def test_kl_in_reward_is_not_symmetric_in_the_two_log_probs():
    # k1 with the policy below the reference: log pi - log pi_ref = -0.5, a bonus of beta*0.5.
    cfg = AlgorithmConfig(
        adv_estimator="reinforce_plus_plus", use_kl_in_reward=True, kl_penalty="kl"
    )
    out = compute_advantages(cfg, _one_response(old=(-1.5,) * 3, ref=(-1.0,) * 3), kl_coef=BETA)
    torch.testing.assert_close(out.token_rewards, torch.tensor([[0.1, 0.1, 1.1]]))


class _RecordingKLController:
    def __init__(self, value: float):
        self.value = value
        self.updates: list[tuple[float, int]] = []

    def update(self, current_kl, n_steps):
        self.updates.append((current_kl, n_steps))


def _floats(*rows):
    return Ragged.from_lists(list(rows), dtype=torch.float32)


def _generated(n_rows=1, group_ids=None) -> GeneratedBatch:
    """``n_rows`` responses of 3 tokens, one group unless ``group_ids`` says otherwise."""
    return GeneratedBatch(
        prompts=Ragged.from_lists([[5, 6]] * n_rows),
        responses=Ragged.from_lists([[7, 8, 9]] * n_rows),
        rollout_logprobs=_floats(*[[-9.0] * 3] * n_rows),  # not an input of the advantages
        finish_reasons=["stop"] * n_rows,
        group_ids=torch.zeros(n_rows, dtype=torch.long) if group_ids is None else group_ids,
        data_sources=["d"] * n_rows,
        ground_truths=["g"] * n_rows,
        extra_infos=[{}] * n_rows,
        weight_version=0,
    )


def _advantages(step, generated, scores, baseline=None, **inferred):
    """PPOStep.advantages over ``generated`` scored ``scores``, the ``inferred`` numbers."""
    scored = ScoredBatch(generated, Scores(scores=scores, reward_scores=scores))
    out = PPOStep.advantages(step, scored, Inferred(**inferred), baseline, PhaseTimer())
    return out.advantages, out.returns, out.metrics


def _ppo_step(algorithm: AlgorithmConfig, kl_ctrl) -> SimpleNamespace:
    # PPOStep.advantages reads only these two attributes of its step.
    return SimpleNamespace(cfg=SimpleNamespace(algorithm=algorithm), kl_ctrl=kl_ctrl)


def test_ppo_step_passes_values_log_probs_and_the_controllers_coefficient():
    # PPOStep.advantages, the coordinator's call site, on one response of 3 tokens:
    # old log-probs -1, reference -1.5 (k1 = 0.5 a token), beta 0.2 from the controller:
    #   token rewards (-0.1, -0.1, 0.9), values (0.2, 0.4, 0.6), gamma 0.5, lam 0.8:
    #   t2: d = 0.9 - 0.6 = 0.3                    A2 = 0.3
    #   t1: d = -0.1 + 0.5*0.6 - 0.4 = -0.2        A1 = -0.2 + 0.4*0.3   = -0.08
    #   t0: d = -0.1 + 0.5*0.4 - 0.2 = -0.1        A0 = -0.1 + 0.4*-0.08 = -0.132
    #   returns = A + V = (0.068, 0.32, 0.9)
    algorithm = AlgorithmConfig(
        adv_estimator="gae",
        gamma=GAMMA,
        lam=LAM,
        whiten_advantages=False,
        use_kl_in_reward=True,
        kl_penalty="kl",
    )
    kl_ctrl = _RecordingKLController(BETA)
    advantages, returns, metrics = _advantages(
        _ppo_step(algorithm, kl_ctrl),
        _generated(),
        torch.tensor([1.0]),
        old_logprobs=_floats([-1.0, -1.0, -1.0]),
        ref_logprobs=_floats([-1.5, -1.5, -1.5]),
        values=_floats([0.2, 0.4, 0.6]),
    )
    adv, ret = [-0.132, -0.08, 0.3], [0.068, 0.32, 0.9]
    torch.testing.assert_close(advantages.values, torch.tensor(adv))
    torch.testing.assert_close(returns.values, torch.tensor(ret))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(BETA)
    assert kl_ctrl.updates == [(pytest.approx(0.5), 1)]
    expected = {
        "critic/advantages": adv,
        "critic/returns": ret,
        "critic/rewards": [0.7],  # the response's token rewards summed
        "critic/values": [0.2, 0.4, 0.6],
    }
    for prefix, xs in expected.items():
        assert metrics[f"{prefix}/mean"] == pytest.approx(statistics.fmean(xs)), prefix
        assert metrics[f"{prefix}/max"] == pytest.approx(max(xs)), prefix
        assert metrics[f"{prefix}/min"] == pytest.approx(min(xs)), prefix
    # 1 - Var[R - V] / (Var[R] + 1e-5), R - V = A
    ev = 1 - statistics.variance(adv) / (statistics.variance(ret) + 1e-5)
    assert metrics["critic/vf_explained_var"] == pytest.approx(ev, rel=1e-5)


def test_ppo_step_groups_outcome_estimators_by_the_batchs_group_ids():
    # grpo without a critic or a reference: rows 0, 1 in group 0 (scores 0, 1), rows 2, 3 in
    # group 1 (scores 1, 1): A = (-0.7071, 0.7071, 0, 0) on every token.
    cfg = AlgorithmConfig(adv_estimator="grpo", use_kl_in_reward=False)
    kl_ctrl = _RecordingKLController(BETA)
    advantages, returns, metrics = _advantages(
        _ppo_step(cfg, kl_ctrl),
        _generated(4, group_ids=torch.tensor([0, 0, 1, 1])),
        torch.tensor([0.0, 1.0, 1.0, 1.0]),
        old_logprobs=_floats(*[[-1.0] * 3] * 4),
    )
    expected = torch.tensor([-0.7071, 0.7071, 0.0, 0.0]).repeat_interleave(3)
    torch.testing.assert_close(advantages.values, expected, atol=1e-4, rtol=0)
    assert "critic/values/mean" not in metrics and "actor/reward_kl_penalty" not in metrics
    assert kl_ctrl.updates == []  # no KL in the reward: the controller stays
    # each response's reward is its score: mean 0.75 over the 4 responses
    rewards = {k: metrics[f"critic/rewards/{k}"] for k in ("mean", "max", "min")}
    assert rewards == {"mean": 0.75, "max": 1.0, "min": 0.0}


def test_ppo_step_gives_remax_the_greedy_baseline_scores():
    # ReMax: return-to-go (score 1 on the last token: 1 on every token) minus the greedy
    # response's score 0.25.
    cfg = AlgorithmConfig(adv_estimator="remax", use_kl_in_reward=False)
    advantages, _, _ = _advantages(
        _ppo_step(cfg, _RecordingKLController(BETA)),
        _generated(),
        torch.tensor([1.0]),
        baseline=torch.tensor([0.25]),
        old_logprobs=_floats([-1.0, -1.0, -1.0]),
    )
    torch.testing.assert_close(advantages.values, torch.tensor([0.75, 0.75, 0.75]))


def test_estimators_without_their_inputs_say_what_is_missing():
    inputs = _one_response()._replace(values=None)
    with pytest.raises(
        ValueError, match=r"^adv_estimator gae needs critic values \(critic.enable\)$"
    ):
        compute_advantages(AlgorithmConfig(adv_estimator="gae"), inputs, kl_coef=0.0)
    with pytest.raises(ValueError, match="^adv_estimator remax needs the greedy baseline scores$"):
        compute_advantages(AlgorithmConfig(adv_estimator="remax"), inputs, kl_coef=0.0)
    unchecked = AlgorithmConfig.model_construct(
        **{**AlgorithmConfig().__dict__, "adv_estimator": "nope"}
    )
    with pytest.raises(ValueError, match="^unknown adv_estimator 'nope'$"):
        compute_advantages(unchecked, inputs, kl_coef=0.0)


def test_remax_subtracts_the_baseline_from_the_undiscounted_return():
    # Score 1 on the last of 3 tokens, gamma 0.5 ignored (ReMax does not discount), baseline
    # 0.25: A = 1 - 0.25 on every token; returns 1.
    inputs = _one_response()._replace(baseline_scores=torch.tensor([0.25]))
    cfg = AlgorithmConfig(adv_estimator="remax", gamma=GAMMA)
    out = compute_advantages(cfg, inputs, kl_coef=BETA)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.75, 0.75, 0.75]]))
    torch.testing.assert_close(out.returns, torch.tensor([[1.0, 1.0, 1.0]]))
