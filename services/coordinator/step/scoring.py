"""The reward phase's judgements of what the reward service returned: a batch it could not
score at all stops the run; failed samples are summarised in one line."""

from __future__ import annotations

from meshrl.config.schema import RunConfig


class RewardFailedEverySample(RuntimeError):
    """No sample of a training batch could be scored: the run stops rather than train on
    rewards that are all 0 (almost always a reward function that fails on every input)."""


class NoGroundTruth(RewardFailedEverySample):
    """Every sample of a training batch has an empty ground truth while the rule scorers
    alone score it: each would score 0, a step of zeros rather than of rewards."""


def rule_scorers_only(cfg: RunConfig) -> bool:
    """Whether the rule scorers alone score the run's samples (they need a ground truth)."""
    return not cfg.reward.custom_function and not cfg.reward.reward_model.enable


def reward_failure_summary(results: list, data_sources: list[str]) -> str | None:
    """One line on the samples the reward service could not score (a scorer that raised, hung,
    returned a non-number, or killed its worker), or None when every sample was scored."""
    failed = [(ds, r.reason) for ds, r in zip(data_sources, results, strict=True) if not r.ok]
    if not failed:
        return None
    ds, reason = failed[0]
    return (
        f"{len(failed)} of {len(results)} samples could not be scored and count as 0 "
        f"(first: a {ds!r} sample: {reason})"
    )


def reward_model_metrics(extras: list[dict[str, float]]) -> dict[str, float]:
    """``reward/rm_clip_ratio``: the fraction of the samples the reward model scored whose
    (prompt, response) pair it cut to ``reward.reward_model.max_length`` (the reward
    service's ``rm_cut`` extra); nothing without a reward model."""
    cut = [extra["rm_cut"] for extra in extras if "rm_cut" in extra]
    return {"reward/rm_clip_ratio": sum(cut) / len(cut)} if cut else {}
