"""Local launcher: every role server is a subprocess on a free loopback port.

Each server runs in its own process session so that stopping it also stops the ranks a
`torchrun` spawned. By default servers are forked from a process that imported their
heavy modules once (``fork_server.py``); ``launcher.start_method: spawn`` execs each. `stop()` runs on success, error and Ctrl-C alike and leaves no process.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from meshrl.config import RunConfig
from meshrl.launcher.endpoints import Endpoints
from meshrl.launcher.fork_server import ForkedServer, fork_server_process
from meshrl.launcher.ports import free_port
from meshrl.launcher.server_processes import stop_server, stop_servers
from meshrl.progress_ticker import ProgressTicker
from meshrl.rpc.client import wait_for_health
from meshrl.rpc.metrics_port import METRICS_PORT_ENV
from meshrl.rpc.security import SecuritySettings
from meshrl.rpc.server import INSTANCE_ENV, instance_health_name

log = logging.getLogger(__name__)


@dataclass
class RoleProcess:
    name: str  # "rollout0", "actor", ...
    command: list[str]
    address: str
    log_path: Path
    threads: int = 1
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES of the server; None: every GPU
    popen: subprocess.Popen | ForkedServer | None = None
    instance_id: str = ""  # new at every start; the server reports health under it
    metrics_port: int | None = None  # its /metrics endpoint (launcher.metrics_port_base)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def server_command(
    module: str,
    host: str,
    port: int,
    extra: list[str] | None = None,
    world_size: int = 1,
    master_port: int | None = None,
) -> list[str]:
    """``master_port``: the ranks' rendezvous port with ``world_size`` > 1 (None: a free one)."""
    args = ["-m", module, "--host", host, "--port", str(port), *(extra or [])]
    if world_size <= 1:
        return [sys.executable, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world_size}",
        "--master_addr=127.0.0.1",
        f"--master_port={master_port or free_port()}",
        *args,
    ]


def _lost_its_port(proc: RoleProcess) -> bool:
    """Whether the server's log ends with its bind failing (meshrl.rpc.server's message)."""
    tail = proc.log_path.read_text(errors="replace")[-4000:] if proc.log_path.exists() else ""
    return f"port {proc.address.rsplit(':', 1)[1]} is already in use" in tail


def _move_to_port(proc: RoleProcess, host: str, port: int) -> None:
    at = proc.command.index("--port") + 1  # server_command puts it there
    proc.command[at] = str(port)
    proc.address = f"{host}:{port}"


