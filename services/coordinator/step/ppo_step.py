"""One synchronous PPO step over the role servers, phase by phase.

    generate -> (score | ref log-probs | values | old log-probs, in parallel)
             -> advantages -> update critic, update actor (in parallel) -> sync weights

With dynamic sampling (``algorithm.filter_groups``), generate and score repeat over further
batches of prompts until enough groups differ; the other phases then run on what is kept.

Each phase is a small method around one call, timed under verl's name.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
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
from services.coordinator.generation.async_rollout import AsyncRollout
from services.coordinator.generation.multi_turn import multi_turn_rollout
from services.coordinator.generation.rollout_ahead import RolloutAhead
from services.coordinator.generation.rollout_asks import seeds_prompts, wants_rollout_logprobs
from services.coordinator.generation.rollout_memory import RolloutMemory
from services.coordinator.generation.rollout_pool import RolloutPool
from services.coordinator.generation.weight_sync import WeightSyncer
from services.coordinator.metrics.generations import write_generations
from services.coordinator.roles.roles import Roles
from services.coordinator.step.advantage import AdvantageInputs, compute_advantages
from services.coordinator.step.dynamic_sampling import (
    FilterGroupsExhausted,
    filter_values,
    varied_groups,
)
from services.coordinator.step.rollout_batch import RolloutBatch, padded
from services.coordinator.step.scoring import (
    NoGroundTruth,
    RewardFailedEverySample,
    reward_failure_summary,
    reward_model_metrics,
    rule_scorers_only,
)
from services.coordinator.step.timing import PhaseTimer
from services.rollout.types import SamplingParams

log = logging.getLogger(__name__)

GEN_BATCH_SEED_STRIDE = 100_000_007
"""Seed distance between a step's generation batches: past every step number and a
hundred requests' strides (:func:`~services.coordinator.generation.rollout_pool.request_sampling`), so
no two batches of a run share a sampling stream."""


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

    # --- step 1: generate -------------------------------------------------------------
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
    ) -> RolloutBatch:
        """``mixed_versions``: a weight sync may land during the batch (fully async mode)."""
        if self.multi_turn is not None:  # turns with an environment: multi_turn.py
            return self.multi_turn.generate(records, self.sampling_params(step, gen_batch))
        n = self.cfg.actor_rollout_ref.rollout.n
        prompts = Ragged.from_lists([rec.prompt_ids for rec in records])
        sampling = self.sampling_params(step, gen_batch)
        out = self.rollout_pool.generate(prompts, sampling, mixed_versions)
        repeat = [i for i in range(len(records)) for _ in range(n)]
        return RolloutBatch(
            prompts=prompts.select(repeat),
            responses=out.responses,
            rollout_logprobs=out.logprobs,
            finish_reasons=out.finish_reasons,
            group_ids=torch.tensor(repeat, dtype=torch.int64),
            data_sources=[records[i].data_source for i in repeat],
            ground_truths=[records[i].ground_truth for i in repeat],
            extra_infos=[records[i].extra_info for i in repeat],
            weight_version=out.weight_version,
            token_versions=out.token_versions,
            chats=[records[i].chat for i in repeat],
        )

    def generate_async(self, records: list, step: int) -> RolloutBatch:
        """A batch of the fully async producer, meant for ``step`` (its seed)."""
        return self.generate(records, step, mixed_versions=True)

    # --- step 2: score, reference, values, old log-probs (in parallel) ---------------
    def score(self, batch: RolloutBatch) -> None:
        truths = batch.ground_truths
        if truths and rule_scorers_only(self.cfg) and not any(t.strip() for t in truths):
            raise NoGroundTruth(
                f"reward: every one of the {len(truths)} samples of this batch has an empty "
                "ground truth, so the rule scorers would score each 0; the run stops here "
                "rather than train on zeros (data.unscorable_rows refuses or leaves out such "
                "rows at the start)"
            )
        results = self.roles.reward.score(batch.reward_items(self.tokenizer))
        batch.reward_scores = torch.tensor([r.score for r in results], dtype=torch.float32)
        batch.scores = batch.reward_scores.clone()
        if (penalty := self.overlong_penalty(batch.responses.lengths)) is not None:
            batch.scores += penalty
        batch.reward_failed = sum(not r.ok for r in results)
        if summary := reward_failure_summary(results, batch.data_sources):
            if batch.reward_failed == len(results):
                raise RewardFailedEverySample(
                    f"reward: {summary}. No sample of this batch has a reward, so the run "
                    "stops here rather than train on zeros: fix the reward function "
                    "(reward.custom_function) or the reward service, then resume"
                )
            log.warning("reward: %s", summary)
        batch.reward_extra = [r.extra for r in results]
        batch.reward_failures = [r.failure for r in results]

    def overlong_penalty(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """DAPO's soft overlong punishment of responses of ``lengths`` (b,); None when off."""
        buffer = self.cfg.reward.overlong_buffer
        if not buffer.enable:
            return None
        return overlong_penalty(
            lengths, self.cfg.data.max_response_length, buffer.len, buffer.penalty_factor
        )

    def ref_log_probs(self, batch: RolloutBatch) -> None:
        if self.cfg.ref_in_actor:  # LoRA: the actor's base weights, adapters off (no ref server)
            batch.ref_logprobs, _ = self.roles.actor.compute_log_probs(
                batch.prompts, batch.responses, self.temperature, base_model=True
            )
            return
        assert self.roles.ref is not None  # a ref server unless the actor is the ref
        batch.ref_logprobs, _ = self.roles.ref.compute_log_probs(
            batch.prompts, batch.responses, self.temperature
        )

    def values(self, batch: RolloutBatch) -> None:
        assert self.roles.critic is not None  # called only when the run has a critic
        batch.values = self.roles.critic.compute_values(batch.prompts, batch.responses)

    def old_log_probs(self, batch: RolloutBatch) -> None:
        batch.old_logprobs, _ = self.roles.actor.compute_log_probs(
            batch.prompts, batch.responses, self.temperature
        )

    def remax_baseline(self, records: list, batch: RolloutBatch, step: int) -> None:
        """Greedy responses of the same prompts, scored, as the baseline of an estimator that
        needs_greedy_baseline (ReMax)."""
        greedy = dataclasses.replace(
            self.sampling_params(step), temperature=0.0, n=1, logprobs=False
        )  # only scored: its log-probs are used nowhere
        prompts = Ragged.from_lists([rec.prompt_ids for rec in records])
        out = self.rollout_pool.generate(prompts, greedy)
        n = self.cfg.actor_rollout_ref.rollout.n
        repeat = [i for i in range(len(records)) for _ in range(n)]
        greedy_responses = out.responses.select(repeat)
        items = batch.reward_items(self.tokenizer, greedy_responses)
        baseline = torch.tensor([r.score for r in self.roles.reward.score(items)])
        # shaped as the samples' scores are, or a length alone would move the advantage
        if (penalty := self.overlong_penalty(greedy_responses.lengths)) is not None:
            baseline = baseline + penalty
        batch.baseline_scores = baseline

    def generate_varied(
        self, records: list, step: int, timer: PhaseTimer, draw_records: Callable[[int], list]
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """Dynamic sampling: generates and scores batch after batch of prompts
        (``data.gen_batch_size`` each: the step's own, then ``draw_records(1)``,
        ``draw_records(2)``, ...) and keeps the groups whose
        samples differ, until ``data.train_batch_size`` prompts are kept; the first that many
        make the batch. Raises FilterGroupsExhausted past ``max_num_gen_batches``."""
        fg = self.cfg.algorithm.filter_groups
        wanted = self.cfg.data.train_batch_size
        kept: list[RolloutBatch] = []
        have = generated = gen_batches = 0
        while True:
            with timer("gen"):
                batch = self.generate(records, step, gen_batches)
            gen_batches += 1
            with timer("reward"):
                self.score(batch)
            values = filter_values(fg.metric, batch)
            groups = varied_groups(values, batch.group_ids)
            kept.append(batch.select_groups(groups))
            have, generated = have + len(groups), generated + len(records)
            if have >= wanted:
                break
            if 0 < fg.max_num_gen_batches <= gen_batches:
                raise FilterGroupsExhausted(
                    f"step {step}: {have} of the {wanted} prompts a batch needs had samples "
                    f"that differ in {fg.metric} after {gen_batches} generation batches "
                    f"(algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}); "
                    "the data is too easy or too hard for the model: raise the limit, "
                    "change the data, or set algorithm.filter_groups.enable=false"
                )
            log.info(
                "step %d: %d of %d prompts with varied %s after %d generation batches; "
                "generating more",
                step,
                have,
                wanted,
                fg.metric,
                gen_batches,
            )
            records = draw_records(gen_batches)
        merged = RolloutBatch.concat(kept)
        batch = merged.select_groups(list(range(wanted)))
        return batch, {
            "train/num_gen_batches": float(gen_batches),
            "train/kept_prompts_ratio": have / generated,
        }

    def score_and_infer(self, batch: RolloutBatch, timer: PhaseTimer) -> None:
        phases = [] if batch.scores is not None else [("reward", self.score)]  # scored already
        phases.append(("old_log_prob", self.old_log_probs))
        if self.roles.ref is not None or self.cfg.ref_in_actor:
            phases.append(("ref", self.ref_log_probs))
        if self.roles.critic is not None:
            phases.append(("values", self.values))

        def timed(name, fn):
            with timer(name):
                fn(batch)

        for f in [self.pool.submit(timed, name, fn) for name, fn in phases]:
            f.result()

    def write_generations(self, batch: RolloutBatch, step: int) -> None:
        items = batch.reward_items(self.tokenizer, prompt_as_text=True)
        extras = [dict(e) for e in batch.reward_extra] or [{} for _ in items]
        penalty = self.overlong_penalty(batch.responses.lengths)
        if penalty is not None:  # in the score; shown apart, as verl's DAPO manager does
            for extra, value in zip(extras, penalty.tolist(), strict=True):
                extra["overlong_reward"] = value
        failures = batch.reward_failures or None
        assert self.generations is not None and batch.scores is not None  # a scored batch
        write_generations(self.generations, step, items, batch.scores.tolist(), extras, failures)

    # --- step 3: advantages -----------------------------------------------------------
    def advantages(self, batch: RolloutBatch) -> tuple[Ragged, Ragged, dict[str, float]]:
        mask = batch.response_mask()
        width = mask.shape[1]
        # scored, and the actor's log-probs computed, before the advantages
        assert batch.scores is not None and batch.old_logprobs is not None
        out = compute_advantages(
            self.cfg.algorithm,
            AdvantageInputs(
                scores=batch.scores,
                mask=mask,
                group_ids=batch.group_ids,
                values=padded(batch.values, width) if batch.values is not None else None,
                old_logprobs=padded(batch.old_logprobs, width),
                ref_logprobs=padded(batch.ref_logprobs, width)
                if batch.ref_logprobs is not None
                else None,
                baseline_scores=batch.baseline_scores,
                turn_rewards=batch.padded_turn_rewards(width),
            ),
            kl_coef=self.kl_ctrl.value,
        )
        lengths = batch.responses.lengths
        metrics = {
            **masked_stats(out.advantages, mask, "critic/advantages"),
            **masked_stats(out.returns, mask, "critic/returns"),
            **masked_stats(out.token_rewards.sum(-1), torch.ones(len(batch)), "critic/rewards"),
        }
        if batch.values is not None:
            values = padded(batch.values, width)
            metrics.update(masked_stats(values, mask, "critic/values"))
            metrics["critic/vf_explained_var"] = float(
                explained_variance(values, out.returns, mask)
            )
        if self.cfg.algorithm.use_kl_in_reward:
            metrics["actor/reward_kl_penalty"] = out.kl_mean
            metrics["actor/reward_kl_penalty_coeff"] = self.kl_ctrl.value
            self.kl_ctrl.update(out.kl_mean, len(batch))
        return (
            Ragged.from_padded(out.advantages, lengths),
            Ragged.from_padded(out.returns, lengths),
            metrics,
        )

    # --- step 4: updates --------------------------------------------------------------
    def update_critic(self, batch: RolloutBatch, returns: Ragged, step: int) -> dict[str, float]:
        assert self.roles.critic is not None and batch.values is not None  # runs with a critic
        return self.roles.critic.update_value(
            batch.prompts, batch.responses, batch.values, returns, step, batch.loss_mask
        )

    def update_actor(self, batch: RolloutBatch, advantages: Ragged, step: int) -> dict[str, float]:
        use_kl_loss = self.cfg.actor_rollout_ref.actor.use_kl_loss
        assert batch.old_logprobs is not None  # computed before the update
        return self.roles.actor.update_policy(
            batch.prompts,
            batch.responses,
            batch.old_logprobs,
            advantages,
            step,
            ref_logprobs=batch.ref_logprobs if use_kl_loss else None,
            # None on a step that asked the engine for none (NaN from vLLM then)
            rollout_logprobs=(
                batch.rollout_logprobs if wants_rollout_logprobs(self.cfg, step) else None
            ),
            loss_mask=batch.loss_mask,
        )

    def updates(
        self, batch: RolloutBatch, advantages: Ragged, returns: Ragged, step: int, timer: PhaseTimer
    ) -> dict[str, float]:
        def timed(name, fn, *args):
            with timer(name):
                return fn(*args)

        jobs: list[tuple] = []
        if self.roles.critic is not None:
            jobs.append(("update_critic", self.update_critic, batch, returns, step))
        if step > self.cfg.critic.critic_warmup:
            jobs.append(("update_actor", self.update_actor, batch, advantages, step))
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

    # --- the step -----------------------------------------------------------------------
    def run(
        self,
        records: list,
        step: int,
        draw_records: Callable[[int], list] | None = None,
        ahead: RolloutAhead | None = None,
        draw_next: Callable[[], tuple[int, list, dict]] | None = None,
        async_rollout: AsyncRollout | None = None,
    ) -> dict[str, float]:
        """step counts from 1; ``draw_records(i)``: the step's i-th further batch of prompts,
        for dynamic sampling. One step off policy (``ahead``): the step trains on the batch
        generated during the step before, if there is one, and generates the next step's
        (prompts from ``draw_next()``; None: no next step) while it trains. Fully async
        (``async_rollout``): the step takes its batch (and its prompts' records, in place of
        ``records``) from the producer's buffer, which goes on generating meanwhile. Returns
        the step's metrics (verl names)."""
        timer = PhaseTimer()
        sampling_metrics: dict[str, float] = {}
        batch: RolloutBatch | None
        with timer("step"):
            with timer("gen"):  # taking the KV caches back is part of generating, as before
                self.memory.wake()
            if async_rollout is not None:
                taken = async_rollout.take(step)
                batch, records, sampling_metrics = taken.batch, taken.records, taken.metrics
                timer.add("gen", taken.gen_seconds)  # generated alongside the steps before
                sampling_metrics["training/epoch"] = float(taken.epoch)
            elif self.cfg.algorithm.filter_groups.enable:
                if draw_records is None:
                    raise ValueError("dynamic sampling needs draw_records")
                batch, sampling_metrics = self.generate_varied(records, step, timer, draw_records)
            else:
                batch = self.generated_ahead(ahead, step, timer)
                if batch is None:
                    with timer("gen"):
                        batch = self.generate(records, step)
            if advantage_estimator(self.cfg.algorithm.adv_estimator).needs_greedy_baseline:
                with timer("gen_max"):
                    self.remax_baseline(records, batch, step)
            # The next batch, with this step's weights (rollout keeps its KV cache for it).
            # ReMax's baseline above was generated with them too (docs/algorithms.md §31).
            ahead_started = (
                ahead is not None
                and draw_next is not None
                and ahead.start(step + 1, draw_next, self.generate)
            )
            if not ahead_started and async_rollout is None:
                self.memory.sleep()  # the KV cache's memory goes to the trainers till next gen
            self.score_and_infer(batch, timer)
            if self.generations is not None:
                with timer("dump_rollout_generations"):
                    self.write_generations(batch, step)
            with timer("adv"):
                advantages, returns, adv_metrics = self.advantages(batch)
            update_metrics = self.updates(batch, advantages, returns, step, timer)
            if ahead is not None:  # the weights move once the batch ahead is generated
                with timer("gen_wait"):
                    ahead.settle()
            sync_error, sync_metrics = None, {}
            # a replica that went down in the step left the pool: the weights go to the rest
            self.syncer.set_rollouts(self.rollout_pool.clients)
            try:
                sync_metrics = self.sync_weights(step, timer, async_rollout)
            except RoleCallError as err:
                sync_error = err
        metrics = {
            **adv_metrics,
            **update_metrics,
            **sync_metrics,
            **sampling_metrics,
            **self.rollout_pool.metrics(),
            **timer.metrics(),
        }
        metrics.update(self.batch_metrics(batch, timer.seconds["step"], step))
        for warning in skipped_update_warnings(metrics):
            log.warning("step %d: %s", step, warning)
        if sync_error is not None:
            raise WeightSyncFailed(sync_error, metrics) from sync_error
        return metrics

    def sync_weights(
        self, step: int, timer: PhaseTimer, async_rollout: AsyncRollout | None
    ) -> dict[str, float]:
        """The actor's weights to rollout as version ``step``. Fully async, generation goes
        on: with ``rollout.partial_rollout`` the sync runs beside the Generate calls in
        flight (each engine applies it at a token boundary); without, the pool's requests
        are held back and those in flight waited for (``timing_s/gen_drain``) first."""
        if async_rollout is None:
            with timer("sync_weights"):
                return self.syncer.sync(version=step)
        if self.cfg.actor_rollout_ref.rollout.partial_rollout:
            with timer("sync_weights"):
                metrics = self.syncer.sync(version=step)
        else:
            with self.rollout_pool.gate.closed() as drained:
                timer.add("gen_drain", drained)
                with timer("sync_weights"):
                    metrics = self.syncer.sync(version=step)
        async_rollout.weights_synced(step)
        return metrics

    def generated_ahead(
        self, ahead: RolloutAhead | None, step: int, timer: PhaseTimer
    ) -> RolloutBatch | None:
        """The batch generated for ``step`` during the step before, or None. Its generation
        time is ``timing_s/gen`` (spent alongside that step's training); what this step
        waited for it is ``timing_s/gen_wait``."""
        if ahead is None:
            return None
        with timer("gen_wait"):
            generated = ahead.take(step)
        if generated is None:
            return None
        timer.add("gen", generated.seconds)
        return generated.batch

    def batch_metrics(
        self, batch: RolloutBatch, step_seconds: float, step: int
    ) -> dict[str, float]:
        scores = batch.scores
        assert scores is not None  # a scored batch
        resp_len = batch.responses.lengths.float()
        prompt_len = batch.prompts.lengths.float()
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
            "rollout/weight_version": float(batch.weight_version),
            # steps between the weights that generated the batch and the actor's (step k
            # trains from step k-1's): 0, or 1 one step off policy
            "rollout/weight_lag": float(step - 1 - batch.weight_version),
            "reward/failed_samples": float(batch.reward_failed),
            **self.overlong_metrics(batch),
            **reward_model_metrics(batch.reward_extra),
            **batch.rollout_metrics,
        }

    def overlong_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        penalty = self.overlong_penalty(batch.responses.lengths)
        if penalty is None:
            return {}
        return {
            "reward/overlong_reward/mean": float(penalty.mean()),
            "reward/overlong/mean": float((penalty < 0).float().mean()),
        }

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
