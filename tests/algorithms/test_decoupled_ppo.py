"""Decoupled PPO as fully async mode runs it (Hilton et al. 2022, "Batch size-invariance
for policy optimization"; AReaL): PPO's clip against the proximal policy (the actor's old
log-probs, recomputed at train time) times the truncated importance weight behaviour ->
proximal from the log-probs recorded at sampling. Worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algorithms.policy_loss import ppo_policy_loss, truncated_is_weights


def test_the_loss_weighs_each_token_by_its_behaviour_policy_by_hand():
    # One response of 2 tokens, advantage 1 each, clip 0.2, cap 2 (async mode's default).
    #   behaviour (sampled by an older version): p_b = 0.5, 0.2
    #   proximal (the actor before this update): p_prox = 0.5, 0.6
    #   current: p = 0.75, 0.6
    # importance weights min(p_prox / p_b, 2): 1.0, min(3.0, 2) = 2.0
    # ratios p / p_prox: 1.5 (clipped to 1.2: PPO takes max(-1.5, -1.2) = -1.2), 1.0
    # per-token loss: -1.2 * 1.0, -1.0 * 2.0; token-mean: (-1.2 - 2.0) / 2 = -1.6
    behaviour = torch.tensor([[math.log(0.5), math.log(0.2)]])
    proximal = torch.tensor([[math.log(0.5), math.log(0.6)]])
    current = torch.tensor([[math.log(0.75), math.log(0.6)]], requires_grad=True)
    advantages = torch.ones(1, 2)
    mask = torch.ones(1, 2)

    weights = truncated_is_weights(proximal, behaviour, mask, cap=2.0)
    assert weights[0].tolist() == pytest.approx([1.0, 2.0])
    out = ppo_policy_loss(current, proximal, advantages, mask, is_weights=weights)
    assert out.loss.item() == pytest.approx(-1.6)
    assert out.clipfrac.item() == pytest.approx(0.5)  # the first token's clip was taken

    # gradient: the clipped token none; the other -A * r * w / 2 = -1 * 1.0 * 2.0 / 2 = -1
    out.loss.backward()
    assert current.grad[0].tolist() == pytest.approx([0.0, -1.0])


def test_fresh_samples_are_plain_ppo():
    # behaviour == proximal (a sample of the actor's own version, same kernels): weights 1
    proximal = torch.tensor([[-0.7, -1.2, -0.1]])
    current = torch.tensor([[-0.6, -1.3, -0.1]])
    advantages = torch.tensor([[0.5, -1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = truncated_is_weights(proximal, proximal, mask, cap=2.0)
    assert weights[0].tolist() == pytest.approx([1.0, 1.0, 0.0])
    weighted = ppo_policy_loss(current, proximal, advantages, mask, is_weights=weights)
    plain = ppo_policy_loss(current, proximal, advantages, mask)
    assert weighted.loss.item() == pytest.approx(plain.loss.item())