class LocalLauncher:
    """Starts the role servers a config needs; `start()` returns their endpoints."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.cfg = cfg
        self.host = cfg.launcher.host
        self.log_dir = Path(run_dir) / "logs"
        self.processes: dict[str, RoleProcess] = {}
        self._ports: set[int] = set()  # handed out by this launcher

    def _new_port(self, host: str = "127.0.0.1") -> int:
        """A free port this launcher has not handed out before: the OS may give a port it
        just released again, and two of our servers on one port meant one answering the
        other's health check (the actor's address served by the critic)."""
        while (port := free_port(host)) in self._ports:
            pass
        self._ports.add(port)
        return port

    def _max_servers(self) -> int:
        return self.cfg.actor_rollout_ref.rollout.replicas + 5  # actor, critic, ref, reward, env

    def plan(self) -> list[RoleProcess]:
        cfg, host = self.cfg, self.host
        procs: list[RoleProcess] = []
        metrics_base = cfg.launcher.metrics_port_base
        if metrics_base is not None:  # never handed out as a gRPC port (at most replicas + 4)
            self._ports.update(range(metrics_base, metrics_base + self._max_servers()))

        def add(name, module, extra=None, world_size=1, threads=1):
            port = self._new_port(host)
            master = self._new_port() if world_size > 1 else None
            role = name.rstrip("0123456789")  # rollout0 -> rollout
            procs.append(
                RoleProcess(
                    name,
                    server_command(module, host, port, extra, world_size, master),
                    f"{host}:{port}",
                    self.log_dir / f"{name}.log",
                    threads,
                    cfg.launcher.role_gpus.get(role),
                    metrics_port=None if metrics_base is None else metrics_base + len(procs),
                )
            )

        for i in range(cfg.actor_rollout_ref.rollout.replicas):
            add(f"rollout{i}", "services.rollout.server")
        add(
            "actor",
            "services.trainer.server",
            ["--role", "actor"],
            cfg.actor_rollout_ref.actor.world_size,
        )
        if cfg.use_critic_server:
            add("critic", "services.trainer.server", ["--role", "critic"], cfg.critic.world_size)
        if cfg.use_ref_server:
            add(
                "ref",
                "services.trainer.server",
                ["--role", "ref"],
                cfg.actor_rollout_ref.ref.world_size,
                threads=1,
            )
        add(
            "reward",
            "services.reward.server",
            ["--num-workers", str(cfg.reward.num_workers)],
            threads=1,
        )
        multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
        if multi_turn.enable:  # the environment of the episodes
            add(
                "env",
                "services.env.server",
                [
                    "--tool-workers",
                    str(multi_turn.tool_workers),
                    "--tool-timeout-s",
                    str(multi_turn.tool_timeout_s),
                    "--tool-memory-limit-mb",
                    str(multi_turn.tool_memory_limit_mb),
                    "--step-timeout-s",
                    str(multi_turn.step_timeout_s),
                ],  # fmt: skip
            )
        return procs

    def start(self) -> Endpoints:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            planned = self.plan()
            waiting = [proc.name for proc in planned]  # the first start forks the fork server
            with ProgressTicker(lambda s: self._still_starting(waiting, s), log.info):
                for proc in planned:
                    self._spawn(proc)
                for proc in planned:
                    self._wait_until_serving(proc)
                    waiting.remove(proc.name)
        except BaseException:
            self.stop()
            raise
        return self.endpoints()

    def _still_starting(self, waiting: list[str], elapsed_s: float) -> str:
        """The progress line of a start-up still waiting for ``waiting``: a server starts
        in seconds, but imports for tens of them on a loaded machine."""
        limit = self.cfg.launcher.startup_timeout_s
        return (
            f"role servers starting: {', '.join(waiting)} not answering yet "
            f"({elapsed_s:.0f} s; launcher.startup_timeout_s={limit:g} each)"
        )

    def _wait_until_serving(self, proc: RoleProcess, attempts: int = 3) -> None:
        """Waits for the server's health; a server that lost its port to another process
        between `free_port()` and its bind (busy machines, parallel test runs) is started
        again on a new port."""
        for attempt in range(1, attempts + 1):
            try:
                wait_for_health(
                    proc.address,
                    instance_health_name(proc.instance_id),
                    self.cfg.launcher.startup_timeout_s,
                    alive=proc.alive,
                )
                return
            except Exception:
                if proc.alive() or attempt == attempts or not _lost_its_port(proc):
                    raise
            old = proc.address
            _move_to_port(proc, self.host, self._new_port(self.host))
            log.warning(
                "%s could not bind %s (taken meanwhile); starting it on %s",
                proc.name,
                old,
                proc.address,
            )
            self._spawn(proc)

    def _spawn(self, proc: RoleProcess) -> None:
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(proc.threads),
            PYTHONUNBUFFERED="1",
            TOKENIZERS_PARALLELISM="false",
            MESHRL_PARENT_PID=str(os.getpid()),
        )
        env.update(SecuritySettings.from_config(self.cfg.security).to_env())  # TLS / token
        if proc.gpus is not None:  # launcher.role_gpus: this server sees only these GPUs
            env["CUDA_VISIBLE_DEVICES"] = proc.gpus
        proc.instance_id = f"{proc.name}-{uuid.uuid4().hex[:12]}"
        env[INSTANCE_ENV] = proc.instance_id
        # One port each: a MESHRL_METRICS_PORT of the launcher's own, inherited by every
        # server, would have all but the first fail to bind it.
        env.pop(METRICS_PORT_ENV, None)
        if proc.metrics_port is not None:
            env[METRICS_PORT_ENV] = str(proc.metrics_port)
        forked = None
        if self.cfg.launcher.start_method == "forkserver":
            try:
                forked = fork_server_process(proc.command, env, proc.log_path)
            except (EOFError, OSError) as e:  # a fork server that died and would not come back
                log.warning("%s: the fork server failed (%r); starting it spawned", proc.name, e)
        if forked is not None:
            proc.popen = forked
        else:
            with proc.log_path.open("ab") as log_file:
                proc.popen = subprocess.Popen(
                    proc.command,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                )
        self.processes[proc.name] = proc
        metrics = f"; metrics on {self.host}:{proc.metrics_port}" if proc.metrics_port else ""
        log.info("started %s (pid %d) at %s%s", proc.name, proc.popen.pid, proc.address, metrics)

    def restart(self, name: str) -> str:
        """Kills (if needed) and starts a role server again; waits for health; returns its
        address (the old one, unless another process took that port meanwhile)."""
        proc = self.processes[name]
        self._terminate(proc)
        self._spawn(proc)
        self._wait_until_serving(proc)  # on a new port if its old one was taken meanwhile
        return proc.address

    def dead_roles(self) -> list[str]:
        """Role servers whose process has exited."""
        return [name for name, proc in self.processes.items() if not proc.alive()]

    def endpoints(self) -> Endpoints:
        return Endpoints.from_addresses(
            {name: proc.address for name, proc in self.processes.items()}
        )

    @staticmethod
    def _terminate(proc: RoleProcess, grace_s: float = 5.0) -> None:
        if proc.popen is not None:
            stop_server(proc.popen, proc.instance_id, grace_s)

    def stop(self) -> None:
        """Stops every role server side by side (see ``stop_servers``)."""
        stop_servers(
            [(p.popen, p.instance_id) for p in self.processes.values() if p.popen is not None]
        )

    def __enter__(self) -> LocalLauncher:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
