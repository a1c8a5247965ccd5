"""A PPO run: connect to the role servers, initialize them, then loop PPO steps with
validation and metrics. The launcher (local, docker, Ray) only provides the addresses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from meshrl.algorithms.kl import make_kl_controller
from meshrl.config import ConfigError, RunConfig, config_to_yaml
from meshrl.gpus import count_gpus
from meshrl.launcher.endpoints import Endpoints
from meshrl.model_files import copy_model_files
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.checkpointing import (
    CheckpointError,
    CheckpointManager,
    CoordinatorState,
)
from services.coordinator.generations import GenerationRow, generations_dir, pick_shown
from services.coordinator.metrics_sinks import (
    ConsoleSink,
    MetricsSink,
    close_sinks,
    file_sinks,
    log_generations,
)
from services.coordinator.plot import plot_metrics
from services.coordinator.ppo_step import PPOStep, Roles, WeightSyncFailed
from services.coordinator.preflight import check_data_sources, check_filter_metric
from services.coordinator.recovery import STATEFUL_ROLES, Restarter, find_dead, recovery_plan
from services.coordinator.rollout_ahead import RolloutAhead
from services.coordinator.run_data import RunData, load_run_data, named_resume_folder
from services.coordinator.types import ended_exit_code
from services.coordinator.validation import validate
from services.coordinator.weight_sync import WeightSyncer
from services.reward.client import RewardClient
from services.rollout.client import RolloutClient
from services.trainer.client import TrainerClient

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """What changes as the run goes; never written back into the config."""

    step: int = 0
    epoch: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)


def connect(cfg: RunConfig, endpoints: Endpoints) -> Roles:
    t = cfg.trainer.rpc_timeout_s
    return Roles(
        rollouts=[RolloutClient(a, t) for a in endpoints.rollout],
        actor=TrainerClient(endpoints.actor, t, "actor"),
        reward=RewardClient(endpoints.reward, t),
        critic=TrainerClient(endpoints.critic, t, "critic") if endpoints.critic else None,
        ref=TrainerClient(endpoints.ref, t, "ref") if endpoints.ref else None,
    )


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
        self.endpoints = endpoints
        self.restarter = restarter  # None: a dead role server ends the run
        self.roles = connect(cfg, endpoints)
        self.state = RunState()
        self.resumed_from: Path | None = None  # the checkpoint this run started from, if any
        self.last_saved: Path | None = None  # the checkpoint this run wrote last, if any
        # Recoveries per step number, kept across rewinds: a crash that recurs each time the
        # run gets back to a step ends the run after launcher.max_restarts, not never.
        self.step_failures: Counter[int] = Counter()
        # Dynamic sampling's further prompt batches of the current step, drawn once: a step
        # that is retried after a restart generates from the same prompts again.
        self.further_records: list[list] = []
        self.validated_only = False  # trainer.val_only: whether its one validation was done
        # Launcher name -> the GPUs its server computes on (ServerInfo.gpus at Initialize):
        # perf/throughput is per distinct GPU of the run, as verl's is.
        self.role_gpus: dict[str, list[str]] = {}
        self.on_step = on_step
        self._stop = threading.Event()
        # trainer.one_step_off_policy: the next step's prompts, generated while a step trains
        self.ahead = RolloutAhead(self._stop.is_set) if cfg.trainer.one_step_off_policy else None
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="run")
        self.sinks = sinks if sinks is not None else run_sinks(cfg, self.run_dir)

    # --- set-up -----------------------------------------------------------------------
    def setup(self, data: RunData | None = None) -> None:
        """Initializes the roles and resumes. ``data``: the run's prompts, read before the
        servers started (:func:`load_run_data`, which runs here without them)."""
        cfg = self.cfg
        data = data or load_run_data(cfg, self.run_dir)
        self.tokenizer = data.tokenizer
        self.train_set, self.val_set, self.loader = data.train_set, data.val_set, data.loader
        self.total_steps = data.total_steps
        self.initialize_roles()
        scorers = self.roles.reward.list_scorers()
        check_data_sources(self.data_sources(), scorers)
        check_filter_metric(cfg, self.data_sources(), scorers)
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.checkpoints = CheckpointManager(self.run_dir, cfg.trainer.max_ckpt_to_keep)
        self.resume()
        self.start_weight_sync()

    def data_sources(self) -> dict[str, list[str]]:
        """Config key -> the data_source of each prompt (what the reward server must score)."""
        sets = {"data.train_files": self.train_set, "data.val_files": self.val_set}
        return {k: [r.data_source for r in ds.records] for k, ds in sets.items() if ds is not None}

    def start_weight_sync(self, version: int | None = None) -> None:
        """(Re)builds the syncer and the step runner around the current clients, then makes
        rollout serve exactly the actor's weights (from the start, a resume or a recovery).
        `version`: the label of those weights; None = state.step, the last step completed."""
        for old in (getattr(self, "step_runner", None), getattr(self, "syncer", None)):
            if old is not None:
                old.close()
        self.syncer = WeightSyncer(self.cfg, self.roles.actor, self.roles.rollouts)
        self.syncer.sync(version=self.state.step if version is None else version)
        self.step_runner = PPOStep(
            self.cfg,
            self.roles,
            self.tokenizer,
            self.syncer,
            self.kl_ctrl,
            generations_dir(self.cfg.trainer.rollout_data_dir, self.run_dir),
            num_gpus=count_gpus(self.role_gpus.values()),
        )

    def named_clients(self) -> dict[str, RolloutClient | TrainerClient | RewardClient]:
        """Launcher names (rollout0, actor, critic, ref, reward) -> clients."""
        named: dict[str, RolloutClient | TrainerClient | RewardClient] = {
            f"rollout{i}": c for i, c in enumerate(self.roles.rollouts)
        }
        named.update(actor=self.roles.actor, reward=self.roles.reward)
        named.update(
            {k: c for k, c in (("critic", self.roles.critic), ("ref", self.roles.ref)) if c}
        )
        return named

    def initialize_roles(self, names: list[str] | None = None) -> None:
        """Initialize the named roles (default: all) concurrently with the resolved config."""
        text = config_to_yaml(self.cfg)
        clients = {n: c for n, c in self.named_clients().items() if names is None or n in names}
        futures = {
            n: self.pool.submit(c.initialize, text, str(self.run_dir)) for n, c in clients.items()
        }
        for name, f in futures.items():
            try:
                self.role_gpus[name] = list(f.result().gpus)
            except RoleCallError as err:
                if names is not None or err.code_name != "INVALID_ARGUMENT":
                    raise
                # At the start, a server that refuses the run's config (a model folder it
                # cannot read on its machine, a value it cannot serve) says the request is
                # wrong (exit 2, a service's run REJECTED), not that the run failed. A
                # restarted server (``names``) that refuses what its first start took
                # points at the server, not the request: that stays a failure.
                raise ConfigError(f"{err} (the role server refused this run's config)") from err
        if names is None and (gpus := count_gpus(self.role_gpus.values())):
            log.info("the role servers compute on %d GPU(s); perf/throughput is per GPU", gpus)

    # --- recovery from a dead role server ----------------------------------------------
    def run_step(self, records: list) -> dict[str, float] | None:
        """One PPO step, with bounded restarts of dead role servers. Returns None when the
        run went back to its last checkpoint instead (the loop then continues from there)."""
        step = self.state.step
        while True:
            try:
                return self.step_runner.run(
                    records,
                    step,
                    self.draw_records,
                    ahead=self.ahead,
                    draw_next=self.next_step_prompts(),
                )
            except WeightSyncFailed as failed:  # the updates are done: never run them twice
                self.count_failure(
                    step, failed.error, f"step {step}: updated, but its weight sync failed"
                )
                self.drop_ahead()  # made by a server that may be restarted now: made again
                if self.recover(failed.error, updated=True):
                    return None
                return failed.metrics  # rollout now serves this step's weights
            except RoleCallError as err:
                self.count_failure(step, err, f"step {step} failed")  # raises: the run ends
                self.drop_ahead()
                if self.recover(err):
                    return None

    def next_step_prompts(self) -> Callable[[], tuple[int, list, dict]] | None:
        """One step off policy: how the step draws the next step's prompts to generate
        while it trains; None when there is no next step (the last, or a stop asked for)."""
        if self.ahead is None or self.state.step >= self.total_steps or self._stop.is_set():
            return None

        def draw() -> tuple[int, list, dict]:
            assert self.loader is not None  # a training run
            before = self.loader.state_dict()
            epoch, records = self.loader.next_batch()
            return epoch, records, before

        return draw

    def drop_ahead(self) -> None:
        """A failed step that is recovered from: its generation ahead ends before any server
        is restarted or re-synced, and is made again (the prompts drawn for it are kept)."""
        if self.ahead is not None:
            self.ahead.drop()

    def draw_records(self, i: int) -> list:
        """The current step's i-th further batch of prompts (i from 1), for dynamic sampling:
        taken from the loader the first time it is asked for, so the loader's saved state
        covers it and a retried step reuses it."""
        assert self.loader is not None  # a training run
        while len(self.further_records) < i:
            self.further_records.append(self.loader.next_batch()[1])
        return self.further_records[i - 1]

    def count_failure(self, step: int, err: RoleCallError, what: str) -> None:
        """Counts a failure of ``step`` (its validation included) and logs it as ``what``;
        re-raises ``err`` when there is no restarter or the restarts are spent."""
        self.step_failures[step] += 1
        limit = self.cfg.launcher.max_restarts
        if self.restarter is None:
            raise err
        if self.step_failures[step] > limit:
            folder = self.rewind_folder()
            if folder is None:
                resume = "it has no checkpoint yet (trainer.save_freq)"
            else:  # auto looks in this run's folder only, not where resume_mode=<path> took it
                mode = "auto" if folder.parent == self.checkpoints.root else str(folder)
                resume = f"its last checkpoint, {folder}, resumes it: run it again with "
                resume += f"trainer.resume_mode={mode}"
            log.error(
                "%s (%s); launcher.max_restarts=%d recoveries of this step are spent, so the "
                "run ends; %s", what, err, limit, resume,
            )  # fmt: skip
            raise err
        attempt = self.step_failures[step]
        log.warning("%s (%s); recovering (attempt %d of %d)", what, err, attempt, limit)

    def recover(self, err: RoleCallError, updated: bool = False) -> bool:
        """Restarts dead role servers; True when the run went back to a checkpoint.
        ``updated``: the failed step's updates were done (only its weight sync failed)."""
        assert self.restarter is not None  # count_failure re-raised the error without one
        addresses = {n: c.address for n, c in self.named_clients().items()}
        dead = find_dead(self.restarter, addresses)
        if not dead:
            raise err  # the call failed but every server lives: not a crash to recover from
        log.warning("role servers down: %s; %s", ", ".join(dead), recovery_plan(self.restarter))
        for name in dead:
            addresses[name] = self.restarter.restart(name)  # a new port if the old one was taken
        self.endpoints = Endpoints.from_addresses(addresses)
        self.roles = connect(self.cfg, self.endpoints)  # fresh channels to the new processes
        self.initialize_roles(dead)
        rewind = any(name in STATEFUL_ROLES for name in dead)
        if rewind:
            self.rewind()
        # The actor holds the weights of step state.step when its updates were done or after
        # a rewind (to the checkpoint's step); otherwise those of the step before, as the
        # failed step will be retried.
        self.start_weight_sync(self.state.step if rewind or updated else self.state.step - 1)
        return rewind

    def rewind(self) -> None:
        """Training state was lost: every trainer and the coordinator go back to the last
        checkpoint, or to the very start (re-initialized from the model) without one."""
        if self.ahead is not None:  # its prompts belong to the history left behind
            self.ahead.forget()
        folder = self.rewind_folder()
        if folder is None:
            log.warning("no checkpoint yet: restarting the run from step 0")
            self.initialize_roles([n for n in STATEFUL_ROLES if n in self.named_clients()])
            if self.loader is not None:  # None in an evaluation (trainer.val_only)
                self.loader.load_state_dict(
                    {"epoch": 0, "batch_in_epoch": 0, "seed": self.cfg.data.seed}
                )
            kl = self.cfg.algorithm.kl_ctrl
            self.kl_ctrl = make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
            self.state.step = 0
            return
        self.load_checkpoint(folder)

    def rewind_folder(self) -> Path | None:
        """The checkpoint this run saved last, else the one it resumed from (which
        `resume_mode=<path>` may take from another run's folder). Not simply the folder's
        newest: after resuming from an older step, a newer one left there by the abandoned
        history is not this run's past."""
        for folder in (self.last_saved, self.resumed_from):
            if folder is not None and folder.is_dir():  # not pruned since
                return folder
        return None

    # --- checkpoints ------------------------------------------------------------------
    def resume_folder(self) -> Path | None:
        if self.cfg.trainer.resume_mode == "auto":
            return self.checkpoints.latest_valid()
        return named_resume_folder(self.cfg)

    def resume(self) -> None:
        folder = self.resume_folder()
        if folder is not None:
            try:
                self.load_checkpoint(folder)
            except RoleCallError as e:
                if e.code_name != "INVALID_ARGUMENT":
                    raise
                # A checkpoint of another model (width, layers, LoRA): the request is wrong
                # (exit 2), and the way out is another folder or not resuming.
                mode = self.cfg.trainer.resume_mode
                elsewhere = (
                    "use another trainer.default_local_dir"
                    if mode == "auto"
                    else "name another checkpoint in trainer.resume_mode"
                )
                raise ConfigError(
                    f"trainer.resume_mode={mode}: {e}. To train this model afresh, {elsewhere} "
                    "or set trainer.resume_mode=disable"
                ) from None
            self.resumed_from = folder
        if not self.cfg.trainer.val_only:  # an evaluation writes no history: nothing moves
            self.checkpoints.set_aside_after(self.state.step)

    def load_checkpoint(self, folder: Path) -> None:
        saved = self.checkpoints.load_state(folder)
        trainers = [("actor", self.roles.actor), ("critic", self.roles.critic)]
        for name, client in trainers:
            if client is not None:
                if not (folder / name).is_dir():
                    raise CheckpointError(f"{folder}: no {name}/ folder to resume the {name} from")
                client.load_checkpoint(str(folder / name))
        if self.loader is not None:  # None in an evaluation (trainer.val_only)
            self.loader.load_state_dict(saved.loader)
        self.kl_ctrl.load_state_dict(saved.kl_ctrl)
        saved.restore_rng()
        self.state.step = saved.step
        log.info("resumed from %s (step %d)", folder, saved.step)

    def save_checkpoint(self) -> Path:
        assert self.loader is not None  # a training run
        loader = self.loader.state_dict()
        if self.ahead is not None:  # not past the prompts drawn ahead: their step is not done
            loader = self.ahead.loader_state(loader, self.state.step)
        state = CoordinatorState.capture(
            self.state.step, loader, self.kl_ctrl.state_dict(), self.state.step
        )

        def save_roles(tmp: Path) -> None:
            model = self.cfg.actor_rollout_ref.model
            if Path(model.path).is_dir():  # config + tokenizer make the checkpoint exportable alone
                tokenizer = Path(model.tokenizer_path) if model.tokenizer_path else None
                copy_model_files(Path(model.path), tokenizer, tmp / "hf")
            jobs = [
                self.pool.submit(c.save_checkpoint, str(tmp / name))
                for name, c in (("actor", self.roles.actor), ("critic", self.roles.critic))
                if c is not None
            ]
            for f in jobs:
                f.result()

        saved = self.checkpoints.save(self.state.step, state, config_to_yaml(self.cfg), save_roles)
        self.last_saved = saved
        return saved

    def should_save(self, last: bool) -> bool:
        freq = self.cfg.trainer.save_freq
        return freq > 0 and (self.state.step % freq == 0 or last)

    # --- the loop ---------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """Whether the run did all it was asked: every step, or its one validation."""
        if self.cfg.trainer.val_only:
            return self.validated_only
        return self.state.step >= self.total_steps

    def validate_only(self) -> dict[str, float]:
        """trainer.val_only: one validation of the starting weights, logged; retried after a
        recovery that went back to the checkpoint (the same weights again)."""
        metrics = None
        while metrics is None and not self._stop.is_set():
            metrics = self.validate_or_recover()  # None: went back to the checkpoint
        if metrics is None:  # stopped first: nothing validated, nothing to report
            return {}
        self.log(self.state.step, metrics)
        self.state.last_metrics = metrics
        self.validated_only = True
        return metrics

    def train(self) -> dict[str, float]:
        cfg = self.cfg.trainer
        if cfg.val_only:
            return self.validate_only()
        if cfg.val_before_train and self.val_set is not None:
            before = self.validate_or_recover()
            if before is not None:
                self.log(self.state.step, before)
        bar = tqdm(
            total=self.total_steps,
            initial=self.state.step,
            desc="PPO",
            unit="step",
            dynamic_ncols=True,
            disable=None,  # no bar when the output is no terminal: no \r lines in a log file
        )

        def went_back() -> None:  # to the last checkpoint after a crash
            bar.reset(total=self.total_steps)
            bar.update(self.state.step)

        saved_step = None
        try:
            while self.state.step < self.total_steps and not self._stop.is_set():
                drawn = self.ahead.prompts_for(self.state.step + 1) if self.ahead else None
                assert self.loader is not None  # total_steps is 0 without one
                epoch, records = drawn or self.loader.next_batch()
                self.further_records = []
                self.state.step += 1
                self.state.epoch = epoch
                metrics = self.run_step(records)
                if metrics is None:
                    went_back()
                    continue
                metrics["training/global_step"] = float(self.state.step)
                metrics["training/epoch"] = float(epoch)
                last = self.state.step == self.total_steps
                if (
                    self.val_set is not None
                    and cfg.test_freq > 0
                    and (self.state.step % cfg.test_freq == 0 or last)
                ):
                    val = self.validate_or_recover()
                    if val is None:
                        went_back()
                        continue
                    metrics.update(val)
                if self.should_save(last):
                    with_timer = time.perf_counter()
                    self.save_checkpoint()
                    saved_step = self.state.step
                    metrics["timing_s/save_checkpoint"] = time.perf_counter() - with_timer
                self.state.last_metrics = metrics
                self.log(self.state.step, metrics)
                bar.update(1)
                bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}")
        finally:
            bar.close()
        stopped_early = self._stop.is_set() and 0 < self.state.step < self.total_steps
        if stopped_early and saved_step != self.state.step:  # not twice for one step
            log.info("stopped at step %d; saving a checkpoint to resume from", self.state.step)
            self.save_checkpoint()
        return self.state.last_metrics

    def validate_or_recover(self) -> dict[str, float] | None:
        """Validation with bounded restarts of dead role servers, as a step has: rollout and
        reward die mid-validation too. None when the run went back to its last checkpoint."""
        while True:
            try:
                return self.validate()
            except RoleCallError as err:
                step = self.state.step
                self.count_failure(step, err, f"validation at step {step} failed")
                # The actor holds step state.step's weights: its updates are done.
                if self.recover(err, updated=True):
                    return None

    def validate(self) -> dict[str, float]:
        start = time.perf_counter()
        self.step_runner.memory.wake()  # validation generates: the caches come back first
        shown_count = self.cfg.trainer.log_val_generations
        shown: list[GenerationRow] | None = [] if shown_count else None
        assert self.val_set is not None  # validates only with data.val_files
        metrics = validate(
            self.cfg,
            [self.val_set[i] for i in range(len(self.val_set))],
            self.roles.rollouts,
            self.roles.reward,
            self.tokenizer,
            self.pool,
            generations_dir(self.cfg.trainer.validation_data_dir, self.run_dir),
            self.state.step,
            shown,
        )
        if shown:
            rows = pick_shown(shown, shown_count, self.cfg.trainer.seed)
            log_generations(self.sinks, self.state.step, rows)
        return {**metrics, "timing_s/testing": time.perf_counter() - start}

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
        finished = error is None and hasattr(self, "total_steps") and self.finished
        close_sinks(self.sinks, ended_exit_code(error, finished))
        if self.cfg.trainer.plot and (self.run_dir / "metrics.jsonl").exists():
            try:
                plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.png")
            except Exception as e:  # noqa: BLE001 - a plot never fails a finished run
                log.warning("could not plot metrics: %s", e)
        for closer in (getattr(self, "step_runner", None), getattr(self, "syncer", None)):
            if closer is not None:
                closer.close()
        if self.ahead is not None:
            self.ahead.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
