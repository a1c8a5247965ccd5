"""Advantage estimators: hand-computed values, padding, singleton groups, properties."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    discounted_return_to_go,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from meshrl.algorithms.masked import masked_mean, masked_var, masked_whiten

NAN = float("nan")
D = torch.float64


def t64(rows):
    return torch.tensor(rows, dtype=D)


# --------------------------------------------------------------------------- GAE
# Rows of length 3, 1 and 4 (padding in the middle of the batch). Rewards and values
# under padding are nan: they must be ignored.
GAE_MASK = t64([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
GAE_REWARDS = t64([[0, 0, 1, NAN], [2, NAN, NAN, NAN], [0, 0, 0, 1]])
GAE_VALUES = t64([[0.5, 0.5, 0.5, NAN], [1.0, NAN, NAN, NAN], [0.2, 0.4, 0.6, 0.8]])
# gamma = lam = 0.5, so gamma * lam = 0.25. V after the last valid token is 0.
# row 0: d2 = 1 + 0.5*0   - 0.5 =  0.5    A2 = 0.5
#        d1 = 0 + 0.5*0.5 - 0.5 = -0.25   A1 = -0.25 + 0.25*0.5     = -0.125
#        d0 = 0 + 0.5*0.5 - 0.5 = -0.25   A0 = -0.25 + 0.25*-0.125  = -0.28125
# row 1: d0 = 2 - 1 = 1                   A0 = 1
# row 2: d3 = 1 + 0       - 0.8 =  0.2    A3 = 0.2
#        d2 = 0 + 0.5*0.8 - 0.6 = -0.2    A2 = -0.2 + 0.25*0.2      = -0.15
#        d1 = 0 + 0.5*0.6 - 0.4 = -0.1    A1 = -0.1 + 0.25*-0.15    = -0.1375
#        d0 = 0 + 0.5*0.4 - 0.2 =  0      A0 =  0   + 0.25*-0.1375  = -0.034375
GAE_RAW = t64([[-0.28125, -0.125, 0.5, 0], [1, 0, 0, 0], [-0.034375, -0.1375, -0.15, 0.2]])
# returns = A + V: row 0 [0.21875, 0.375, 1.0], row 1 [2.0], row 2 [0.165625, 0.2625, 0.45, 1.0]
GAE_RETURNS = t64([[0.21875, 0.375, 1.0, 0], [2.0, 0, 0, 0], [0.165625, 0.2625, 0.45, 1.0]])


def test_gae_hand_computed():
    out = gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.5, lam=0.5, whiten=False)
    torch.testing.assert_close(out.advantages, GAE_RAW)
    torch.testing.assert_close(out.returns, GAE_RETURNS)


def test_gae_whitening_applies_to_advantages_only():
    out = gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.5, lam=0.5)
    torch.testing.assert_close(out.advantages, masked_whiten(GAE_RAW, GAE_MASK))
    torch.testing.assert_close(out.returns, GAE_RETURNS)  # never whitened


def test_gae_skips_holes():
    # mask [1, 0, 1], gamma = lam = 1. The hole's reward 5 and value 7 are ignored:
    # t2: d = 1 + 0 - 0.5 = 0.5, A2 = 0.5 ; t1 skipped (V_next stays 0.5, A_next 0.5)
    # t0: d = 0 + 0.5 - 0.5 = 0, A0 = 0 + 0.5 = 0.5
    out = gae_advantages(
        t64([[0, 5, 1]]), t64([[0.5, 7, 0.5]]), t64([[1, 0, 1]]), 1.0, 1.0, whiten=False
    )
    torch.testing.assert_close(out.advantages, t64([[0.5, 0, 0.5]]))
    torch.testing.assert_close(out.returns, t64([[1.0, 0, 1.0]]))


def test_gae_with_gamma_not_lambda_by_hand():
    # gamma = 0.5 and lam = 0.8 differ, so gamma * lam = 0.4 is neither gamma^2 (0.25) nor
    # lam^2 (0.64), and swapping them changes every delta (gamma discounts V_next, lam not).
    # Row 0 (3 tokens), values (0.2, 0.4, 0.6), reward 1 on the last token:
    #   t2: d = 1 + 0.5*0   - 0.6 =  0.4   A2 = 0.4
    #   t1: d = 0 + 0.5*0.6 - 0.4 = -0.1   A1 = -0.1 + 0.4*0.4  = 0.06
    #   t0: d = 0 + 0.5*0.4 - 0.2 =  0     A0 =  0   + 0.4*0.06 = 0.024
    # Row 1 (2 tokens, then padding), values (1, 0.5), reward 2 on the last token:
    #   t1: d = 2 - 0.5 = 1.5              A1 = 1.5
    #   t0: d = 0 + 0.5*0.5 - 1 = -0.75    A0 = -0.75 + 0.4*1.5 = -0.15
    # returns = A + V.
    rewards = t64([[0, 0, 1], [0, 2, NAN]])
    values = t64([[0.2, 0.4, 0.6], [1.0, 0.5, NAN]])
    mask = t64([[1, 1, 1], [1, 1, 0]])
    out = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.8, whiten=False)
    torch.testing.assert_close(out.advantages, t64([[0.024, 0.06, 0.4], [-0.15, 1.5, 0]]))
    torch.testing.assert_close(out.returns, t64([[0.224, 0.46, 1.0], [0.85, 2.0, 0]]))


def _one_step_td_errors(rewards, values, mask, gamma):
    # lam = 0: A_t = r_t + gamma * V_{t+1} - V_t, with V = 0 after the last token.
    out = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        valid = [j for j in range(rewards.shape[1]) if mask[i, j]]
        for k, j in enumerate(valid):
            v_next = values[i, valid[k + 1]].item() if k + 1 < len(valid) else 0.0
            out[i, j] = rewards[i, j] + gamma * v_next - values[i, j]
    return out


def _discounted_returns_minus_values(rewards, values, mask, gamma):
    # lam = 1: A_t = sum_k gamma^k r_{t+k} - V_t (Monte Carlo advantage).
    out = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        valid = [j for j in range(rewards.shape[1]) if mask[i, j]]
        for k, j in enumerate(valid):
            ret = sum(gamma**n * rewards[i, jj].item() for n, jj in enumerate(valid[k:]))
            out[i, j] = ret - values[i, j]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_at_lambda_zero_and_one_is_td_error_and_monte_carlo(seed):
    # The two ends of GAE's lambda, from their textbook formulas (Schulman et al. 2016,
    # eq. 17 and 18), at a gamma that is neither 0 nor 1.
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(3, 5, generator=gen, dtype=D)
    values = torch.randn(3, 5, generator=gen, dtype=D)
    mask = t64([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [1, 0, 0, 0, 0]])
    gamma = 0.7
    td = gae_advantages(rewards, values, mask, gamma, 0.0, whiten=False)
    mc = gae_advantages(rewards, values, mask, gamma, 1.0, whiten=False)
    torch.testing.assert_close(td.advantages, _one_step_td_errors(rewards, values, mask, gamma))
    torch.testing.assert_close(
        mc.advantages, _discounted_returns_minus_values(rewards, values, mask, gamma)
    )


# ------------------------------------------------------------------ group-based
# Interleaved, non-contiguous group ids: group 0 = rows 1, 3, 5 (scores 1, 0, 1),
# group 7 = rows 0, 4 (scores 3, 1), group 9 = row 2 alone (score 5).
SCORES = t64([3, 1, 5, 0, 1, 1])
GROUPS = torch.tensor([7, 0, 9, 0, 7, 0])
# Lengths 3, 1, 4, 2, 0 (row 4 has no token but still counts in its group), 4.
LENGTHS = torch.tensor([3, 1, 4, 2, 0, 4])
GROUP_MASK = (torch.arange(4) < LENGTHS[:, None]).to(D)


def per_token(per_seq):
    return t64(per_seq)[:, None] * GROUP_MASK


def test_grpo_hand_computed():
    # group 0: mean 2/3; deviations 1/3, -2/3, 1/3; unbiased var (1/9 + 4/9 + 1/9) / 2 = 1/3
    # group 7: mean 2, deviations +-1, unbiased var 2 / 1 = 2
    # group 9 (singleton): mean 0, std 1 (verl) -> A = 5 / (1 + eps)
    s0, s7, eps = math.sqrt(1 / 3), math.sqrt(2), 1e-6
    expected = [
        1 / (s7 + eps),
        (1 / 3) / (s0 + eps),
        5 / (1 + eps),
        (-2 / 3) / (s0 + eps),
        -1 / (s7 + eps),
        (1 / 3) / (s0 + eps),
    ]
    out = grpo_advantages(SCORES, GROUP_MASK, GROUPS)
    torch.testing.assert_close(out.advantages, per_token(expected))
    torch.testing.assert_close(out.returns, out.advantages)


def test_dr_grpo_does_not_divide_by_std():
    # Dr. GRPO: s - group mean; singleton keeps its raw score 5
    out = grpo_advantages(SCORES, GROUP_MASK, GROUPS, norm_by_std=False)
    torch.testing.assert_close(out.advantages, per_token([1, 1 / 3, 5, -2 / 3, -1, 1 / 3]))


def test_grpo_constant_group_gives_zero():
    out = grpo_advantages(t64([1, 1, 1]), torch.ones(3, 2, dtype=D), torch.tensor([4, 4, 4]))
    torch.testing.assert_close(out.advantages, torch.zeros(3, 2, dtype=D))


def test_grpo_accepts_uid_strings():
    ids = ["b", "a", "c", "a", "b", "a"]
    by_str = grpo_advantages(SCORES, GROUP_MASK, ids)
    torch.testing.assert_close(
        by_str.advantages, grpo_advantages(SCORES, GROUP_MASK, GROUPS).advantages
    )


def test_rloo_hand_computed():
    # a_i = s_i - mean of the others
    # group 0 (1, 0, 1): 1 - 0.5 = 0.5, 0 - 1 = -1, 1 - 0.5 = 0.5
    # group 7 (3, 1): 3 - 1 = 2, 1 - 3 = -2 ; singleton 9: a = s = 5 (verl)
    out = rloo_advantages(SCORES, GROUP_MASK, GROUPS)
    torch.testing.assert_close(out.advantages, per_token([2, 0.5, 5, -1, -2, 0.5]))
    torch.testing.assert_close(out.returns, out.advantages)


def test_reinforce_plus_plus_baseline_hand_computed():
    # centred scores: group 0 (mean 2/3) -> 1/3, -2/3, 1/3 ; group 7 (mean 2) -> 1, -1 ;
    # singleton -> 5 - 0 = 5. Broadcast over lengths 3, 1, 4, 2, 0, 4, then whitened
    # over the 14 valid tokens with the unbiased variance.
    centred = [1, 1 / 3, 5, -2 / 3, -1, 1 / 3]
    tokens = [c for c, n in zip(centred, LENGTHS.tolist(), strict=True) for _ in range(n)]
    mean, std = statistics.fmean(tokens), statistics.stdev(tokens)
    expected = [(c - mean) / math.sqrt(std**2 + 1e-6) for c in centred]
    out = reinforce_plus_plus_baseline_advantages(SCORES, GROUP_MASK, GROUPS)
    torch.testing.assert_close(out.advantages, per_token(expected))
    torch.testing.assert_close(out.returns, out.advantages)


# ------------------------------------------------------- return-to-go estimators
RTG_MASK = t64([[1, 1, 1], [1, 0, 0], [1, 1, 0]])  # lengths 3, 1, 2
RTG_REWARDS = t64([[0, 1, 2], [4, NAN, NAN], [1, 1, 100]])


def test_reinforce_plus_plus_hand_computed():
    # gamma = 0.5. row 0: G2 = 2, G1 = 1 + 0.5*2 = 2, G0 = 0 + 0.5*2 = 1
    # row 1: G0 = 4 ; row 2: G1 = 1, G0 = 1 + 0.5*1 = 1.5 (the 100 is padding)
    returns = t64([[1, 2, 2], [4, 0, 0], [1.5, 1, 0]])
    valid = [1, 2, 2, 4, 1.5, 1]
    mean, var = statistics.fmean(valid), statistics.variance(valid)  # 11.5/6, unbiased
    expected = torch.where(RTG_MASK.bool(), (returns - mean) / math.sqrt(var + 1e-8), 0.0)
    out = reinforce_plus_plus_advantages(RTG_REWARDS, RTG_MASK, gamma=0.5)
    torch.testing.assert_close(out.returns, returns)
    torch.testing.assert_close(out.advantages, expected)


def test_return_to_go_skips_holes():
    # mask [1, 0, 1], gamma 0.5: the hole's reward 7 is ignored and not discounted over:
    # G2 = 1, G0 = 0 + 0.5 * 1 = 0.5
    out = discounted_return_to_go(t64([[0, 7, 1]]), t64([[1, 0, 1]]), 0.5)
    torch.testing.assert_close(out, t64([[0.5, 0, 1]]))


def test_remax_hand_computed():
    # undiscounted return-to-go minus the greedy baseline
    # row 0: G = [3, 3, 2] - 0.5 ; row 1: G = [4] - 3 ; row 2: G = [2, 1] - 0 (100 is padding)
    out = remax_advantages(RTG_REWARDS, t64([0.5, 3.0, 0.0]), RTG_MASK)
    torch.testing.assert_close(out.returns, t64([[3, 3, 2], [4, 0, 0], [2, 1, 0]]))
    torch.testing.assert_close(out.advantages, t64([[2.5, 2.5, 1.5], [1, 0, 0], [2, 1, 0]]))


def test_estimator_names():
    assert ADVANTAGE_ESTIMATORS == (
        "gae",
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
    )


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        gae_advantages(GAE_REWARDS, GAE_VALUES[:, :3], GAE_MASK, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"expected shape \(3, 4\), got \(3, 3\)"):
        discounted_return_to_go(GAE_REWARDS[:, :3], GAE_MASK, 1.0)
    with pytest.raises(ValueError, match="mask must be"):
        discounted_return_to_go(GAE_REWARDS, GAE_MASK[0], 1.0)
    with pytest.raises(ValueError, match=r"expected shape \(3, 4\), got \(3, 3\)"):
        gae_advantages(GAE_REWARDS[:, :3], GAE_VALUES, GAE_MASK, 1.0, 1.0)
    with pytest.raises(ValueError, match="mask must be"):
        gae_advantages(GAE_REWARDS[0], GAE_VALUES[0], GAE_MASK[0], 1.0, 1.0)


# -------------------------------------------------------------------- properties
@st.composite
def token_batches(draw):
    b, t = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rewards = torch.randn(b, t, generator=gen, dtype=D)
    if draw(st.booleans()):
        lengths = torch.randint(0, t + 1, (b,), generator=gen)
        mask = (torch.arange(t) < lengths[:, None]).to(D)
    else:
        mask = (torch.rand(b, t, generator=gen) < 0.7).to(D)
    return rewards, mask


def reference_reward_to_go(rewards, mask):
    out = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = 0.0
        for j in reversed(range(rewards.shape[1])):
            if mask[i, j]:
                running += rewards[i, j].item()
                out[i, j] = running
    return out


@settings(max_examples=50, deadline=None)
@given(token_batches())
def test_gae_with_unit_gamma_lambda_and_zero_values_is_reward_to_go(batch):
    rewards, mask = batch
    out = gae_advantages(rewards, torch.zeros_like(rewards), mask, 1.0, 1.0, whiten=False)
    expected = reference_reward_to_go(rewards, mask)
    torch.testing.assert_close(out.advantages, expected)
    torch.testing.assert_close(out.returns, expected)
    # REINFORCE++ (same return-to-go) and ReMax with a zero baseline agree
    torch.testing.assert_close(reinforce_plus_plus_advantages(rewards, mask, 1.0).returns, expected)
    torch.testing.assert_close(
        remax_advantages(rewards, torch.zeros(len(rewards), dtype=D), mask).advantages, expected
    )


@settings(max_examples=50, deadline=None)
@given(token_batches(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_whitened_gae_has_zero_mean_unit_variance(batch, gamma, lam):
    rewards, mask = batch
    values = torch.randn_like(rewards)
    raw = gae_advantages(rewards, values, mask, gamma, lam, whiten=False).advantages
    out = gae_advantages(rewards, values, mask, gamma, lam)
    assert (out.advantages[mask == 0] == 0).all() and (out.returns[mask == 0] == 0).all()
    torch.testing.assert_close(out.returns, torch.where(mask.bool(), raw + values, 0.0))
    if mask.sum() >= 2 and masked_var(raw, mask) > 1e-3:
        assert abs(masked_mean(out.advantages, mask).item()) < 1e-9
        assert masked_var(out.advantages, mask).item() == pytest.approx(1.0, abs=1e-5)


@st.composite
def grouped_scores(draw):
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=5))
    ids = [g for g, n in enumerate(sizes) for _ in range(n)]
    perm = draw(st.permutations(range(len(ids))))  # groups interleaved in the batch
    group_ids = torch.tensor([ids[i] * 10 + 3 for i in perm])  # sparse ids
    scores = t64(draw(st.lists(st.floats(-10, 10), min_size=len(ids), max_size=len(ids))))
    return scores, group_ids


@settings(max_examples=50, deadline=None)
@given(grouped_scores())
def test_group_advantages_center_each_group(batch):
    scores, group_ids = batch
    mask = torch.ones(len(scores), 3, dtype=D)
    rloo = rloo_advantages(scores, mask, group_ids).advantages[:, 0]
    grpo = grpo_advantages(scores, mask, group_ids).advantages[:, 0]
    dr_grpo = grpo_advantages(scores, mask, group_ids, norm_by_std=False).advantages[:, 0]
    for g in group_ids.unique():
        members = group_ids == g
        if members.sum() == 1:  # singleton: no baseline (verl)
            torch.testing.assert_close(rloo[members], scores[members])
            torch.testing.assert_close(dr_grpo[members], scores[members])
            continue
        assert abs(rloo[members].sum().item()) < 1e-9  # RLOO sums to 0
        assert abs(grpo[members].mean().item()) < 1e-6  # GRPO has group mean 0
        assert abs(dr_grpo[members].mean().item()) < 1e-9


@settings(max_examples=50, deadline=None)
@given(grouped_scores(), st.integers(0, 2**31 - 1))
def test_outcome_advantages_are_broadcast_and_zero_on_padding(batch, seed):
    scores, group_ids = batch
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(len(scores), 5, generator=gen) < 0.6).to(D)
    for fn in (grpo_advantages, rloo_advantages, reinforce_plus_plus_baseline_advantages):
        adv = fn(scores, mask, group_ids).advantages
        assert (adv[mask == 0] == 0).all()
        # every valid token of a row carries the same sequence-level advantage
        valid = mask != 0
        row_max = torch.where(valid, adv, -math.inf).amax(-1)
        row_min = torch.where(valid, adv, math.inf).amin(-1)
        has_token = valid.any(-1)
        torch.testing.assert_close(row_max[has_token], row_min[has_token])


def test_reinforce_plus_plus_baseline_whitens_with_verls_epsilon():
    # Scores 1e-4 apart: variance ~2.5e-9, where 1e-6 (the old default) and verl's 1e-8 differ.
    scores = torch.tensor([0.0, 1e-4, 0.0, 1e-4])
    mask = torch.ones(4, 2)
    out = reinforce_plus_plus_baseline_advantages(scores, mask, torch.tensor([0, 0, 1, 1]))
    centred = (scores - torch.tensor([5e-5, 5e-5, 5e-5, 5e-5]))[:, None] * mask
    var = centred.var(unbiased=True)
    expected = centred * torch.rsqrt(var + 1e-8)
    assert torch.allclose(out.advantages, expected, rtol=1e-4)
