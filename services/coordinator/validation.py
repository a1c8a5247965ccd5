"""Validation: greedy (or `val_kwargs`) generation over the validation set, scored per
data_source, reported with verl's names: `val-core/<data_source>/acc/mean@n` (the core
variable is the accuracy where the scorer reports one, as every rule scorer does) and
`val-aux/<data_source>/reward/mean@n`; a reward model alone reports no accuracy, and its
reward is the core variable (`val-core/<data_source>/reward/mean@n`), as is the reward of
GSM8k and MATH, which verl's own scorers score without an accuracy
(`val-core/openai/gsm8k/reward/mean@1`). With
`val_kwargs.n` > 1 also best@k, worst@k and maj@k
(:mod:`services.coordinator.validation_metrics`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from meshrl.config.schema import RunConfig
from meshrl.ragged import Ragged
from services.coordinator.generations import (
    GenerationRow,
    generations_dir,
    pick_shown,
    write_generations,
)
from services.coordinator.metrics_sinks import MetricsSink, log_generations
from services.coordinator.ppo_step import reward_failure_summary
from services.coordinator.rollout_batch import RolloutBatch
from services.coordinator.rollout_memory import RolloutMemory
from services.coordinator.rollout_pool import RolloutPool
from services.coordinator.validation_metrics import SampleResult, validation_metrics
from services.reward.client import RewardClient
from services.reward.scorers.registry import VERL_SCORES_WITHOUT_ACC
from services.reward.types import ScoreItem, ScoreOutcome
from services.rollout.types import SamplingParams

log = logging.getLogger(__name__)


def validation_sampling(cfg: RunConfig) -> SamplingParams:
    v = cfg.actor_rollout_ref.rollout.val_kwargs
    return SamplingParams(
        temperature=v.temperature if v.do_sample else 0.0,
        top_p=v.top_p,
        top_k=v.top_k,
        n=v.n,
        max_tokens=cfg.data.max_response_length,
        seed=cfg.trainer.seed,
    )


def validate(
    cfg: RunConfig,
    records: list,
    rollouts: RolloutPool,
    reward: RewardClient,
    tokenizer,
    generations: Path | None = None,
    step: int = 0,
    shown: list[GenerationRow] | None = None,
) -> dict[str, float]:
    """The metrics of one validation at ``step``; its samples are written to
    ``generations/<step>.jsonl`` when given (trainer.validation_data_dir), and appended to
    ``shown`` as (input, output, score) rows when given (trainer.log_val_generations)."""
    sampling = validation_sampling(cfg)
    n = sampling.n
    size = cfg.data.val_batch_size or len(records)
    samples: list[SampleResult] = []
    written: list[tuple[ScoreItem, ScoreOutcome]] = []  # for validation_data_dir
    for start in range(0, len(records), size):
        chunk = records[start : start + size]
        prompts = Ragged.from_lists([r.prompt_ids for r in chunk])
        out = rollouts.generate(prompts, sampling)
        repeat = [i for i in range(len(chunk)) for _ in range(n)]
        batch = RolloutBatch(
            prompts=prompts.select(repeat),
            responses=out.responses,
            rollout_logprobs=out.logprobs,
            finish_reasons=out.finish_reasons,
            group_ids=torch.tensor(repeat),
            data_sources=[chunk[i].data_source for i in repeat],
            ground_truths=[chunk[i].ground_truth for i in repeat],
            extra_infos=[chunk[i].extra_info for i in repeat],
            weight_version=out.weight_version,
            chats=[chunk[i].chat for i in repeat],
        )
        items = batch.reward_items(tokenizer)
        results = reward.score(items)
        if generations is not None or shown is not None:  # the prompt as the policy read it
            items = batch.reward_items(tokenizer, prompt_as_text=True)
        if generations is not None:
            written += zip(items, results, strict=True)
        if shown is not None:
            shown += [
                GenerationRow(it.prompt, it.response, r.score)
                for it, r in zip(items, results, strict=True)
            ]
        if summary := reward_failure_summary(results, batch.data_sources):
            log.warning("validation reward: %s", summary)
        for i, ds, result in zip(repeat, batch.data_sources, results, strict=True):
            values = {"reward": result.score}
            if (acc := result.reported_acc) is not None:
                values["acc"] = acc
            samples.append(SampleResult(ds, start + i, values, result.pred))
    if generations is not None:
        items, results = [w[0] for w in written], [w[1] for w in written]
        scores, extras = [r.score for r in results], [r.extra for r in results]
        write_generations(generations, step, items, scores, extras, [r.failure for r in results])
    return validation_metrics(samples, seed=cfg.trainer.seed, reward_is_core=reward_core(cfg))


def reward_core(cfg: RunConfig) -> frozenset[str]:
    """The data_sources whose reward is filed as core beside the accuracy, as verl files it
    (its own scorer of them reports no acc): none with a custom function, which replaces
    the rule scorers and may report an acc of its own."""
    return frozenset() if cfg.reward.custom_function else VERL_SCORES_WITHOUT_ACC


class RunValidation:
    """A run's validation at a step: the whole validation set, after rollout's caches are
    woken, timed (``timing_s/testing``), its samples written to
    ``trainer.validation_data_dir`` and ``trainer.log_val_generations`` of them shown to the
    metrics sinks."""

    def __init__(
        self,
        cfg: RunConfig,
        records: Sequence,
        tokenizer,
        run_dir: Path,
        sinks: list[MetricsSink],
    ):
        self.cfg = cfg
        self.records = list(records)
        self.tokenizer = tokenizer
        self.generations = generations_dir(cfg.trainer.validation_data_dir, run_dir)
        self.sinks = sinks

    def __call__(
        self,
        step: int,
        rollouts: RolloutPool,
        reward: RewardClient,
        memory: RolloutMemory,
    ) -> dict[str, float]:
        start = time.perf_counter()
        memory.wake()  # validation generates: the caches come back first
        shown_count = self.cfg.trainer.log_val_generations
        shown: list[GenerationRow] | None = [] if shown_count else None
        metrics = validate(
            self.cfg,
            self.records,
            rollouts,
            reward,
            self.tokenizer,
            self.generations,
            step,
            shown,
        )
        if shown:
            log_generations(self.sinks, step, pick_shown(shown, shown_count, self.cfg.trainer.seed))
        return {**metrics, "timing_s/testing": time.perf_counter() - start}
