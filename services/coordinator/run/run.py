"""A PPO run: the loop of PPO steps with validation, checkpoints and metrics over the role
servers a launcher (local, docker, Ray) started. Its parts, one concern each:

- :class:`~services.coordinator.roles.role_servers.RoleServers`: connecting to and initializing
  the role servers (set-up);
- :class:`~services.coordinator.recovery.run_progress.RunProgress`: step, data position, KL
  coefficient, shared by the parts;
- :class:`~services.coordinator.recovery.run_checkpoints.RunCheckpoints`: resume, save, rewind target;
- :class:`~services.coordinator.recovery.recovery.Recovery`: bounded restarts of dead role servers;
- :class:`~services.coordinator.run.validation.RunValidation`: validation at a step;
- :class:`~services.coordinator.step.ppo_step.PPOStep`: one step (generate, score, update, sync).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from meshrl.config import RunConfig
from meshrl.data.dataset import PromptDataset
from meshrl.launcher.endpoints import Endpoints
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.generation.async_rollout import AsyncRollout
from services.coordinator.generation.generated import GeneratedBatch
from services.coordinator.generation.rollout_ahead import RolloutAhead
from services.coordinator.generation.weight_sync import WeightSyncer
from services.coordinator.metrics.generations import generations_dir
from services.coordinator.metrics.plot import plot_metrics
from services.coordinator.metrics.sinks import ConsoleSink, MetricsSink, close_sinks, file_sinks
from services.coordinator.recovery.checkpointing import CheckpointError
from services.coordinator.recovery.pool_membership import PoolMembership
from services.coordinator.recovery.recovery import Recovery, Restarter
from services.coordinator.recovery.run_checkpoints import RunCheckpoints
from services.coordinator.recovery.run_progress import RunProgress, new_kl_controller
from services.coordinator.roles.role_servers import RoleServers
from services.coordinator.run.preflight import check_data_sources, check_filter_metric
from services.coordinator.run.run_data import RunData, load_run_data
from services.coordinator.run.validation import RunValidation
from services.coordinator.step.batch_sources import (
    BatchSource,
    FullyAsyncBatches,
    OneStepOffBatches,
    SynchronousBatches,
)
from services.coordinator.step.ppo_step import PPOStep, WeightSyncFailed
from services.coordinator.types import ended_exit_code

log = logging.getLogger(__name__)


def run_sinks(cfg: RunConfig, run_dir: Path) -> list[MetricsSink]:
    """The metrics sinks of ``trainer.logger`` for a run in this process: the console line
    (through tqdm, under its progress bar) and the file sinks. Opened before the role
    servers start (``run_local``): a logger that cannot start ends the run at once."""
    sinks: list[MetricsSink] = []
    if "console" in cfg.trainer.logger:
        sinks.append(ConsoleSink(write=tqdm.write))
    return sinks + file_sinks(cfg, run_dir)


class PPORun:
    """Drives one run end to end; `stop()` from another thread ends it after the current step."""

    def __init__(
        self,
        cfg: RunConfig,
        endpoints: Endpoints,
        run_dir: Path,
        sinks: list[MetricsSink] | None = None,
        on_step: Callable | None = None,
        restarter: Restarter | None = None,
    ):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.on_step = on_step
        self._stop = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="run")
        self.sinks = sinks if sinks is not None else run_sinks(cfg, self.run_dir)
        self.servers = RoleServers(cfg, endpoints, self.run_dir, self.pool)
        self.progress = RunProgress(kl_ctrl=new_kl_controller(cfg))
        # trainer.one_step_off_policy: the next step's prompts, generated while a step trains
        self.ahead = RolloutAhead(self._stop.is_set) if cfg.trainer.one_step_off_policy else None
        # trainer.async_training: rollout generating continuously into a bounded buffer
        asynchronous = cfg.trainer.async_training
        self.async_rollout = (
            AsyncRollout(asynchronous, cfg.data.train_batch_size) if asynchronous.enable else None
        )
        drawn_ahead = self.async_rollout or self.ahead
        self.batch_source = self.make_batch_source()
        self.checkpoints = RunCheckpoints(
            cfg, self.run_dir, self.servers, self.progress, self.pool, drawn_ahead
        )
        self.recovery = Recovery(
            cfg, restarter, self.servers, self.checkpoints, self.resync, drawn_ahead
        )
        # The rollout replicas: those that went down rejoin, those asked for join or leave
        self.membership = PoolMembership(cfg, self.servers, restarter, self.resync)
        # Dynamic sampling's further prompt batches of the current step, drawn once: a step
        # that is retried after a restart generates from the same prompts again.
        self.further_records: list[list] = []
        self.validated_only = False  # trainer.val_only: whether its one validation was done
        # Known once set up (setup(): the data, the tokenizer, the weights in sync).
        self.total_steps: int | None = None
        self.tokenizer: object = None
        self.train_set: PromptDataset | None = None
        self.val_set: PromptDataset | None = None
        self.validation: RunValidation | None = None
        self.syncer: WeightSyncer | None = None
        self.step_runner: PPOStep | None = None

    # --- set-up -----------------------------------------------------------------------
    def setup(self, data: RunData | None = None) -> None:
        """Initializes the roles and resumes. ``data``: the run's prompts, read before the
        servers started (:func:`load_run_data`, which runs here without them)."""
        data = data or load_run_data(self.cfg, self.run_dir)
        self.tokenizer = data.tokenizer
        self.train_set, self.val_set = data.train_set, data.val_set
        self.progress.loader = data.loader
        self.total_steps = data.total_steps
        self.validation = (
            RunValidation(self.cfg, self.val_set.records, self.tokenizer, self.run_dir, self.sinks)
            if self.val_set is not None
            else None
        )
        self.servers.initialize()
        scorers = self.servers.roles.reward.list_scorers()
        check_data_sources(self.data_sources(), scorers)
        check_filter_metric(self.cfg, self.data_sources(), scorers)
        self.checkpoints.resume()
        self.resync(self.progress.step)

    def data_sources(self) -> dict[str, list[str]]:
        """Config key -> the data_source of each prompt (what the reward server must score)."""
        sets = {"data.train_files": self.train_set, "data.val_files": self.val_set}
        return {k: [r.data_source for r in ds.records] for k, ds in sets.items() if ds is not None}

    def resync(self, version: int) -> None:
        """(Re)builds the syncer and the step runner around the current clients, then makes
        rollout serve exactly the actor's weights, labelled ``version`` (from the start, a
        resume or a recovery)."""
        for old in (self.step_runner, self.syncer):
            if old is not None:
                old.close()
        roles = self.servers.roles
        self.syncer = WeightSyncer(self.cfg, roles.actor, roles.rollouts)
        self.syncer.sync(version=version)
        self.step_runner = PPOStep(
            self.cfg,
            roles,
            self.tokenizer,
            self.syncer,
            self.progress.kl_ctrl,
            generations_dir(self.cfg.trainer.rollout_data_dir, self.run_dir),
            num_gpus=self.servers.num_gpus,
        )

    # --- one step, its prompts, and its recovery ---------------------------------------
    def run_step(self, records: list) -> dict[str, float] | None:
        """One PPO step, with bounded restarts of dead role servers. Returns None when the
        run went back to its last checkpoint instead (the loop then continues from there)."""
        step = self.progress.step
        while True:
            assert self.step_runner is not None  # set up
            try:
                return self.step_runner.run(records, step, self.batch_source)
            except WeightSyncFailed as failed:  # the updates are done: never run them twice
                self.recovery.count_failure(
                    step, failed.error, f"step {step}: updated, but its weight sync failed"
                )
                self.batch_source.before_recovery()
                with self.batch_source.held():
                    went_back = self.recovery.recover(failed.error, updated=True)
                self.batch_source.after_recovery(synced=None if went_back else step)
                if went_back:
                    return None
                return failed.metrics  # rollout now serves this step's weights
            except RoleCallError as err:
                self.recovery.count_failure(step, err, f"step {step} failed")  # may end the run
                self.batch_source.before_recovery()
                with self.batch_source.held():
                    went_back = self.recovery.recover(err)
                self.batch_source.after_recovery()
                if went_back:
                    return None

    def make_batch_source(self) -> BatchSource:
        """Where each step's batch comes from, by the run's mode."""
        if self.async_rollout is not None:
            partial = self.cfg.actor_rollout_ref.rollout.partial_rollout
            return FullyAsyncBatches(self.async_rollout, partial, self.start_async_rollout)
        if self.ahead is not None:
            return OneStepOffBatches(self.ahead, self.next_step_prompts)
        fg, batch_size = self.cfg.algorithm.filter_groups, self.cfg.data.train_batch_size
        return SynchronousBatches(fg, batch_size, self.draw_records)

    def next_step_prompts(self) -> Callable[[], tuple[int, list, dict]] | None:
        """One step off policy: how the step draws the next step's prompts to generate
        while it trains; None when there is no next step (the last, or a stop asked for)."""
        if self.ahead is None or self.progress.step >= self.steps or self._stop.is_set():
            return None
        return self.drawing_ahead()

    def start_async_rollout(self) -> None:
        """Fully async: the producer, if it is not running (the start, a rewind), generates
        for the steps after the current one, from the loader's position."""
        producer = self.async_rollout
        if producer is None or producer.running:
            return

        def generate(records: list, step: int) -> GeneratedBatch:
            assert self.step_runner is not None  # set up; rebuilt by a resync: the current
            return self.step_runner.generate_async(records, step)

        producer.start(self.progress.step, self.steps, self.drawing_ahead(), generate)

    def drawing_ahead(self) -> Callable[[], tuple[int, list, dict]]:
        """How prompts are drawn ahead of their step: (epoch, records, the loader's state
        from before them), so that a checkpoint of an earlier step draws them again."""
        loader = self.progress.loader
        assert loader is not None  # a training run

        def draw() -> tuple[int, list, dict]:
            before = loader.state_dict()
            epoch, records = loader.next_batch()
            return epoch, records, before

        return draw

    def draw_records(self, i: int) -> list:
        """The current step's i-th further batch of prompts (i from 1), for dynamic sampling:
        taken from the loader the first time it is asked for, so the loader's saved state
        covers it and a retried step reuses it."""
        loader = self.progress.loader
        assert loader is not None  # a training run
        while len(self.further_records) < i:
            self.further_records.append(loader.next_batch()[1])
        return self.further_records[i - 1]

    # --- validation ---------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        assert self.validation is not None and self.step_runner is not None
        runner = self.step_runner
        reward = self.servers.roles.reward
        metrics = self.validation(
            self.progress.step, runner.rollout_pool, reward, runner.memory, runner.multi_turn
        )
        runner.rollout_pool.metrics()  # validation's generations: not the next step's figures
        return metrics

    def validate_or_recover(self) -> dict[str, float] | None:
        """Validation with bounded restarts of dead role servers, as a step has: rollout and
        reward die mid-validation too. None when the run went back to its last checkpoint."""
        while True:
            try:
                return self.validate()
            except RoleCallError as err:
                step = self.progress.step
                self.recovery.count_failure(step, err, f"validation at step {step} failed")
                # The actor holds step progress.step's weights: its updates are done.
                if self.recovery.recover(err, updated=True):
                    return None

    def validate_only(self) -> dict[str, float]:
        """trainer.val_only: one validation of the starting weights, logged; retried after a
        recovery that went back to the checkpoint (the same weights again)."""
        metrics = None
        while metrics is None and not self._stop.is_set():
            metrics = self.validate_or_recover()  # None: went back to the checkpoint
        if metrics is None:  # stopped first: nothing validated, nothing to report
            return {}
        self.log(self.progress.step, metrics)
        self.progress.last_metrics = metrics
        self.validated_only = True
        return metrics

    # --- the loop -----------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """The run's total number of PPO steps (known once set up)."""
        assert self.total_steps is not None  # set up
        return self.total_steps

    @property
    def finished(self) -> bool:
        """Whether the run did all it was asked: every step, or its one validation."""
        if self.cfg.trainer.val_only:
            return self.validated_only
        return self.progress.step >= self.steps

    def validation_due(self, last: bool) -> bool:
        freq = self.cfg.trainer.test_freq
        return self.validation is not None and freq > 0 and (self.progress.step % freq == 0 or last)

    def train(self) -> dict[str, float]:
        cfg = self.cfg.trainer
        progress = self.progress
        if cfg.val_only:
            return self.validate_only()
        if cfg.val_before_train and self.validation is not None:
            before = self.validate_or_recover()
            if before is not None:
                self.log(progress.step, before)
        bar = tqdm(
            total=self.steps,
            initial=progress.step,
            desc="PPO",
            unit="step",
            dynamic_ncols=True,
            disable=None,  # no bar when the output is no terminal: no \r lines in a log file
        )

        def went_back() -> None:  # to the last checkpoint after a crash
            bar.reset(total=self.steps)
            bar.update(progress.step)

        saved_step = None
        try:
            while progress.step < self.steps and not self._stop.is_set():
                self.change_pool()
                assert progress.loader is not None  # total_steps is 0 without one
                epoch, records = self.batch_source.prompts(progress.step + 1, progress.loader)
                self.further_records = []
                progress.step += 1
                progress.epoch = epoch
                metrics = self.run_step(records)
                if metrics is None:
                    went_back()
                    continue
                metrics["training/global_step"] = float(progress.step)
                metrics.setdefault("training/epoch", float(epoch))  # async: of its batch
                last = progress.step == self.steps
                if self.validation_due(last):
                    val = self.validate_or_recover()
                    if val is None:
                        went_back()
                        continue
                    metrics.update(val)
                if self.checkpoints.due(last):
                    with_timer = time.perf_counter()
                    if not self.save_or_recover():
                        went_back()
                        continue
                    saved_step = progress.step
                    metrics["timing_s/save_checkpoint"] = time.perf_counter() - with_timer
                progress.last_metrics = metrics
                self.log(progress.step, metrics)
                bar.update(1)
                bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}")
        finally:
            bar.close()
        stopped_early = self._stop.is_set() and 0 < progress.step < self.steps
        if stopped_early and saved_step != progress.step:  # not twice for one step
            log.info("stopped at step %d; saving a checkpoint to resume from", progress.step)
            self.save_or_recover()  # went back instead: the checkpoint it went to resumes it
        return progress.last_metrics

    def save_or_recover(self) -> bool:
        """Saves the checkpoint of the step just completed. A trainer server that dies inside
        its SaveCheckpoint is restarted as in a step, and the run goes back to its last
        checkpoint: False then (the step is run again). A save that fails otherwise (a full
        disk, a server's own write error) ends the run as before."""
        step = self.progress.step
        while True:
            try:
                self.checkpoints.save()
                return True
            except CheckpointError as failed:
                err = failed.__cause__
                if not isinstance(err, RoleCallError) or not self.recovery.lost_a_server():
                    raise
                self.recovery.count_failure(step, err, f"checkpoint of step {step} failed")
                self.batch_source.before_recovery()  # as a failed step's
                with self.batch_source.held():
                    went_back = self.recovery.recover(err, updated=True)
                self.batch_source.after_recovery()
                if went_back:
                    return False

    def change_pool(self) -> None:
        """At a step boundary: rollout replicas that went down in the step before are
        restarted and rejoin, those asked for join or leave, each joiner proving it holds
        the current weights (:mod:`services.coordinator.recovery.pool_membership`)."""
        runner = self.step_runner
        departed = runner.rollout_pool.take_departed() if runner is not None else []
        if not (departed or self.membership.has_changes()):
            return
        with self.batch_source.held():  # the pool is rebuilt: no generation runs across it
            self.membership.apply(departed, self.progress.step)
        # a batch whose generation failed for want of replicas is made again on the new pool
        self.batch_source.after_recovery()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)
        if self.on_step is not None:
            self.on_step(step, metrics)

    def stop(self) -> None:
        self._stop.set()

    def close(self, error: BaseException | None = None) -> None:
        """Closes the sinks, plots, ends the run's threads. ``error``: what ended the run,
        None when it returned: the sinks record it (a wandb run of a failed or stopped run
        is not marked finished)."""
        # A run whose setup raised never learnt its total_steps: it did not finish.
        finished = error is None and self.total_steps is not None and self.finished
        close_sinks(self.sinks, ended_exit_code(error, finished))
        if self.cfg.trainer.plot and (self.run_dir / "metrics.jsonl").exists():
            try:
                plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.png")
            except Exception as e:  # noqa: BLE001 - a plot never fails a finished run
                log.warning("could not plot metrics: %s", e)
        for closer in (self.step_runner, self.syncer):
            if closer is not None:
                closer.close()
        self.batch_source.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
