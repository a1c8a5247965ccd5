"""CISPO's policy loss (meshrl/algorithms/cispo.py), numbers worked out by hand, and its
registry entry reaching the config, the settings and the start-up warning."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from meshrl.algorithms.cispo import cispo_policy_loss
from meshrl.algorithms.loss_modes import PolicyLossInputs, PolicyLossSettings
from meshrl.algorithms.policy_loss import ppo_policy_loss
from meshrl.algorithms.registry import policy_loss
from meshrl.config import build_config
from services.coordinator.run.preflight import check_run_config

# One response of 3 tokens, pi_old = e^-1 on each:
#   t0: log r =  0    r = 1                  A = +1
#   t1: log r = +0.5  r = e^0.5  = 1.6487    A = +1   (above 1 + 0.2: PPO clips it away)
#   t2: log r = -0.5  r = e^-0.5 = 0.6065    A = -1   (below 1 - 0.2)
LOGPROBS = [-1.0, -0.5, -1.5]
OLD = [-1.0, -1.0, -1.0]
ADV = [1.0, 1.0, -1.0]


def _inputs():
    logprobs = torch.tensor([LOGPROBS], requires_grad=True)
    return logprobs, torch.tensor([OLD]), torch.tensor([ADV]), torch.ones(1, 3)


def test_the_weight_is_clipped_and_detached_by_hand():
    # w = clip(r, 0.8, 1.2) = (1, 1.2, 0.8); pg = -w A log pi:
    #   t0: -1   *  1 * -1   =  1.0
    #   t1: -1.2 *  1 * -0.5 =  0.6
    #   t2: -0.8 * -1 * -1.5 = -1.2        token-mean: 0.4 / 3
    # gradient -w A / 3 on each log pi: (-1, -1.2, 0.8) / 3
    logprobs, old, adv, mask = _inputs()
    out = cispo_policy_loss(logprobs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert out.loss.item() == pytest.approx(0.4 / 3, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -1.2, 0.8]]) / 3)
    assert out.clipfrac.item() == pytest.approx(2 / 3)  # t1 and t2
    assert out.clipfrac_lower.item() == pytest.approx(1 / 3)  # t2
    assert out.approx_kl.item() == pytest.approx(0.0, abs=1e-7)  # mean of (0, -0.5, 0.5)


def test_a_token_ppo_clips_away_keeps_its_gradient():
    # t1 (A > 0, r = 1.65 past 1.2): PPO's gradient there is 0; CISPO's -1.2 / 3.
    logprobs, old, adv, mask = _inputs()
    ppo_policy_loss(logprobs, old, adv, mask, clip_ratio_c=None).loss.backward()
    assert logprobs.grad[0, 1].item() == 0.0
    logprobs, old, adv, mask = _inputs()
    out = cispo_policy_loss(logprobs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    out.loss.backward()
    assert logprobs.grad[0, 1].item() == pytest.approx(-0.4)


def test_at_ratio_one_its_gradient_is_ppos():
    # r = 1 everywhere: both are -A / N on each log pi (PPO's d(-A r)/d log pi = -A r).
    grads = []
    for loss in (ppo_policy_loss, cispo_policy_loss):
        logprobs = torch.tensor([LOGPROBS], requires_grad=True)
        old = logprobs.detach().clone()
        adv = torch.tensor([ADV])
        out = loss(logprobs, old, adv, torch.ones(1, 3), clip_ratio_low=0.2, clip_ratio_high=0.2)
        out.loss.backward()
        grads.append(logprobs.grad)
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[1], -torch.tensor([ADV]) / 3)


def test_padding_garbage_never_reaches_the_loss_or_the_gradient():
    logprobs = torch.tensor([[-1.0, -0.5, math.nan]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, math.inf]])
    adv = torch.tensor([[1.0, 1.0, math.nan]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = cispo_policy_loss(logprobs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert out.loss.item() == pytest.approx((1.0 + 0.6) / 2)  # t0 and t1 above
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -0.6, 0.0]]))


def test_micro_batches_with_the_mini_batchs_counts_sum_to_it_and_is_weights_multiply():
    # Two responses (the one above and its copy), weights 0.5 on the copy's tokens: each
    # response's token-sum counted once per response (seq-mean-token-sum, N_seq = 2).
    #   response 0: 0.4;  response 1: 0.5 * 0.4 = 0.2;  loss (0.4 + 0.2) / 2 = 0.3
    logprobs = torch.tensor([LOGPROBS, LOGPROBS])
    old, adv, mask = torch.tensor([OLD, OLD]), torch.tensor([ADV, ADV]), torch.ones(2, 3)
    weights = torch.tensor([[1.0] * 3, [0.5] * 3])
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="seq-mean-token-sum")
    whole = cispo_policy_loss(logprobs, old, adv, mask, is_weights=weights, **kwargs).loss
    assert whole.item() == pytest.approx(0.3)
    parts = sum(
        cispo_policy_loss(
            logprobs[[i]], old[[i]], adv[[i]], mask[[i]], is_weights=weights[[i]],
            global_seq_count=2, **kwargs,
        ).loss
        for i in (0, 1)
    )  # fmt: skip
    assert parts.item() == pytest.approx(whole.item())


def test_the_config_names_it_and_its_clip_keys_reach_it():
    # loss_mode=cispo with the paper's bounds: clip_ratio_low 1 (no lower bound), high 0.28.
    #   w = (1, 1.28, 0.6065): pg = (1, 0.64, -0.6065 * 1.5 = -0.9098), token-mean /3
    cfg = build_config(
        {},
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=cispo",
            "actor_rollout_ref.actor.clip_ratio_low=1.0",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
        ],
    )
    settings = PolicyLossSettings.from_config(cfg)
    entry = policy_loss(settings.loss_mode)
    assert entry.name == "cispo" and not entry.draws and not entry.needs_behaviour_logprobs
    logprobs, old, adv, mask = _inputs()
    out = entry.load()(PolicyLossInputs(logprobs, old, adv, mask.bool(), None, 3, 1), settings)
    expected = (1.0 + 0.64 - 1.5 * math.exp(-0.5)) / 3
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.clipfrac.item() == pytest.approx(1 / 3)  # t1 alone
    assert out.clipfrac_lower.item() == 0.0


def test_the_start_warns_when_its_bounds_are_left_to_clip_ratio(caplog):
    key = "actor_rollout_ref.actor.policy_loss.loss_mode=cispo"
    with caplog.at_level(logging.WARNING, logger="services.coordinator.run.preflight"):
        check_run_config(build_config({}, [key]))
    assert "loss_mode=cispo clips each token's importance weight" in caplog.text
    assert "here 0.2 / 0.2" in caplog.text and "MiniMax-M1 sets no lower bound" in caplog.text
