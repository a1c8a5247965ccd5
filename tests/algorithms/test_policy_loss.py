"""PPO clipped policy loss with dual clip, GSPO, GMPO, Clip-Cov, KL-Cov, truncated IS
weights, mismatch metrics."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss
from meshrl.algorithms.masked import masked_mean
from meshrl.algorithms.policy_loss import (
    clip_cov_policy_loss,
    geo_mean_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    ppo_policy_loss,
    rollout_mismatch_metrics,
    truncated_is_weights,
)

NAN = float("nan")
D = torch.float64
# Rows of length 3, 1 and 4 (padding in the middle). eps_low = eps_high = 0.2, c = 3.
# token  A     r     -A*r   -A*clip(r)  max     dual cap -A*3      pg     branch
#   a   +1    1.5   -1.5    -1.2       -1.2                       -1.2    clipped
#   b   +1    0.5   -0.5    -0.8       -0.5                       -0.5
#   c   -1    1.5    1.5     1.2        1.5     3 (not hit)         1.5
#   d   -1    5.0    5.0     1.2        5.0     3 (hit)             3.0    dual clip
#   e   -1    0.5    0.5     0.8        0.8     3 (not hit)         0.8    clipped
#   f   +2    1.0   -2.0    -2.0       -2.0                       -2.0
#   g    0    2.0    0       0          0                           0
#   h   +0.5  1.1   -0.55   -0.55      -0.55                      -0.55
# sum = -1.2 - 0.5 + 1.5 + 3 + 0.8 - 2 + 0 - 0.55 = 1.05 over 8 tokens -> 0.13125
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=D)
ADV = torch.tensor([[1, 1, -1, NAN], [-1, NAN, NAN, NAN], [-1, 2, 0, 0.5]], dtype=D)
RATIO = [[1.5, 0.5, 1.5, 1.0], [5.0, 1.0, 1.0, 1.0], [0.5, 1.0, 2.0, 1.1]]
OLD = torch.full((3, 4), -1.0, dtype=D)
LOGP = OLD + torch.tensor(RATIO, dtype=D).log()
LOGP[0, 3] = LOGP[1, 1:] = NAN  # garbage under padding


def test_hand_computed():
    out = ppo_policy_loss(LOGP, OLD, ADV, MASK)
    assert out.loss.item() == pytest.approx(1.05 / 8)
    assert out.clipfrac.item() == pytest.approx(2 / 8)  # a, e
    assert out.clipfrac_lower.item() == pytest.approx(1 / 8)  # d
    # approx_kl = mean(old - logp) = -mean(log r) over the 8 valid tokens
    log_r = [math.log(r) for r in (1.5, 0.5, 1.5, 5.0, 0.5, 1.0, 2.0, 1.1)]
    assert out.approx_kl.item() == pytest.approx(-sum(log_r) / 8)


def test_gradient_is_zero_on_clipped_tokens_and_padding():
    logp = LOGP.clone().requires_grad_(True)
    ppo_policy_loss(logp, OLD, ADV, MASK).loss.backward()
    # unclipped tokens: d(-A r)/d logp = -A r, divided by the 8 tokens
    # a, d, e clipped -> 0 ; g has A = 0 ; padding -> 0 (not nan)
    expected = torch.tensor([[0, -0.5, 1.5, 0], [0, 0, 0, 0], [0, -2.0, 0, -0.55]], dtype=D) / 8
    torch.testing.assert_close(logp.grad, expected)


def test_dual_clip_can_be_disabled_and_must_exceed_one():
    out = ppo_policy_loss(LOGP, OLD, ADV, MASK, clip_ratio_c=None)
    # d keeps its 5.0: 1.05 - 3 + 5 = 3.05
    assert out.loss.item() == pytest.approx(3.05 / 8)
    assert out.clipfrac_lower.item() == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(LOGP, OLD, ADV, MASK, clip_ratio_c=1.0)


def test_asymmetric_clip_higher():
    # clip_ratio_high 0.6: token a (r 1.5 < 1.6) is no longer clipped: -1.5 instead of -1.2
    out = ppo_policy_loss(LOGP, OLD, ADV, MASK, clip_ratio_high=0.6)
    assert out.loss.item() == pytest.approx((1.05 - 0.3) / 8)
    assert out.clipfrac.item() == pytest.approx(1 / 8)


def test_is_weights_multiply_per_token_loss_and_are_detached():
    weights = torch.full((3, 4), 2.0, dtype=D, requires_grad=True)
    logp = LOGP.clone().requires_grad_(True)
    out = ppo_policy_loss(logp, OLD, ADV, MASK, is_weights=weights)
    assert out.loss.item() == pytest.approx(2 * 1.05 / 8)
    out.loss.backward()
    assert weights.grad is None  # constants: no gradient flows into the weights


def test_global_token_count_and_agg_mode_are_forwarded():
    out = ppo_policy_loss(LOGP, OLD, ADV, MASK, global_token_count=16)
    assert out.loss.item() == pytest.approx(1.05 / 16)
    # per-row pg sums: row 0 -0.2, row 1 3.0, row 2 -1.75 -> seq-mean-token-sum 1.05 / 3
    out = ppo_policy_loss(LOGP, OLD, ADV, MASK, loss_agg_mode="seq-mean-token-sum")
    assert out.loss.item() == pytest.approx(1.05 / 3)
    # Dr. GRPO: sum / (N_seq * T) with a constant T = 8 -> 1.05 / 24
    out = ppo_policy_loss(
        LOGP, OLD, ADV, MASK, loss_agg_mode="seq-mean-token-sum-norm", norm_length=8
    )
    assert out.loss.item() == pytest.approx(1.05 / 24)


def test_log_ratio_is_clamped_before_exp():
    logp = torch.tensor([[100.0]], dtype=D)
    out = ppo_policy_loss(
        logp, torch.zeros(1, 1, dtype=D), torch.ones(1, 1, dtype=D), torch.ones(1, 1)
    )
    assert torch.isfinite(out.loss) and out.approx_kl.item() == -20.0


@st.composite
def policy_batches(draw):
    b, t = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logp = -torch.rand(b, t, generator=gen, dtype=D) * 5
    adv = torch.randn(b, t, generator=gen, dtype=D)
    mask = (torch.rand(b, t, generator=gen) < 0.7).to(D)
    return logp, adv, mask


@settings(max_examples=50, deadline=None)
@given(policy_batches())
def test_ratio_one_gives_minus_mean_advantage(batch):
    logp, adv, mask = batch
    out = ppo_policy_loss(logp, logp.clone(), adv, mask)
    torch.testing.assert_close(out.loss, -masked_mean(adv, mask))
    assert out.clipfrac.item() == 0.0 and out.clipfrac_lower.item() == 0.0
    assert out.approx_kl.item() == 0.0


@settings(max_examples=50, deadline=None)
@given(policy_batches(), st.sampled_from(LOSS_AGG_MODES))
def test_ratio_one_matches_aggregate_of_minus_advantage(batch, mode):
    logp, adv, mask = batch
    out = ppo_policy_loss(logp, logp.clone(), adv, mask, loss_agg_mode=mode)
    torch.testing.assert_close(out.loss, aggregate_loss(-adv, mask, mode))


def test_truncated_is_weights():
    # exp(old - rollout): exp(0.5) = 1.6487 -> capped at 1.2 ; exp(-0.5) = 0.6065 ; exp(0) = 1
    old = torch.tensor([[-1.0, -1.0, -1.0, NAN]], requires_grad=True)
    rollout = torch.tensor([[-1.5, -0.5, -1.0, NAN]])
    w = truncated_is_weights(old, rollout, torch.tensor([[1, 1, 1, 0]]), cap=1.2)
    torch.testing.assert_close(w, torch.tensor([[1.2, math.exp(-0.5), 1.0, 0.0]]))
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(old, rollout, torch.ones(1, 4), cap=-1)


def test_rollout_mismatch_metrics():
    # probabilities 0.5 vs 0.4, 0.2 vs 0.2, 0.9 vs 0.6 -> |diff| = 0.1, 0, 0.3 ; padding ignored
    old = torch.tensor([[0.5, 0.2], [0.9, 0.01]], dtype=D).log()
    rollout = torch.tensor([[0.4, 0.2], [0.6, 0.99]], dtype=D).log()
    metrics = rollout_mismatch_metrics(old, rollout, torch.tensor([[1, 1], [1, 0]]))
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(0.4 / 3)
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.3)
    assert metrics["training/rollout_probs_diff_std"] == pytest.approx(
        statistics.stdev([0.1, 0.0, 0.3])
    )
    empty = rollout_mismatch_metrics(old, rollout, torch.zeros(2, 2))
    assert set(empty.values()) == {0.0} and len(empty) == 3


# --- GSPO: one ratio a response ------------------------------------------------------------


def _gspo_by_hand(logp, old, adv, mask, low, high, weights=None):
    """(loss, gradient wrt logp) written out per response: s = exp(min(mean log ratio, 10));
    pg_t = w_t * max(-A_t s, -A_t clip(s)); the mean over each response's tokens, then over
    responses. d pg_t / d logp_t = -w_t A_t s where the unclipped term wins, else 0."""
    n, total = mask.shape[0], 0.0
    grad = torch.zeros(mask.shape, dtype=D)
    for i in range(n):
        valid = mask[i].bool()
        s = math.exp(min((logp[i][valid] - old[i][valid]).mean().item(), 10.0))
        w = [1.0] * int(valid.sum()) if weights is None else weights[i][valid].tolist()
        cols = valid.nonzero().flatten().tolist()
        row = 0.0
        for col, a, w_t in zip(cols, adv[i][valid].tolist(), w, strict=True):
            unclipped, clipped = -a * s, -a * min(max(s, 1 - low), 1 + high)
            row += w_t * max(unclipped, clipped)
            grad[i, col] = -w_t * a * s / (len(cols) * n) if unclipped >= clipped else 0.0
        total += row / len(cols)
    return total / n, grad


def test_gspo_by_hand_and_its_gradient():
    # rows: s = (1.5 * 0.5 * 1.5) ** (1/3) = 1.04 (inside the range); s = 5 with A = -1
    # (the unclipped term wins: no dual clip); s = (0.5 * 1 * 2 * 1.1) ** (1/4) = 1.02 with
    # the advantage varying token by token. Garbage under padding, in logp and in old.
    old = OLD.clone()
    old[0, 3] = old[1, 1:] = float("inf")
    weights = torch.tensor([[0.5, 1.0, 2.0, 9.0], [1.0, 9.0, 9.0, 9.0], [1.0, 0.5, 1.0, 1.5]])
    adv = torch.nan_to_num(ADV)
    for w in (None, weights.to(D)):
        logp = LOGP.clone().requires_grad_(True)
        out = gspo_policy_loss(
            logp, old, ADV, MASK, clip_ratio_low=0.2, clip_ratio_high=0.2, is_weights=w
        )
        loss, grad = _gspo_by_hand(LOGP, OLD, adv, MASK, 0.2, 0.2, w)
        assert out.loss.item() == pytest.approx(loss)
        out.loss.backward()
        torch.testing.assert_close(logp.grad, grad)  # 0 under padding, never NaN
    assert out.clipfrac_lower.item() == 0.0  # no dual clip
    ratio = torch.tensor(RATIO, dtype=D)
    assert out.approx_kl.item() == pytest.approx(masked_mean(-ratio.log(), MASK).item())


def test_gspo_caps_the_sequence_log_ratio_at_10():
    old = torch.zeros(1, 2, dtype=D)
    logp = torch.full((1, 2), 12.0, dtype=D, requires_grad=True)
    adv = torch.ones(1, 2, dtype=D)
    out = gspo_policy_loss(logp, old, -adv, torch.ones(1, 2, dtype=D), clip_ratio_low=0.2,
                           clip_ratio_high=0.2)  # fmt: skip
    assert out.loss.item() == pytest.approx(math.exp(10.0))  # not exp(12)
    out.loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2, dtype=D))  # past the cap: no gradient


def test_gspo_clips_a_whole_response_at_once():
    # one response whose ratio left the (tiny) clip range upwards with A > 0: every token of
    # it is clipped and gets no gradient; the other, inside the range, trains
    old = torch.zeros(2, 3, dtype=D)
    logp = torch.tensor([[0.01, 0.02, 0.0], [0.0, 0.0, 0.0]], dtype=D, requires_grad=True)
    mask = torch.ones(2, 3, dtype=D)
    adv = torch.ones(2, 3, dtype=D)
    out = gspo_policy_loss(logp, old, adv, mask, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    out.loss.backward()
    assert out.clipfrac.item() == pytest.approx(0.5)
    assert torch.equal(logp.grad[0], torch.zeros(3, dtype=D))
    assert (logp.grad[1] < 0).all()


def test_gspo_on_one_token_responses_is_ppo_without_dual_clip():
    # a response of one token: its sequence ratio is its token ratio
    g = torch.Generator().manual_seed(0)
    old = torch.randn(6, 1, generator=g, dtype=D)
    logp = old + 0.3 * torch.randn(6, 1, generator=g, dtype=D)
    adv = torch.randn(6, 1, generator=g, dtype=D)
    mask = torch.ones(6, 1, dtype=D)
    gspo = gspo_policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    ppo = ppo_policy_loss(
        logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None,
        loss_agg_mode="seq-mean-token-mean",
    )  # fmt: skip
    assert gspo.loss.item() == pytest.approx(ppo.loss.item())
    assert gspo.clipfrac.item() == pytest.approx(ppo.clipfrac.item())


def test_gspo_micro_batches_sum_to_the_mini_batch():
    half = [slice(0, 1), slice(1, 3)]
    whole = gspo_policy_loss(LOGP, OLD, ADV, MASK, clip_ratio_low=0.2, clip_ratio_high=0.2)
    parts = sum(
        gspo_policy_loss(
            LOGP[r], OLD[r], ADV[r], MASK[r], clip_ratio_low=0.2, clip_ratio_high=0.2,
            global_seq_count=3,
        ).loss.item()
        for r in half
    )  # fmt: skip
    assert parts == pytest.approx(whole.loss.item())


# --- GMPO: the geometric mean of token ratios clipped in log space ------------------------


def _geo_mean_by_hand(logp, old, adv, mask, low, high, weights=None):
    """(loss, gradient wrt logp) per response: l_t = min(log r_t, high) if A_t > 0,
    max(log r_t, -low) if A_t < 0, 0 if A_t = 0; s = exp(mean l); pg = -mean(A) * s * w, w
    the geometric mean of the weights; then the mean over responses. d pg / d logp_t is
    -mean(A) * s * w / |y| where l_t is log r_t itself, else 0."""
    n, total = mask.shape[0], 0.0
    grad = torch.zeros(mask.shape, dtype=D)
    for i in range(n):
        cols = mask[i].nonzero().flatten().tolist()
        bounded, kept = [], []
        for col in cols:
            a, log_r = adv[i, col].item(), (logp[i, col] - old[i, col]).item()
            if a > 0:
                bounded.append(min(log_r, high))
            elif a < 0:
                bounded.append(max(log_r, -low))
            else:
                bounded.append(0.0)
            kept.append(a != 0 and bounded[-1] == log_r)
        s = math.exp(sum(bounded) / len(cols))
        a_mean = sum(adv[i, c].item() for c in cols) / len(cols)
        w = 1.0
        if weights is not None:
            w = math.exp(sum(math.log(weights[i, c].item()) for c in cols) / len(cols))
        total += -a_mean * s * w
        for col, k in zip(cols, kept, strict=True):
            grad[i, col] = -a_mean * s * w / (len(cols) * n) if k else 0.0
    return total / n, grad


def test_geo_mean_hand_computed():
    # Bounds +-0.2 on log r. Response 1, A = +1: log r 0.5 is capped at 0.2, -0.1 is kept:
    # s = exp(0.05), pg = -exp(0.05). Response 2, A = -2: log r -0.5 is raised to -0.2, 0.1
    # is kept: s = exp(-0.05), pg = 2 exp(-0.05). The loss is their mean.
    logp = torch.tensor([[0.5, -0.1], [-0.5, 0.1]], dtype=D, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]], dtype=D)
    out = geo_mean_policy_loss(
        logp, torch.zeros(2, 2, dtype=D), adv, torch.ones(2, 2), clip_ratio_low=0.2,
        clip_ratio_high=0.2,
    )  # fmt: skip
    assert out.loss.item() == pytest.approx((-math.exp(0.05) + 2 * math.exp(-0.05)) / 2)
    out.loss.backward()
    # kept tokens: -A * s / (|y| * N_seq); the capped ones get nothing
    expected = torch.tensor([[0.0, -math.exp(0.05)], [0.0, 2 * math.exp(-0.05)]], dtype=D) / 4
    torch.testing.assert_close(logp.grad, expected)
    assert out.clipfrac.item() == 0.25 and out.clipfrac_lower.item() == 0.25


def test_geo_mean_by_hand_and_its_gradient():
    # Bounds +-0.2 on log r. Row 0 (A = 1, 1, -1; r = 1.5, 0.5, 1.5): a's log 1.5 is capped
    # at 0.2; b's log 0.5 is below -0.2, but a gain is only capped from above; c (A < 0) is
    # only raised from below. Row 1: log 5 with A = -1 is kept (no dual clip). Row 2: e's
    # log 0.5 with A = -1 is raised to -0.2, g (A = 0) counts as log 1 and gets no gradient,
    # and the mean advantage 0.375 weighs the whole response. Garbage under padding.
    old = OLD.clone()
    old[0, 3] = old[1, 1:] = float("inf")
    weights = torch.tensor([[0.5, 1.0, 2.0, NAN], [1.5, NAN, 9.0, 9.0], [1.0, 0.5, 1.0, 1.5]])
    adv = torch.nan_to_num(ADV)
    for w in (None, weights.to(D)):
        logp = LOGP.clone().requires_grad_(True)
        out = geo_mean_policy_loss(
            logp, old, ADV, MASK, clip_ratio_low=0.2, clip_ratio_high=0.2, is_weights=w
        )
        loss, grad = _geo_mean_by_hand(LOGP, OLD, adv, MASK, 0.2, 0.2, w)
        assert out.loss.item() == pytest.approx(loss)
        out.loss.backward()
        torch.testing.assert_close(logp.grad, grad)  # 0 under padding, never NaN
    # Capped: a (A > 0, above the ceiling) and e (A < 0, below the floor). verl's metric
    # also counts b, c and d, out of range on the side where the bound is not taken.
    assert out.clipfrac.item() == pytest.approx(1 / 8)
    assert out.clipfrac_lower.item() == pytest.approx(1 / 8)
    ratio = torch.tensor(RATIO, dtype=D)
    assert out.approx_kl.item() == pytest.approx(masked_mean(-ratio.log(), MASK).item())


@settings(max_examples=50, deadline=None)
@given(policy_batches())
def test_geo_mean_at_ratio_one_is_minus_each_responses_mean_advantage(batch):
    logp, adv, mask = batch
    out = geo_mean_policy_loss(
        logp, logp.clone(), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2
    )
    torch.testing.assert_close(out.loss, aggregate_loss(-adv, mask, "seq-mean-token-mean"))
    assert out.clipfrac.item() == 0.0 and out.clipfrac_lower.item() == 0.0


@settings(max_examples=25, deadline=None)
@given(policy_batches())
def test_geo_mean_gradient_at_ratio_one_is_ppos_for_one_advantage_a_response(batch):
    logp, adv, mask = batch
    adv = adv[:, :1].expand_as(adv)  # an outcome estimator's: one advantage a response
    grads = []
    for loss_fn in (
        lambda lp: geo_mean_policy_loss(lp, logp, adv, mask, clip_ratio_low=0.2,
                                        clip_ratio_high=0.2),
        lambda lp: ppo_policy_loss(lp, logp, adv, mask, loss_agg_mode="seq-mean-token-mean"),
    ):  # fmt: skip
        lp = logp.clone().requires_grad_(True)
        loss_fn(lp).loss.backward()
        grads.append(lp.grad)
    torch.testing.assert_close(*grads)


def test_geo_mean_on_one_token_responses_is_ppo_with_exponential_bounds():
    # One token: the geometric mean is the token's ratio, clipped to [exp(-low), exp(high)];
    # PPO's range [1 - low', 1 + high'] with low' = 1 - exp(-low), high' = exp(high) - 1.
    g = torch.Generator().manual_seed(0)
    old = torch.randn(8, 1, generator=g, dtype=D)
    logp = old + 0.3 * torch.randn(8, 1, generator=g, dtype=D)
    adv = torch.randn(8, 1, generator=g, dtype=D)
    mask = torch.ones(8, 1, dtype=D)
    results = []
    for loss_fn in (
        lambda lp: geo_mean_policy_loss(lp, old, adv, mask, clip_ratio_low=0.2,
                                        clip_ratio_high=0.28),
        lambda lp: ppo_policy_loss(
            lp, old, adv, mask, clip_ratio_low=1 - math.exp(-0.2),
            clip_ratio_high=math.exp(0.28) - 1, clip_ratio_c=None,
        ),
    ):  # fmt: skip
        lp = logp.clone().requires_grad_(True)
        out = loss_fn(lp)
        out.loss.backward()
        results.append((out, lp.grad))
    (geo, geo_grad), (ppo, ppo_grad) = results
    assert geo.loss.item() == pytest.approx(ppo.loss.item())
    torch.testing.assert_close(geo_grad, ppo_grad)
    assert ppo.clipfrac.item() > 0  # some tokens were clipped, on either side
    assert geo.clipfrac.item() + geo.clipfrac_lower.item() == pytest.approx(ppo.clipfrac.item())


def test_geo_mean_micro_batches_sum_to_the_mini_batch():
    kwargs = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}
    whole = geo_mean_policy_loss(LOGP, OLD, ADV, MASK, **kwargs)
    parts = sum(
        geo_mean_policy_loss(
            LOGP[r], OLD[r], ADV[r], MASK[r], global_seq_count=3, **kwargs
        ).loss.item()
        for r in (slice(0, 1), slice(1, 3))
    )
    assert parts == pytest.approx(whole.loss.item())


# --- Clip-Cov and KL-Cov: tokens chosen by their covariance --------------------------------

# Two responses of three tokens (a fourth column of padding garbage). mean A = 0.5, mean
# logp = -2, so cov = (A - 0.5) * (logp + 2); PPO's terms -A r with eps 0.2, where row 1's
# r = 0.5 is clipped to 0.8 (and A < 0: the clipped term 0.8 is taken):
#   row   logp             A    r               cov                PPO terms
#    0    -1, -3, -0.5     2    1, 1.1, 1.1     1.5, -1.5, 2.25    -2, -2.2, -2.2
#    1    -2, -4, -1.5    -1    1, 0.5, 1       0,    3,  -0.75     1,  0.8,  1
COV_LOGP = torch.tensor([[-1.0, -3.0, -0.5, NAN], [-2.0, -4.0, -1.5, NAN]], dtype=D)
COV_ADV = torch.tensor([[2.0, 2.0, 2.0, NAN], [-1.0, -1.0, -1.0, NAN]], dtype=D)
COV_RATIO = torch.tensor([[1.0, 1.1, 1.1, 1.0], [1.0, 0.5, 1.0, 1.0]], dtype=D)
COV_OLD = COV_LOGP - COV_RATIO.log()
COV_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=D)


def test_clip_cov_by_hand():
    # Candidates (1 < cov < 5, PPO's clip not taken): (0, 0) and (0, 2); (1, 1) has cov 3 but
    # PPO clipped it already. A ratio of 0.5 allows int(0.5 * 6) = 3 tokens: both go.
    logp = COV_LOGP.clone().requires_grad_(True)
    out = clip_cov_policy_loss(logp, COV_OLD, COV_ADV, COV_MASK, clip_cov_ratio=0.5)
    assert out.loss.item() == pytest.approx((-2.2 + 1 + 0.8 + 1) / 6)  # still over 6 tokens
    assert out.clipfrac.item() == pytest.approx(2 / 6)  # the share held back
    assert out.clipfrac_lower.item() == 0.0
    assert out.approx_kl.item() == pytest.approx(-(2 * math.log(1.1) + math.log(0.5)) / 6)
    out.loss.backward()
    # -A r where the token stayed and PPO's unclipped term was taken; 0 elsewhere and in padding
    expected = torch.tensor([[0.0, -2.2, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]], dtype=D) / 6
    torch.testing.assert_close(logp.grad, expected)
    # The bounds are strict: at lb 1.5 or ub 2.25 one candidate is left.
    for bounds, left in (({"clip_cov_lb": 1.5}, -2.0), ({"clip_cov_ub": 2.25}, -2.2)):
        out = clip_cov_policy_loss(
            COV_LOGP, COV_OLD, COV_ADV, COV_MASK, clip_cov_ratio=0.5, **bounds
        )
        assert out.loss.item() == pytest.approx((0.6 + left) / 6)


def test_clip_cov_draws_among_the_candidates_and_a_seed_draws_the_same_again():
    # The default ratio allows one token, max(1, int(0.0002 * 6)): (0, 0) or (0, 2), each
    # for some seeds. Held back (0, 0): -2.2 - 2.2 + 2.8; (0, 2): -2 - 2.2 + 2.8.
    def loss_times_6(seed):
        draw = torch.Generator().manual_seed(seed)
        out = clip_cov_policy_loss(COV_LOGP, COV_OLD, COV_ADV, COV_MASK, generator=draw)
        assert out.clipfrac.item() == pytest.approx(1 / 6)
        return round(out.loss.item() * 6, 9)

    drawn = [loss_times_6(seed) for seed in range(40)]
    assert set(drawn) == {-1.6, -1.4}
    assert [loss_times_6(seed) for seed in range(40)] == drawn


@settings(max_examples=50, deadline=None)
@given(policy_batches(), st.sampled_from(LOSS_AGG_MODES))
def test_clip_cov_without_candidates_is_ppo_without_dual_clip(batch, mode):
    logp, adv, mask = batch
    old = logp - 0.5 * torch.sin(7 * logp)  # ratios in [exp(-0.5), exp(0.5)]: some clipped
    results = []
    for loss_fn in (
        lambda lp: clip_cov_policy_loss(lp, old, adv, mask, clip_cov_lb=1e9, clip_cov_ub=2e9,
                                        loss_agg_mode=mode),
        lambda lp: ppo_policy_loss(lp, old, adv, mask, clip_ratio_c=None, loss_agg_mode=mode),
    ):  # fmt: skip
        lp = logp.clone().requires_grad_(True)
        out = loss_fn(lp)
        out.loss.backward()
        results.append((out, lp.grad))
    (cov, cov_grad), (ppo, ppo_grad) = results
    torch.testing.assert_close(cov.loss, ppo.loss)
    torch.testing.assert_close(cov_grad, ppo_grad)
    assert cov.clipfrac.item() == 0.0  # nothing held back


def test_kl_cov_by_hand():
    # int(0.34 * 6) = 2 tokens of largest cov, (1, 1) (3) and (0, 2) (2.25), add
    # 0.1 |log r|. No clip: (1, 1) keeps -A r = 0.5.
    logp = COV_LOGP.clone().requires_grad_(True)
    out = kl_cov_policy_loss(logp, COV_OLD, COV_ADV, COV_MASK, kl_cov_ratio=0.34)
    unclipped = -2 - 2.2 - 2.2 + 1 + 0.5 + 1
    assert out.loss.item() == pytest.approx((unclipped + 0.1 * math.log(2.2)) / 6)
    assert out.clipfrac.item() == 0.0 and out.clipfrac_lower.item() == 0.0
    # verl's ppo_kl of this mode: the mean of |log r|
    assert out.approx_kl.item() == pytest.approx((2 * math.log(1.1) + math.log(2)) / 6)
    out.loss.backward()
    # -A r, plus 0.1 * sign(log r) on the penalised: (0, 2) +0.1, (1, 1) -0.1
    expected = torch.tensor([[-2.0, -2.2, -2.1, 0.0], [1.0, 0.4, 1.0, 0.0]], dtype=D) / 6
    torch.testing.assert_close(logp.grad, expected)
    # the default ratio: one token, the largest cov (1, 1); with ppo_kl_coef 1
    out = kl_cov_policy_loss(COV_LOGP, COV_OLD, COV_ADV, COV_MASK, ppo_kl_coef=1.0)
    assert out.loss.item() == pytest.approx((unclipped + math.log(2)) / 6)


@settings(max_examples=50, deadline=None)
@given(policy_batches(), st.sampled_from(LOSS_AGG_MODES))
def test_kl_cov_at_ratio_one_is_ppo_and_so_is_its_gradient(batch, mode):
    # |log r| is 0 and so is its gradient (sign 0) at r = 1, whichever tokens are chosen
    logp, adv, mask = batch
    results = []
    for loss_fn in (
        lambda lp: kl_cov_policy_loss(lp, logp, adv, mask, kl_cov_ratio=0.5, ppo_kl_coef=1.0,
                                      loss_agg_mode=mode),
        lambda lp: ppo_policy_loss(lp, logp, adv, mask, loss_agg_mode=mode),
    ):  # fmt: skip
        lp = logp.clone().requires_grad_(True)
        out = loss_fn(lp)
        out.loss.backward()
        results.append((out, lp.grad))
    (kl, kl_grad), (ppo, ppo_grad) = results
    torch.testing.assert_close(kl.loss, ppo.loss)
    torch.testing.assert_close(kl_grad, ppo_grad)
    assert kl.approx_kl.item() == 0.0


@settings(max_examples=50, deadline=None)
@given(policy_batches())
def test_kl_cov_without_penalty_is_the_unclipped_policy_gradient(batch):
    logp, adv, mask = batch
    old = logp - 0.5 * torch.sin(7 * logp)
    kl = kl_cov_policy_loss(logp, old, adv, mask, kl_cov_ratio=1.0, ppo_kl_coef=0.0)
    ppo = ppo_policy_loss(
        logp, old, adv, mask, clip_ratio_low=1.0, clip_ratio_high=math.inf, clip_ratio_c=None
    )
    torch.testing.assert_close(kl.loss, ppo.loss)


def test_kl_cov_micro_batches_sum_to_the_mini_batch_when_every_token_is_penalised():
    # kl_cov_ratio 1 chooses every token whatever the split; a smaller ratio chooses per
    # micro-batch (the top tokens of each and at least one each), as verl.
    whole = kl_cov_policy_loss(LOGP, OLD, ADV, MASK, kl_cov_ratio=1.0)
    parts = sum(
        kl_cov_policy_loss(LOGP[r], OLD[r], ADV[r], MASK[r], kl_cov_ratio=1.0,
                           global_token_count=8).loss.item()
        for r in (slice(0, 1), slice(1, 3))
    )  # fmt: skip
    assert parts == pytest.approx(whole.loss.item())


def test_cov_losses_weigh_tokens_by_is_weights_and_check_their_ratio():
    weights = torch.full((2, 4), 2.0, dtype=D)
    for loss_fn in (
        lambda **kw: clip_cov_policy_loss(COV_LOGP, COV_OLD, COV_ADV, COV_MASK,
                                          clip_cov_ratio=0.5, **kw),
        lambda **kw: kl_cov_policy_loss(COV_LOGP, COV_OLD, COV_ADV, COV_MASK, **kw),
    ):  # fmt: skip
        assert loss_fn(is_weights=weights).loss.item() == pytest.approx(2 * loss_fn().loss.item())
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        clip_cov_policy_loss(COV_LOGP, COV_OLD, COV_ADV, COV_MASK, clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        kl_cov_policy_loss(COV_LOGP, COV_OLD, COV_ADV, COV_MASK, kl_cov_ratio=0.0)


def test_geo_mean_clip_fractions_count_only_tokens_beyond_their_bound():
    # clip 0.25 both ways; log-ratios exact in binary. Row 0: +0.25 with A > 0 and -0.25
    # with A < 0 sit on their bounds (not capped), -0.5 with A = 0 is no side's. Row 1:
    # +0.5 with A > 0 and -0.5 with A < 0 are capped: 1 of 6 tokens each side.
    old = torch.full((2, 3), -1.0)
    logp = torch.tensor([[-0.75, -1.25, -1.5], [-0.5, -1.5, -1.0]])
    adv = torch.tensor([[1.0, -1.0, 0.0], [1.0, -1.0, 0.0]])
    out = geo_mean_policy_loss(
        logp, old, adv, torch.ones(2, 3), clip_ratio_low=0.25, clip_ratio_high=0.25
    )
    assert out.clipfrac.item() == pytest.approx(1 / 6)
    assert out.clipfrac_lower.item() == pytest.approx(1 / 6)


def test_geo_mean_with_a_zero_is_weight_is_finite():
    # A weight of 0 on one token: the response's geometric-mean weight is ~0, not NaN.
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    out = geo_mean_policy_loss(
        logp,
        logp.detach(),
        torch.ones(1, 2),
        torch.ones(1, 2),
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        is_weights=torch.tensor([[0.0, 1.0]]),
    )
    assert math.isfinite(out.loss.item()) and abs(out.loss.item()) < 1e-4
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_rollout_mismatch_std_of_one_token_is_zero_and_of_two_is_unbiased():
    # |exp(old) - exp(rollout)|: one token -> std 0; two tokens |1 - e^-1|, 0 -> unbiased std.
    one = rollout_mismatch_metrics(torch.zeros(1, 1), torch.full((1, 1), -1.0), torch.ones(1, 1))
    assert one["training/rollout_probs_diff_std"] == 0.0
    two = rollout_mismatch_metrics(torch.zeros(1, 2), torch.tensor([[-1.0, 0.0]]), torch.ones(1, 2))
    d = 1 - math.exp(-1)
    assert two["training/rollout_probs_diff_std"] == pytest.approx(statistics.stdev([d, 0.0]))


def test_truncated_is_weights_cap_must_be_positive_and_may_be_below_one():
    old, rollout, mask = torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2)
    with pytest.raises(ValueError, match="cap must be > 0, got 0"):
        truncated_is_weights(old, rollout, mask, cap=0)
    w = truncated_is_weights(old, rollout, mask, cap=0.5)  # exp(1) and exp(-1) = 0.37
    torch.testing.assert_close(w, torch.tensor([[0.5, math.exp(-1.0)]]))


def test_cov_losses_default_to_the_configs_defaults():
    # Called without them (as the tests do), the functions behave as a default config.
    import inspect

    from meshrl.config.sections import PolicyLossConfig

    cfg = PolicyLossConfig()
    for fn, names in [
        (clip_cov_policy_loss, ["clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"]),
        (kl_cov_policy_loss, ["kl_cov_ratio", "ppo_kl_coef"]),
    ]:
        params = inspect.signature(fn).parameters
        assert {n: params[n].default for n in names} == {n: getattr(cfg, n) for n in names}


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("fn", ["kl_cov", "clip_cov"])
def test_cov_losses_pass_the_global_counts_and_length_to_the_aggregation(mode, fn):
    # At ratio 1 and with no token penalised (ratio 0 of them) KL-Cov's per-token loss is
    # -A; a micro-batch of 2 of the mini-batch's 5 responses, T = 7.
    adv = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logp = torch.zeros(2, 3)
    counts = {"global_token_count": 9, "global_seq_count": 5, "norm_length": 7}
    if fn == "kl_cov":
        out = kl_cov_policy_loss(
            logp, logp, adv, mask, kl_cov_ratio=1e-9, loss_agg_mode=mode, **counts
        )
    else:  # at ratio 1 no token is clipped, and a ratio of 1e-9 of 3 tokens draws none
        out = clip_cov_policy_loss(
            logp, logp, adv, mask, clip_cov_ratio=1e-9, loss_agg_mode=mode, **counts
        )
    # seq-mean-token-sum: (-3 + -3) / 5; -norm: each row's sum / 7 as well.
    expected = -6 / 5 if mode == "seq-mean-token-sum" else -6 / 7 / 5
    assert out.loss.item() == pytest.approx(expected)
