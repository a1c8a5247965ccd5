"""What a PPO step asks of the rollout engine besides its sampling settings: the sampled
tokens' log-probs, only on the steps that use them, and a seed per prompt, only when the
run asks for reproducible sampling (``actor_rollout_ref.rollout.calculate_log_probs``,
``probs_diff_freq``, ``seed_per_prompt``; docs/rollout.md, "vLLM: settings and speed").

The native and fast engines compute log-probs with every sample and seed for free, so
their defaults keep both on every step; vLLM pays for each (a log-softmax over the
vocabulary and a gather per token; a generator per request), so its defaults ask for them
only where a consumer needs them.
"""

from __future__ import annotations

from meshrl.config import RunConfig

VLLM_PROBS_DIFF_FREQ = 10
"""``probs_diff_freq`` unset with rollout.name=vllm: the drift metric every 10th step."""


def probs_diff_freq(cfg: RunConfig) -> int:
    """Steps between two readings of ``training/rollout_probs_diff_*`` (0: never)."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.probs_diff_freq is not None:
        return rollout.probs_diff_freq
    return VLLM_PROBS_DIFF_FREQ if rollout.name == "vllm" else 1


def wants_rollout_logprobs(cfg: RunConfig, step: int) -> bool:
    """Whether step ``step`` (from 1) uses the rollout log-probs: every step when
    ``calculate_log_probs`` says so or a truncated-IS / decoupled-PPO cap weighs tokens by
    them; else on steps 1, k + 1, 2k + 1, ... for the drift metric (k: probs_diff_freq)."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.calculate_log_probs is not None:
        return rollout.calculate_log_probs
    if cfg.actor_rollout_ref.actor.tis_imp_ratio_cap > 0:
        return True
    k = probs_diff_freq(cfg)
    return k > 0 and (step - 1) % k == 0


def seeds_prompts(cfg: RunConfig) -> bool:
    """Whether generation requests carry a seed (spread over their prompts by the engine)."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.seed_per_prompt is not None:
        return rollout.seed_per_prompt
    return rollout.name != "vllm"
