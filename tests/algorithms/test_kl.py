"""KL estimators, straight-through variants and KL-coefficient controllers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algorithms.kl import (
    KL_ESTIMATOR_KINDS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
    make_kl_controller,
)

# logp - ref = [0.5, -1.0]; log r = ref - logp = [-0.5, 1.0]
LOGP = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
REF = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
K3 = [math.exp(-0.5) + 0.5 - 1.0, math.exp(1.0) - 1.0 - 1.0]  # e^{log r} - log r - 1
EXPECTED = {
    "kl": [0.5, -1.0],
    "k1": [0.5, -1.0],
    "abs": [0.5, 1.0],
    "mse": [0.125, 0.5],  # 0.5 * 0.25, 0.5 * 1
    "k2": [0.125, 0.5],
    "low_var_kl": K3,  # [0.10653..., 0.71828...]
    "k3": K3,
}


@pytest.mark.parametrize("kind", KL_ESTIMATORS)
def test_hand_computed(kind):
    torch.testing.assert_close(
        kl_penalty(LOGP, REF, kind), torch.tensor([EXPECTED[kind]], dtype=torch.float64)
    )


def test_k3_is_clamped():
    # log r = ref - logp: -30 clamps to -20 -> e^-20 + 20 - 1 = 19.0... -> clamped to 10;
    # +30 clamps to 20 -> e^20 - 21 ~ 4.85e8 -> clamped to 10
    logp = torch.tensor([[0.0, -30.0]])
    ref = torch.tensor([[-30.0, 0.0]])
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), torch.tensor([[10.0, 10.0]]))


def test_unknown_kind_lists_the_known_ones():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGP, REF, "full")
    with pytest.raises(ValueError, match="k3\\+"):
        kl_penalty(LOGP, REF, "k4+")
    assert set(KL_ESTIMATOR_KINDS) == set(KL_ESTIMATORS) | {k + "+" for k in KL_ESTIMATORS}


log_probs = st.lists(st.floats(-25.0, 0.0), min_size=1, max_size=8)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(KL_ESTIMATORS), log_probs, st.data())
def test_straight_through_has_estimator_value_and_k2_gradient(kind, logp_list, data):
    ref_list = data.draw(
        st.lists(st.floats(-25.0, 0.0), min_size=len(logp_list), max_size=len(logp_list))
    )
    logp = torch.tensor([logp_list], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([ref_list], dtype=torch.float64, requires_grad=True)

    value = kl_penalty(logp, ref, kind + "+")
    torch.testing.assert_close(value, kl_penalty(logp, ref, kind))  # forward = estimator
    value.sum().backward()
    # d k2 / d logp = logp - ref ; d k2 / d ref = ref - logp
    torch.testing.assert_close(logp.grad, (logp - ref).detach())
    torch.testing.assert_close(ref.grad, (ref - logp).detach())


def test_plain_k3_gradient_is_not_k2_gradient():
    # d k3 / d logp = 1 - e^{log r}: at logp - ref = 0.5 -> 1 - e^-0.5 = 0.3935, not 0.5
    logp = LOGP.clone().requires_grad_(True)
    kl_penalty(logp, REF, "k3").sum().backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[1 - math.exp(-0.5), 1 - math.exp(1.0)]], dtype=torch.float64)
    )


def test_fixed_controller():
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=10.0, n_steps=100)
    assert ctrl.value == 0.05
    clone = FixedKLController(1.0)
    clone.load_state_dict(ctrl.state_dict())
    assert clone.value == 0.05


def test_adaptive_controller_hand_computed():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    # KL 2.0: error = clip(2/1 - 1, -0.2, 0.2) = 0.2 -> beta *= 1 + 0.2 * 10 / 100 = 1.02
    ctrl.update(current_kl=2.0, n_steps=10)
    assert ctrl.value == pytest.approx(0.102)
    # KL 1.1: error 0.1 -> beta *= 1.01
    ctrl.update(current_kl=torch.tensor(1.1), n_steps=10)
    assert ctrl.value == pytest.approx(0.102 * 1.01)
    # KL 0.5: error clip(-0.5) = -0.2 -> beta *= 0.98
    ctrl.update(current_kl=0.5, n_steps=10)
    assert ctrl.value == pytest.approx(0.102 * 1.01 * 0.98)


def test_adaptive_controller_checkpoint_round_trip():
    ctrl = AdaptiveKLController(0.1, 1.0, 100)
    ctrl.update(2.0, 10)
    restored = AdaptiveKLController(0.1, 1.0, 100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    with pytest.raises(ValueError, match="fixed"):
        restored.load_state_dict(FixedKLController(0.1).state_dict())


@settings(max_examples=50, deadline=None)
@given(
    beta=st.floats(1e-4, 1.0),
    target=st.floats(1e-3, 10.0),
    kl=st.floats(0.0, 100.0),
    horizon=st.integers(1, 10_000),
    frac=st.floats(0.0, 1.0),
)
def test_adaptive_controller_direction_and_bound(beta, target, kl, horizon, frac):
    n_steps = int(frac * horizon)
    ctrl = AdaptiveKLController(beta, target, horizon)
    ctrl.update(kl, n_steps)
    factor = ctrl.value / beta
    bound = 0.2 * n_steps / horizon
    assert 1 - bound - 1e-12 <= factor <= 1 + bound + 1e-12
    if kl > target * (1 + 1e-9):
        assert factor >= 1.0
    if kl < target * (1 - 1e-9):
        assert factor <= 1.0
    if n_steps > 0 and kl > target * (1 + 1e-6):
        assert factor > 1.0
    if n_steps > 0 and kl < target * (1 - 1e-6):
        assert factor < 1.0


def test_make_kl_controller():
    assert isinstance(make_kl_controller("fixed", 0.001, 0.1, 10000), FixedKLController)
    adaptive = make_kl_controller("adaptive", kl_coef=0.2, target_kl=0.1, horizon=500)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.2, 0.1, 500)
    with pytest.raises(ValueError, match="adaptive"):
        make_kl_controller("pid")


def test_k3_gradient_is_finite_far_from_the_reference():
    # log r = log pi_ref - log pi = 100: k3 is clamped at 10 and has no gradient there; the
    # inner clamp of log r at 20 keeps exp(log r) finite, else inf * 0 would make it NaN.
    logp = torch.tensor([-100.0, 0.0], requires_grad=True)
    ref = torch.tensor([0.0, -100.0])
    value = kl_penalty(logp, ref, "low_var_kl")
    assert value.tolist() == [10.0, 10.0]
    value.sum().backward()
    assert logp.grad.tolist() == [0.0, 0.0]


def test_make_kl_controller_defaults():
    # verl's algorithm.kl_ctrl defaults: kl_coef 0.001, target_kl 0.1, horizon 10000.
    assert make_kl_controller("fixed").value == 0.001
    adaptive = make_kl_controller("adaptive")
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.001, 0.1, 10000.0)


@pytest.mark.parametrize("target, horizon", [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (1.0, -1.0)])
def test_adaptive_controller_needs_a_positive_target_and_horizon(target, horizon):
    with pytest.raises(
        ValueError, match=rf"target_kl \({target}\) and horizon \({horizon}\) must be > 0"
    ):
        make_kl_controller("adaptive", 0.1, target, horizon)


def test_controller_state_names_its_type_and_a_state_without_one_loads():
    adaptive = make_kl_controller("adaptive", 0.5)
    assert adaptive.state_dict() == {"type": "adaptive", "value": 0.5}
    assert make_kl_controller("fixed", 0.5).state_dict() == {"type": "fixed", "value": 0.5}
    adaptive.load_state_dict({"value": 0.25})  # older checkpoints had no type
    assert adaptive.value == 0.25
    with pytest.raises(ValueError, match="'fixed', not 'adaptive'"):
        adaptive.load_state_dict({"type": "fixed", "value": 0.25})
