"""One PPO step over the role servers, phase by phase, each phase a small method around one
call, timed under verl's name, taking the stages before it and returning its own:

    batch source -> GeneratedBatch
      -> (score | old log-probs | ref log-probs | values, in parallel) -> Scores, Inferred
      -> advantages -> Trajectory
      -> update critic, update actor -> sync weights

Where the batch comes from (generated now, one step ahead, or from an async producer) is the
batch source's affair (``batch_sources.py``); the step's phases are the same in every mode.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from meshrl.algorithms.metrics import explained_variance, masked_stats
from meshrl.algorithms.overlong import overlong_penalty
from meshrl.algorithms.registry import advantage_estimator
from meshrl.config.placement import updates_share_gpu
from meshrl.config.schema import RunConfig
from meshrl.gpus import per_gpu_throughput
from meshrl.ragged import Ragged
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.generation.generated import GeneratedBatch, padded
from services.coordinator.generation.multi_turn import multi_turn_rollout
from services.coordinator.generation.rollout_asks import seeds_prompts, wants_rollout_logprobs
from services.coordinator.generation.rollout_memory import RolloutMemory
from services.coordinator.generation.rollout_pool import RolloutPool
from services.coordinator.generation.weight_sync import WeightSyncer
from services.coordinator.metrics.generations import write_generations
from services.coordinator.roles.roles import Roles
from services.coordinator.step.advantage import AdvantageInputs, compute_advantages
from services.coordinator.step.batch_source import BatchSource
from services.coordinator.step.scoring import (
    NoGroundTruth,
    RewardFailedEverySample,
    reward_failure_summary,
    reward_model_metrics,
    rule_scorers_only,
)
from services.coordinator.step.stages import Inferred, ScoredBatch, Scores, Trajectory
from services.coordinator.step.timing import PhaseTimer
from services.rollout.types import SamplingParams

log = logging.getLogger(__name__)

GEN_BATCH_SEED_STRIDE = 100_000_007
"""Seed distance between a step's generation batches: past every step number and a
hundred requests' strides (:func:`~services.coordinator.generation.rollout_pool.request_sampling`),
so no two batches of a run share a sampling stream."""


class WeightSyncFailed(Exception):
    """Step k's updates are done, but its weights did not reach rollout.

    The step must not run again (the actor and critic would take its updates twice): the
    caller restarts what died, syncs the actor's weights as version k and keeps
    ``metrics``, the step's own.
    """

    def __init__(self, error: RoleCallError, metrics: dict[str, float]):
        super().__init__(str(error))
        self.error = error
        self.metrics = metrics


def skipped_update_warnings(metrics: dict[str, float]) -> list[str]:
    """A line per trainer that skipped optimizer steps for a non-finite gradient norm."""
    out = []
    for role in ("actor", "critic"):
        skipped = int(metrics.get(f"{role}/nonfinite_grad_steps", 0.0))
        if skipped:
            out.append(
                f"the {role} skipped {skipped} optimizer step(s): the gradient norm was not "
                "finite (NaN/inf loss); its weights did not change in them"
            )
    return out


class PPOStep:
    """Runs step k of PPO; holds no state across steps beyond the KL controller it is given."""

    def __init__(
        self,
        cfg: RunConfig,
        roles: Roles,
        tokenizer,
        syncer: WeightSyncer,
        kl_ctrl,
        generations: Path | None = None,
        num_gpus: int = 0,
    ):
        """generations: where each step's samples are written (trainer.rollout_data_dir);
        num_gpus: the run's distinct GPUs (0 on CPU), which perf/throughput divides by."""
        self.cfg = cfg
        self.num_gpus = num_gpus
        self.generations = generations
        self.roles = roles
        self.tokenizer = tokenizer
        self.syncer = syncer
        self.kl_ctrl = kl_ctrl
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="phase")
        self.temperature = cfg.actor_rollout_ref.rollout.temperature or 1.0
        rollout = cfg.actor_rollout_ref.rollout
        # the replicas that generate: those of the run, less any that goes down in a step
        self.rollout_pool = RolloutPool(
            roles.named_rollouts(), rollout.replicas, rollout.prompts_per_request
        )
        self.memory = RolloutMemory.for_run(cfg, self.rollout_pool)
        self.multi_turn = multi_turn_rollout(
            rollout.multi_turn, roles.env, self.rollout_pool.generate, tokenizer
        )

    # --- the step -----------------------------------------------------------------------
    def run(self, records: list, step: int, source: BatchSource) -> dict[str, float]:
        """step counts from 1; ``records``: the prompts the loop drew for it; ``source``:
        where its batch comes from. Returns the step's metrics (verl names)."""
        timer = PhaseTimer()
        with timer("step"):
            with timer("gen"):  # taking the KV caches back is part of generating, as before
                self.memory.wake()
            taken = source.take(step, records, self, timer)
            generated = taken.generated
            baseline = self.greedy_baseline(taken.records, generated, step, timer)
            if not source.start_next(step, self):
                self.memory.sleep()  # the KV cache's memory goes to the trainers till next gen
            scored, inferred = self.score_and_infer(generated, taken.scores, timer)
            self.write_generations(scored, step, timer)
            trajectory = self.advantages(scored, inferred, baseline, timer)
            update_metrics = self.updates(generated, inferred, trajectory, step, timer)
            source.settle(timer)
            sync_error, sync_metrics = None, {}
            # a replica that went down in the step left the pool: the weights go to the rest
            self.syncer.set_rollouts(self.rollout_pool.clients)
            try:
                sync_metrics = source.sync_weights(step, self, timer)
            except RoleCallError as err:
                sync_error = err
        metrics = {
            **trajectory.metrics,
            **update_metrics,
            **sync_metrics,
            **taken.metrics,
            **self.rollout_pool.metrics(),
            **timer.metrics(),
        }
        metrics.update(self.batch_metrics(scored, timer.seconds["step"], step))
        for warning in skipped_update_warnings(metrics):
            log.warning("step %d: %s", step, warning)
        if sync_error is not None:
            raise WeightSyncFailed(sync_error, metrics) from sync_error
        return metrics

    # --- generate -----------------------------------------------------------------------
    def sampling_params(self, step: int, gen_batch: int = 0) -> SamplingParams:
        """gen_batch: the step's generation batch (dynamic sampling takes several), each
        with a seed of its own (when the run seeds its prompts: rollout_asks.py). The
        sampled tokens' log-probs are asked for on the steps that use them."""
        r = self.cfg.actor_rollout_ref.rollout
        seed = self.cfg.trainer.seed * 1_000_003 + step + gen_batch * GEN_BATCH_SEED_STRIDE
        return SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=self.cfg.data.max_response_length,
            n=r.n,
            seed=seed if seeds_prompts(self.cfg) else None,
            logprobs=wants_rollout_logprobs(self.cfg, step),
        )

    def generate(
        self, records: list, step: int, gen_batch: int = 0, mixed_versions: bool = False
    ) -> GeneratedBatch:
        """``mixed_versions``: a weight sync may land during the batch (fully async mode)."""
        sampling = self.sampling_params(step, gen_batch)
        if self.multi_turn is not None:  # turns with an environment: multi_turn.py
            return self.multi_turn.generate(records, sampling)
        prompts = Ragged.from_lists([rec.prompt_ids for rec in records])
        out = self.rollout_pool.generate(prompts, sampling, mixed_versions)
        return GeneratedBatch.of_prompts(records, out, sampling.n)

    def generate_async(self, records: list, step: int) -> GeneratedBatch:
        """A batch of the fully async producer, meant for ``step`` (its seed)."""
        return self.generate(records, step, mixed_versions=True)

    def greedy_baseline(
        self, records: list, generated: GeneratedBatch, step: int, timer: PhaseTimer
    ) -> torch.Tensor | None:
        """(B·n,) scores of greedy responses to the same prompts, the baseline of an
        estimator that needs_greedy_baseline (ReMax); None for the others. Generated with
        the weights that generated the batch (docs/algorithms.md §31)."""
        if not advantage_estimator(self.cfg.algorithm.adv_estimator).needs_greedy_baseline:
            return None
        with timer("gen_max"):
            greedy = dataclasses.replace(
                self.sampling_params(step), temperature=0.0, n=1, logprobs=False
            )  # only scored: its log-probs are used nowhere
            prompts = Ragged.from_lists([rec.prompt_ids for rec in records])
            out = self.rollout_pool.generate(prompts, greedy)
            # each sample's prompt's greedy response (group k is records[k])
            greedy_responses = out.responses.select(generated.group_ids.tolist())
            items = generated.reward_items(self.tokenizer, greedy_responses)
            baseline = torch.tensor([r.score for r in self.roles.reward.score(items)])
            # shaped as the samples' scores are, or a length alone would move the advantage
            if (penalty := self.overlong_penalty(greedy_responses.lengths)) is not None:
                baseline = baseline + penalty
            return baseline

    # --- score, reference, values, old log-probs (in parallel) --------------------------
    def score_and_infer(
        self, generated: GeneratedBatch, scores: Scores | None, timer: PhaseTimer
    ) -> tuple[ScoredBatch, Inferred]:
        """The batch's scores (unless its source scored it) and the role servers' numbers,
        each phase in a thread of its own."""

        def timed(name, fn):
            def call():
                with timer(name):
                    return fn(generated)

            return self.pool.submit(call)

        scoring = timed("reward", self.score) if scores is None else None
        old = timed("old_log_prob", self.old_log_probs)
        has_ref = self.roles.ref is not None or self.cfg.ref_in_actor
        ref = timed("ref", self.ref_log_probs) if has_ref else None
        values = timed("values", self.values) if self.roles.critic is not None else None
        # every phase ends before an error is raised (a recovery may restart the servers),
        # then the first in this order is
        for f in (scoring, old, ref, values):
            if f is not None:
                f.exception()
        if scoring is not None:
            scores = scoring.result()
        assert scores is not None  # scored by the source or above
        inferred = Inferred(
            old_logprobs=old.result(),
            ref_logprobs=ref.result() if ref is not None else None,
            values=values.result() if values is not None else None,
        )
        return ScoredBatch(generated, scores), inferred

    def score(self, generated: GeneratedBatch) -> Scores:
        truths = generated.ground_truths
        if truths and rule_scorers_only(self.cfg) and not any(t.strip() for t in truths):
            raise NoGroundTruth(
                f"reward: every one of the {len(truths)} samples of this batch has an empty "
                "ground truth, so the rule scorers would score each 0; the run stops here "
                "rather than train on zeros (data.unscorable_rows refuses or leaves out such "
                "rows at the start)"
            )
        results = self.roles.reward.score(generated.reward_items(self.tokenizer))
        reward_scores = torch.tensor([r.score for r in results], dtype=torch.float32)
        scores = reward_scores.clone()
        if (penalty := self.overlong_penalty(generated.responses.lengths)) is not None:
            scores += penalty
        failed = sum(not r.ok for r in results)
        if summary := reward_failure_summary(results, generated.data_sources):
            if failed == len(results):
                raise RewardFailedEverySample(
                    f"reward: {summary}. No sample of this batch has a reward, so the run "
                    "stops here rather than train on zeros: fix the reward function "
                    "(reward.custom_function) or the reward service, then resume"
                )
            log.warning("reward: %s", summary)
        return Scores(
            scores=scores,
            reward_scores=reward_scores,
            extra=[r.extra for r in results],
            failures=[r.failure for r in results],
            failed=failed,
        )

    def overlong_penalty(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """DAPO's soft overlong punishment of responses of ``lengths`` (b,); None when off."""
        buffer = self.cfg.reward.overlong_buffer
        if not buffer.enable:
            return None
        return overlong_penalty(
            lengths, self.cfg.data.max_response_length, buffer.len, buffer.penalty_factor
        )

    def ref_log_probs(self, generated: GeneratedBatch) -> Ragged:
        if self.cfg.ref_in_actor:  # LoRA: the actor's base weights, adapters off (no ref server)
            logprobs, _ = self.roles.actor.compute_log_probs(
                generated.prompts, generated.responses, self.temperature, base_model=True
            )
            return logprobs
        assert self.roles.ref is not None  # a ref server unless the actor is the ref
        logprobs, _ = self.roles.ref.compute_log_probs(
            generated.prompts, generated.responses, self.temperature
        )
        return logprobs

    def values(self, generated: GeneratedBatch) -> Ragged:
        assert self.roles.critic is not None  # called only when the run has a critic
        return self.roles.critic.compute_values(generated.prompts, generated.responses)

    def old_log_probs(self, generated: GeneratedBatch) -> Ragged:
        logprobs, _ = self.roles.actor.compute_log_probs(
            generated.prompts, generated.responses, self.temperature
        )
        return logprobs

    def write_generations(self, scored: ScoredBatch, step: int, timer: PhaseTimer) -> None:
        """The step's samples to ``trainer.rollout_data_dir``, when it is set."""
        if self.generations is None:
            return
        with timer("dump_rollout_generations"):
            generated, scores = scored.generated, scored.scores
            items = generated.reward_items(self.tokenizer, prompt_as_text=True)
            extras = [dict(e) for e in scores.extra] or [{} for _ in items]
            penalty = self.overlong_penalty(generated.responses.lengths)
            if penalty is not None:  # in the score; shown apart, as verl's DAPO manager does
                for extra, value in zip(extras, penalty.tolist(), strict=True):
                    extra["overlong_reward"] = value
            failures = scores.failures or None
            write_generations(
                self.generations, step, items, scores.scores.tolist(), extras, failures
            )

    # --- advantages ---------------------------------------------------------------------
    def advantages(
        self,
        scored: ScoredBatch,
        inferred: Inferred,
        baseline: torch.Tensor | None,
        timer: PhaseTimer,
    ) -> Trajectory:
        """``baseline``: the greedy baseline's scores (B·n,), for an estimator that needs it."""
        with timer("adv"):
            generated = scored.generated
            mask = generated.response_mask()
            width = mask.shape[1]
            values = padded(inferred.values, width) if inferred.values is not None else None
            out = compute_advantages(
                self.cfg.algorithm,
                AdvantageInputs(
                    scores=scored.scores.scores,
                    mask=mask,
                    group_ids=generated.group_ids,
                    values=values,
                    old_logprobs=padded(inferred.old_logprobs, width),
                    ref_logprobs=padded(inferred.ref_logprobs, width)
                    if inferred.ref_logprobs is not None
                    else None,
                    baseline_scores=baseline,
                    turn_rewards=generated.padded_turn_rewards(width),
                ),
                kl_coef=self.kl_ctrl.value,
            )
            metrics = {
                **masked_stats(out.advantages, mask, "critic/advantages"),
                **masked_stats(out.returns, mask, "critic/returns"),
                **masked_stats(
                    out.token_rewards.sum(-1), torch.ones(len(generated)), "critic/rewards"
                ),
            }
            if values is not None:
                metrics.update(masked_stats(values, mask, "critic/values"))
                metrics["critic/vf_explained_var"] = float(
                    explained_variance(values, out.returns, mask)
                )
            if self.cfg.algorithm.use_kl_in_reward:
                metrics["actor/reward_kl_penalty"] = out.kl_mean
                metrics["actor/reward_kl_penalty_coeff"] = self.kl_ctrl.value
                self.kl_ctrl.update(out.kl_mean, len(generated))
            lengths = generated.responses.lengths
            return Trajectory(
                Ragged.from_padded(out.advantages, lengths),
                Ragged.from_padded(out.returns, lengths),
                metrics,
            )

    # --- updates ------------------------------------------------------------------------
    def update_critic(
        self, generated: GeneratedBatch, inferred: Inferred, trajectory: Trajectory, step: int
    ) -> dict[str, float]:
        assert self.roles.critic is not None and inferred.values is not None  # with a critic
        return self.roles.critic.update_value(
            generated.prompts,
            generated.responses,
            inferred.values,
            trajectory.returns,
            step,
            generated.loss_mask,
        )

    def update_actor(
        self, generated: GeneratedBatch, inferred: Inferred, trajectory: Trajectory, step: int
    ) -> dict[str, float]:
        use_kl_loss = self.cfg.actor_rollout_ref.actor.use_kl_loss
        return self.roles.actor.update_policy(
            generated.prompts,
            generated.responses,
            inferred.old_logprobs,
            trajectory.advantages,
            step,
            ref_logprobs=inferred.ref_logprobs if use_kl_loss else None,
            # None on a step that asked the engine for none (NaN from vLLM then)
            rollout_logprobs=(
                generated.rollout_logprobs if wants_rollout_logprobs(self.cfg, step) else None
            ),
            loss_mask=generated.loss_mask,
        )

    def updates(
        self,
        generated: GeneratedBatch,
        inferred: Inferred,
        trajectory: Trajectory,
        step: int,
        timer: PhaseTimer,
    ) -> dict[str, float]:
        def timed(name, fn):
            with timer(name):
                return fn(generated, inferred, trajectory, step)

        jobs: list[tuple] = []
        if self.roles.critic is not None:
            jobs.append(("update_critic", self.update_critic))
        if step > self.cfg.critic.critic_warmup:
            jobs.append(("update_actor", self.update_actor))
        one_at_a_time = updates_share_gpu(self.cfg)  # on one GPU their peaks would add up
        futures = []
        for job in jobs:
            futures.append(self.pool.submit(timed, *job))
            if one_at_a_time:
                futures[-1].exception()  # waits for it (an error is raised below)
        metrics: dict[str, float] = {}
        for f in futures:
            metrics.update(f.result())
        return metrics

    # --- the step's figures -------------------------------------------------------------
    def batch_metrics(
        self, scored: ScoredBatch, step_seconds: float, step: int
    ) -> dict[str, float]:
        generated, scores = scored.generated, scored.scores.scores
        resp_len = generated.responses.lengths.float()
        prompt_len = generated.prompts.lengths.float()
        max_resp = self.cfg.data.max_response_length
        total_tokens = float(resp_len.sum() + prompt_len.sum())
        return {
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "response_length/mean": float(resp_len.mean()),
            "response_length/max": float(resp_len.max()),
            "response_length/min": float(resp_len.min()),
            "response_length/clip_ratio": float((resp_len >= max_resp).float().mean()),
            "prompt_length/mean": float(prompt_len.mean()),
            "prompt_length/max": float(prompt_len.max()),
            "prompt_length/min": float(prompt_len.min()),
            "prompt_length/clip_ratio": float(
                (prompt_len >= self.cfg.data.max_prompt_length).float().mean()
            ),
            "perf/total_num_tokens": total_tokens,
            "perf/time_per_step": step_seconds,
            "perf/throughput": per_gpu_throughput(total_tokens, step_seconds, self.num_gpus),
            "rollout/weight_version": float(generated.weight_version),
            # steps between the weights that generated the batch and the actor's (step k
            # trains from step k-1's): 0, or 1 one step off policy
            "rollout/weight_lag": float(step - 1 - generated.weight_version),
            "reward/failed_samples": float(scored.scores.failed),
            **self.overlong_metrics(generated),
            **reward_model_metrics(scored.scores.extra),
            **generated.rollout_metrics,
        }

    def overlong_metrics(self, generated: GeneratedBatch) -> dict[str, float]:
        penalty = self.overlong_penalty(generated.responses.lengths)
        if penalty is None:
            return {}
        return {
            "reward/overlong_reward/mean": float(penalty.mean()),
            "reward/overlong/mean": float((penalty < 0).float().mean()),
        }

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
