"""Per-token KL estimators between the policy and the reference model, and the
controllers of the KL-in-reward coefficient.

With ``x ~ pi`` and ``log r = log pi_ref(x) - log pi(x)``, Schulman's estimators of
``KL(pi || pi_ref)`` (http://joschu.net/blog/kl-approx.html) are::

    k1 = -log r                      "kl", "k1"   unbiased, high variance, can be < 0
    k2 = 0.5 * (log r) ** 2          "mse", "k2"  biased, low variance, >= 0
    k3 = r - 1 - log r               "low_var_kl", "k3"  unbiased, low variance, >= 0
    |log r|                          "abs"

Straight-through variants (suffix ``+``, verl's ``kl_penalty``): the *value* of the
named estimator with the *gradient* of ``k2``. k1 and k3 are unbiased for the value
of KL but their expected gradient is not the gradient of KL when used as a loss;
k2's gradient is (its expectation equals the gradient of KL at ``pi``). So ``"k3+"``
logs a faithful KL and trains on a correct gradient.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

__all__ = [
    "KL_ESTIMATORS",
    "KL_CONTROLLER_TYPES",
    "KL_ESTIMATOR_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "kl_penalty",
    "make_kl_controller",
]

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# Every accepted ``kind``: the estimators and their straight-through "+" variants.
KL_ESTIMATOR_KINDS = KL_ESTIMATORS + tuple(f"{k}+" for k in KL_ESTIMATORS)

KL_CONTROLLER_TYPES = ("fixed", "adaptive")


def _k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def _abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return (logprobs - ref_logprobs).abs()


def _k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs).square()


def _k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    # As verl: clamp log r to [-20, 20] before exp so exp stays finite (exp(20) ~ 5e8),
    # then clamp the estimate to [-10, 10] so that one token on which the policy and
    # the reference disagree wildly cannot dominate the batch.
    log_r = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (log_r.exp() - log_r - 1.0).clamp(-10.0, 10.0)


_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "kl": _k1,
    "k1": _k1,
    "abs": _abs,
    "mse": _k2,
    "k2": _k2,
    "low_var_kl": _k3,
    "k3": _k3,
}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Elementwise KL estimate between the policy and the reference model.

    Args:
        logprobs: ``(b, t)`` log pi(token) of the sampled tokens (the policy).
        ref_logprobs: ``(b, t)`` log pi_ref(token) of the same tokens.
        kind: one of :data:`KL_ESTIMATOR_KINDS` (see the module docstring).

    Returns:
        ``(b, t)`` estimate, *unmasked*: reduce it with a mask (``aggregate_loss`` or
        ``masked_mean``). For ``"<est>+"`` the forward value is ``<est>`` and the
        gradient is that of ``k2``: ``est.detach() + (k2 - k2.detach())``.

    Raises:
        ValueError: unknown ``kind``.

    Reference: verl ``core_algos.kl_penalty``; Schulman 2020 (blog above).
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    if base not in _ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATOR_KINDS}")
    value = _ESTIMATORS[base](logprobs, ref_logprobs)
    if not straight_through or _ESTIMATORS[base] is _k2:
        return value
    k2 = _k2(logprobs, ref_logprobs)
    # k2 - k2.detach() is exactly 0 in the forward pass but carries k2's gradient.
    return value.detach() + (k2 - k2.detach())


class FixedKLController:
    """Constant KL-in-reward coefficient ``beta`` (``algorithm.kl_ctrl.type=fixed``).

    Attributes:
        value: the current coefficient.
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """No-op; present so callers can treat both controllers alike."""
        del current_kl, n_steps

    def state_dict(self) -> dict:
        """Checkpointable state."""
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (the checkpointed value wins over config)."""
        _check_type(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019, "Fine-Tuning Language Models
    from Human Preferences", sec. 2.2 (``algorithm.kl_ctrl.type=adaptive``).

    After each batch::

        e = clip(KL / target_kl - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    so ``beta`` rises while the measured KL exceeds the target and falls below it,
    by at most a factor ``1 +- 0.2 * n_steps / horizon`` per update.

    Attributes:
        value: the current coefficient ``beta``.
        target: ``target_kl``.
        horizon: the number of samples over which the error is integrated.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl ({target_kl}) and horizon ({horizon}) must be > 0")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """Move ``value`` toward the target KL.

        Args:
            current_kl: the measured KL of the batch (``actor/reward_kl_penalty``).
            n_steps: samples in the batch (verl passes the batch size).
        """
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        """Checkpointable state (``value``; target and horizon come from config)."""
        return {"type": "adaptive", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        _check_type(state, "adaptive")
        self.value = float(state["value"])


def _check_type(state: dict, expected: str) -> None:
    # A fixed checkpoint loaded into an adaptive run (or vice versa) is a config error.
    found = state.get("type", expected)
    if found != expected:
        raise ValueError(f"KL controller state is for {found!r}, not {expected!r}")


def make_kl_controller(
    kind: str, kl_coef: float = 0.001, target_kl: float = 0.1, horizon: float = 10000
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by ``algorithm.kl_ctrl.type``.

    Args:
        kind: ``"fixed"`` or ``"adaptive"``.
        kl_coef: initial (or constant) coefficient, ``algorithm.kl_ctrl.kl_coef``.
        target_kl: ``algorithm.kl_ctrl.target_kl`` (adaptive only).
        horizon: ``algorithm.kl_ctrl.horizon`` (adaptive only).

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; expected one of {KL_CONTROLLER_TYPES}")
