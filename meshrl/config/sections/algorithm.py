"""``algorithm``: the advantage estimator, the KL penalty in the reward, dynamic sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshrl.algorithms.registry import ESTIMATORS, describe
from meshrl.config.sections.base import EstimatorName, KLEstimator, Section


class KLCtrlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: β stays kl_coef; adaptive: β is updated after each step from the batch's KL
    (Ziegler et al. 2019) and saved with checkpoints."""
    kl_coef: float = Field(0.001, ge=0)
    """β (initial β when adaptive)."""
    target_kl: float = Field(0.1, gt=0)
    """Adaptive: KL the controller steers towards."""
    horizon: int = Field(10000, gt=0)
    """Adaptive: responses over which β moves by at most 20%."""


class FilterGroupsConfig(Section):
    """DAPO's dynamic sampling: drop the prompts whose n samples all got the same value of
    ``metric`` (all right, or all wrong: a group-relative advantage of zero), and generate
    from further batches of prompts until ``data.train_batch_size`` prompts remain."""

    enable: bool = False
    """Turn dynamic sampling on; needs rollout.n ≥ 2 and an estimator other than remax
    (both refused at start)."""
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"
    """The per-sample value whose spread within a group decides, as in verl: the reward's
    ``acc``; ``score``, the reward service's score; ``seq_reward``, that score with the
    overlong penalty (reward.overlong_buffer) added, before any KL penalty;
    ``seq_final_reward``, the reward the advantage is computed from: seq_reward, as the KL
    penalty is not in the reward (with algorithm.use_kl_in_reward it is refused at start:
    the groups are picked before the reference log-probs exist)."""
    max_num_gen_batches: int = Field(10, ge=0)
    """Generation batches a step may take before the run fails, naming the shortfall
    (0 = no limit: a data set the model has fully solved would then loop for ever)."""


class AlgorithmConfig(Section):
    adv_estimator: EstimatorName = Field(
        "gae",
        description="Advantage estimator, by its entry in meshrl/algorithms/registry.py "
        "(docs/algorithms.md has each, docs/extending.md adds one): " + describe(ESTIMATORS),
    )
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per response token, of gae and reinforce_plus_plus."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE's λ (gae only): 1 = Monte Carlo returns minus the value, 0 = one-step TD."""
    norm_adv_by_std_in_grpo: bool = True
    """False = Dr. GRPO (mean-only baseline)."""
    use_kl_in_reward: bool = False
    """Subtract β·KL from the token rewards."""
    kl_penalty: KLEstimator = "kl"
    """KL estimator in the reward: kl, abs, mse, low_var_kl."""
    kl_ctrl: KLCtrlConfig = Field(default_factory=KLCtrlConfig)
    """β of the KL penalty in the reward (`use_kl_in_reward`); the KL loss has its own
    (actor.kl_loss_coef)."""
    whiten_advantages: bool = True
    """Whiten GAE advantages over the batch."""
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (docs/algorithms.md §25)."""
