"""DAPO's dynamic sampling (verl's ``algorithm.filter_groups``), as pure functions.

A prompt whose n samples all got the same value (all right, or all wrong) gives every
group-relative estimator a zero advantage: its samples cost a whole update and teach
nothing, and as the model improves more and more groups go that way. The step drops them and
generates from further batches of prompts until ``data.train_batch_size`` prompts with
varied groups remain (:class:`~services.coordinator.step.batch_sources.SynchronousBatches`).
"""

from __future__ import annotations

import torch

from services.coordinator.step.stages import Scores
from services.reward.types import sample_acc


class FilterGroupsExhausted(RuntimeError):
    """A step took ``max_num_gen_batches`` generation batches without enough varied groups."""


def filter_values(metric: str, scores: Scores) -> torch.Tensor:
    """The per-sample value whose spread decides, (N,) float, with verl's meanings:

    - "acc": the reward's ``acc`` extra (a score >= 1 where the scorer gives none);
    - "score": the reward service's score, before the coordinator's overlong penalty;
    - "seq_reward": the score with the overlong penalty, before any KL penalty;
    - "seq_final_reward": the sequence's final reward, what the advantage is computed from:
      the same as "seq_reward", since a run that filters keeps the KL penalty out of the
      reward (preflight refuses the two together).
    """
    if metric == "acc":
        pairs = zip(scores.reward_scores.tolist(), scores.extra, strict=True)
        return torch.tensor([sample_acc(s, e) for s, e in pairs], dtype=torch.float32)
    if metric == "score":
        return scores.reward_scores.float()
    if metric in ("seq_reward", "seq_final_reward"):
        return scores.scores.float()
    raise ValueError(f"unknown filter_groups metric {metric!r}")


def varied_groups(values: torch.Tensor, group_ids: torch.Tensor) -> list[int]:
    """The groups worth training on, in order of first appearance: those whose values
    differ, and those of one sample (as verl keeps them: there is nothing to compare).

    values (N,) float; group_ids (N,) int64, the prompt of each sample.
    """
    kept = []
    for g in dict.fromkeys(group_ids.tolist()):  # first-appearance order
        v = values[group_ids == g]
        if v.numel() == 1 or bool(v.max() != v.min()):
            kept.append(g)
    return kept
