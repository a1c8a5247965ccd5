"""The coordinator service's logic (no gRPC here): runs in threads, their state, their events.

`RunManager.start` validates a config (a bad key fails at once, naming it), then runs it in
a thread: the launcher named by `launcher.kind` brings up the role servers (local
subprocesses, Ray actors, or the external servers of a docker compose mesh), and `PPORun`
drives them. Every status change, step and notable log line becomes a `RunEvent` in the
run's `EventLog`, which any number of watchers follow from the beginning.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from meshrl.config import ConfigError, RunConfig, build_config
from meshrl.config.loader import config_tree
from meshrl.config.rules import check_config
from meshrl.data.errors import DataError
from meshrl.rpc.security import SecuritySettings
from services.coordinator.metrics.sinks import ConsoleSink, MetricsSink, file_sinks
from services.coordinator.run.lifecycle import run_lifecycle, start_line
from services.coordinator.run.preflight import (
    check_cuda_here,
    check_run_config,
)
from services.coordinator.run.run_folder_lock import RunFolderInUse, check_run_folder_free
from services.coordinator.types import (
    RunEvent,
    RunState,
    RunStatus,
)

log = logging.getLogger(__name__)


class RunConflict(RuntimeError):
    """The run would share role servers or its run folder with a run still going."""


class UnknownRun(KeyError):
    """No run with that id."""


class EventLog:
    """Events of one run; readers keep their own cursor, so each watcher sees every event
    from the start, however late it joins, as long as the log still holds it: it keeps the
    newest ``keep`` (a run of many steps must not grow the service's memory without end;
    the run folder's metrics.jsonl keeps every step)."""

    def __init__(self, keep: int = 10_000):
        self._events: deque[RunEvent] = deque(maxlen=keep)
        self._dropped = 0  # events that fell off the front: the index of _events[0]
        self._cond = threading.Condition()
        self._closed = False

    def append(self, event: RunEvent, close: bool = False) -> None:
        with self._cond:
            if len(self._events) == self._events.maxlen:
                self._dropped += 1
            self._events.append(event)
            self._closed = self._closed or close
            self._cond.notify_all()

    def follow(
        self, keep_going: Callable[[], bool] = lambda: True, poll_s: float = 0.5
    ) -> Iterator[RunEvent]:
        """Yields the events held, then new ones as they come, until the log closes or
        `keep_going()` turns false (checked every `poll_s`, e.g. a client hanging up)."""
        cursor = 0  # index of the next event to yield, counted from the run's first
        while True:
            with self._cond:
                while cursor == self._end() and not self._closed and keep_going():
                    self._cond.wait(poll_s)
                cursor = max(cursor, self._dropped)  # a slow reader skips what was dropped
                batch = list(islice(self._events, cursor - self._dropped, None))
                closed = self._closed
            cursor += len(batch)
            yield from batch
            if (closed and cursor == self._end()) or not keep_going():
                return

    def _end(self) -> int:
        return self._dropped + len(self._events)


class _EventSink:
    """A metrics sink that turns each logged step into a RunEvent."""

    def __init__(self, run: ManagedRun):
        self.run = run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        lines: list[str] = []
        ConsoleSink(write=lines.append).log(step, metrics)
        self.run.update(step=step, metrics=dict(metrics), line=lines[0] if lines else "")

    def close(self) -> None:
        pass


class _RunLogHandler(logging.Handler):
    """Forwards warnings and errors logged by the run's own thread to its watchers."""

    def __init__(self, run: ManagedRun):
        super().__init__(logging.WARNING)
        self.run = run

    def emit(self, record: logging.LogRecord) -> None:
        # This module's own records (the run rejected or failed) are for the service's log:
        # the watchers hear the same as the run's last status line, not twice more.
        if record.thread == self.run.thread_id and record.name != __name__:
            self.run.update(line=f"{record.levelname} {record.name}: {record.getMessage()}")


class ManagedRun:
    """One run: its config, status, event log and the thread that drives it."""

    def __init__(
        self,
        run_id: str,
        cfg: RunConfig,
        run_dir: Path,
        launcher,
        make_ppo: Callable,
        load_data: Callable | None = None,
    ):
        self.run_id = run_id
        self.cfg = cfg
        self.run_dir = run_dir
        self.launcher = launcher
        self.make_ppo = make_ppo
        self.load_data = load_data or _default_load_data
        self.data = None  # the run's prompts (RunData), read before its servers start
        self.events = EventLog()
        self.ppo: Any = None  # what make_ppo makes: a PPORun (a stand-in in tests)
        self.thread_id: int | None = None
        self.stop_requested_event = threading.Event()
        self._lock = threading.Lock()
        self.status = RunStatus(run_id, RunState.STARTING, run_dir=str(run_dir))
        self.thread = threading.Thread(target=self._main, name=f"run-{run_id}", daemon=True)

    def update(self, line: str = "", metrics: dict[str, float] | None = None, **changes) -> None:
        with self._lock:
            self.status = self.status.evolve(**changes) if changes else self.status
            event = RunEvent(self.status, metrics or {}, line)
            self.events.append(event, close=self.status.state.terminal)

    def stop(self) -> None:
        """Ends the run after its current step (PPORun checks between steps)."""
        self.stop_requested_event.set()
        if self.ppo is not None:
            self.ppo.stop()
        self.update(line="stop requested: the run ends after the current step")

    def change_pool(self, address: str, add: bool) -> None:
        """Asks the run to add the rollout server at ``address`` to its pool, or to take it
        out, at its next step boundary (RunConflict when that cannot be)."""
        if self.status.state.terminal:
            raise RunConflict(f"run {self.run_id} has ended ({self.status.state.name})")
        membership = getattr(self.ppo, "membership", None)
        if membership is None:
            raise RunConflict(
                f"run {self.run_id} has not started its role servers yet: ask again once it "
                "is RUNNING"
            )
        try:
            (membership.ask_add if add else membership.ask_remove)(address)
        except ValueError as e:  # pool_membership.ReplicaRefused: said as it is
            raise RunConflict(str(e)) from None
        what = "joins" if add else "leaves"
        self.update(line=f"rollout server {address} {what} the pool at the next step boundary")

    # --- the thread -----------------------------------------------------------------
    def _main(self) -> None:
        self.thread_id = threading.get_ident()
        handler = _RunLogHandler(self)
        logging.getLogger().addHandler(handler)
        try:
            state, line = self._run()
            self.update(state=state, line=line)  # only now: the run's servers are down
        except (ConfigError, DataError) as e:  # the request, found wrong once started
            log.error("run %s rejected: %s", self.run_id, e)
            self.update(
                state=RunState.REJECTED,
                message=f"{type(e).__name__}: {e}",
                line=f"run rejected: {e}",
            )
        except BaseException as e:  # noqa: BLE001 - any failure ends this run, not the service
            log.exception("run %s failed", self.run_id)
            self.update(
                state=RunState.FAILED,
                message=f"{type(e).__name__}: {e}",
                line=f"run failed: {type(e).__name__}: {e}",
            )
        finally:
            logging.getLogger().removeHandler(handler)

    def _run(self) -> tuple[RunState, str]:
        """Brings the servers up, trains, takes them down; returns how the run ended."""
        start = time.perf_counter()
        outcome = run_lifecycle(
            self.cfg,
            self.run_dir,
            lambda: self.launcher,  # made at submission: an external one checked its addresses
            load_data=self.load_data,
            make_sinks=self._sinks,
            make_ppo=self.make_ppo,
            observer=self,
        )
        state = RunState.SUCCEEDED if outcome.finished else RunState.STOPPED
        if outcome.note:  # no step ran: a finished run run again, or a stop before the start
            if outcome.total_steps:  # ends at its checkpoint's step, not at 0
                self.update(step=outcome.step, total_steps=outcome.total_steps)
            return state, outcome.note
        return state, (
            f"run {state.name.lower()} after step {self.ppo.progress.step} "
            f"({time.perf_counter() - start:.0f}s of PPO)"
        )

    # --- RunObserver: what the lifecycle tells this run's watchers ---------------------
    def progress(self, line: str) -> None:
        self.update(line=line)

    def stop_requested(self) -> bool:
        return self.stop_requested_event.is_set()

    def created(self, ppo) -> None:
        self.ppo = ppo

    def started(self, ppo) -> None:
        self.update(
            state=RunState.RUNNING,
            total_steps=ppo.total_steps,
            step=ppo.progress.step,
            line=start_line(self.cfg, ppo),
        )

    def _sinks(self) -> list[MetricsSink]:
        sinks: list[MetricsSink] = [
            _EventSink(self),
            *file_sinks(self.cfg, self.run_dir),
        ]
        if "console" in self.cfg.trainer.logger:
            sinks.append(ConsoleSink(write=lambda line: log.info("[%s] %s", self.run_id, line)))
        return sinks


def _default_make_ppo(cfg, endpoints, run_dir, sinks, restarter):
    from services.coordinator.run.run import PPORun

    return PPORun(cfg, endpoints, run_dir, sinks=sinks, restarter=restarter)


def _default_load_data(cfg: RunConfig, run_dir: Path):
    from services.coordinator.run.run_data import load_run_data  # pyarrow, transformers

    return load_run_data(cfg, run_dir)


def _default_make_launcher(cfg: RunConfig, run_dir: Path):
    from meshrl.launcher.factory import make_launcher

    return make_launcher(cfg, run_dir)


def parse_run_config(config_yaml: str, overrides: list[str]) -> RunConfig:
    """The submitted YAML + overrides, validated; errors name the key (ConfigError)."""
    cfg = build_config(config_tree(config_yaml, "the submitted config"), overrides)
    check_run_config(cfg)
    check_config(cfg, "required")  # after the checks of this machine
    check_cuda_here(cfg)
    _check_security(cfg)
    return cfg


def _check_security(cfg: RunConfig) -> None:
    """The service's clients use the service's own TLS / token settings (its environment);
    a run asking for other ones could not reach its servers, so it fails at start."""
    asked = SecuritySettings.from_config(cfg.security)
    if asked != SecuritySettings() and asked.to_env() != SecuritySettings.from_env().to_env():
        raise ConfigError(
            "security: a coordinator service uses its own settings (MESHRL_TLS_*, "
            "MESHRL_AUTH_TOKEN_FILE of its environment) for every run; leave security.* "
            "unset or equal to them"
        )


class RunManager:
    """All runs of one coordinator process. Thread-safe."""

    def __init__(
        self,
        workdir: Path,
        make_launcher: Callable = _default_make_launcher,
        make_ppo: Callable = _default_make_ppo,
        load_data: Callable = _default_load_data,
    ):
        self.workdir = Path(workdir).resolve()
        self.make_launcher = make_launcher
        self.make_ppo = make_ppo
        self.load_data = load_data
        self._runs: dict[str, ManagedRun] = {}
        self._lock = threading.Lock()

    def start(self, config_yaml: str, overrides: list[str]) -> RunStatus:
        cfg = parse_run_config(config_yaml, overrides)
        run_dir = Path(cfg.trainer.default_local_dir)
        run_dir = run_dir if run_dir.is_absolute() else self.workdir / run_dir
        with self._lock:
            self._check_conflicts(cfg, run_dir)
            run_id = f"{cfg.trainer.experiment_name}-{uuid.uuid4().hex[:6]}"
            launcher = self.make_launcher(cfg, run_dir)  # external: checks the addresses now
            run = ManagedRun(run_id, cfg, run_dir, launcher, self.make_ppo, self.load_data)
            self._runs[run_id] = run
        run.update(line=f"run {run_id} accepted; run folder {run_dir}")
        run.thread.start()
        log.info("run %s started (%s launcher, folder %s)", run_id, cfg.launcher.kind, run_dir)
        return run.status

    def _check_conflicts(self, cfg: RunConfig, run_dir: Path) -> None:
        mine = (
            {a for addrs in cfg.launcher.addresses.values() for a in addrs}
            if cfg.launcher.kind == "external"
            else set()
        )
        for other in self._runs.values():
            if other.status.state.terminal:
                continue
            if other.run_dir == run_dir:
                raise RunConflict(f"run {other.run_id} is still using the run folder {run_dir}")
            if mine and other.cfg.launcher.kind == "external":
                shared = mine & {
                    a for addrs in other.cfg.launcher.addresses.values() for a in addrs
                }
                if shared:
                    raise RunConflict(
                        f"run {other.run_id} is still using the role servers {sorted(shared)}"
                    )
        try:  # held by a run of another process (`meshrl run`, another service)
            check_run_folder_free(run_dir)
        except RunFolderInUse as e:
            raise RunConflict(str(e)) from None

    def _get(self, run_id: str) -> ManagedRun:
        with self._lock:
            if run_id not in self._runs:
                raise UnknownRun(run_id)
            return self._runs[run_id]

    def status(self, run_id: str) -> RunStatus:
        return self._get(run_id).status

    def watch(
        self, run_id: str, keep_going: Callable[[], bool] = lambda: True
    ) -> Iterator[RunEvent]:
        """Checks the id now (UnknownRun), then iterates the run's events."""
        return self._get(run_id).events.follow(keep_going)

    def stop(self, run_id: str) -> RunStatus:
        run = self._get(run_id)
        if not run.status.state.terminal:
            run.stop()
        return run.status

    def add_replica(self, run_id: str, address: str) -> RunStatus:
        """The rollout server at ``address`` joins the run's pool at its next step."""
        run = self._get(run_id)
        run.change_pool(address, add=True)
        return run.status

    def remove_replica(self, run_id: str, address: str) -> RunStatus:
        """The rollout replica at ``address`` leaves the run's pool at its next step."""
        run = self._get(run_id)
        run.change_pool(address, add=False)
        return run.status

    def list(self) -> list[RunStatus]:
        with self._lock:
            return [r.status for r in self._runs.values()]

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stops every live run; after `grace_s` the launchers are stopped under them."""
        with self._lock:
            live = [r for r in self._runs.values() if r.thread.is_alive()]
        for run in live:
            run.stop()
        deadline = time.monotonic() + grace_s
        for run in live:
            run.thread.join(max(0.0, deadline - time.monotonic()))
        for run in live:
            if run.thread.is_alive():  # mid-step: kill its servers so its calls fail fast
                run.launcher.stop()
                run.thread.join(10)
