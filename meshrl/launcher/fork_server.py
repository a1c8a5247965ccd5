"""Role servers forked from a process that imported their heavy modules once.

A fresh ``python -m services.trainer.server`` spends about 5 s of CPU importing torch,
FSDP2's DTensor and transformers before it can answer; a run starts five servers and each
restart pays it again (on two cores, twelve seconds before the first step). Python's
multiprocessing *forkserver* imports those modules once per launcher process; every server
is then a fork of it and answers its health check within about a second.

It is safe because the fork server only imports: it runs no torch op (the OpenMP pool
is not started) and never touches CUDA (each forked server initializes its own devices,
after its ``CUDA_VISIBLE_DEVICES`` is set). The forked process is what ``python -m module
args`` would be: a session of its own, stdout and stderr to its log, stdin from
/dev/null, exactly the environment the launcher gives it, the launcher's working
directory, and atexit handlers run at a normal exit.

What forking cannot give: a library that reads an environment variable *at import* saw
the launcher's environment as it was when the fork server started (the first server
started by this process). ``launcher.start_method: spawn`` starts every server fresh.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import runpy
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import cast

# Imported once in the fork server: everything the local launcher's servers import that
# costs seconds. A module that fails to import here is imported by the server itself.
PRELOAD = [
    "services.trainer.server",
    "services.rollout.server",
    "services.rollout.native.engine",
    "services.reward.server",
]


def _run(command: list[str], env: dict[str, str], log_path: str, cwd: str) -> None:
    """In the forked process: becomes ``python -m module *args`` (or ``python -c code``)."""
    os.setsid()  # its own session: one signal to the group reaches what it starts
    # The fork server runs with SIGINT blocked (see fork_server_process): a server takes
    # Ctrl-C as `python -m` would.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _show_as(command)
    stdin = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(stdin)
    os.close(log)
    for stream in (sys.stdout, sys.stderr):  # as PYTHONUNBUFFERED
        cast(io.TextIOWrapper, stream).reconfigure(line_buffering=True, write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    _apply_thread_count(env)
    flag, target, args = command[1], command[2], command[3:]
    try:
        if flag == "-m":
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
    finally:
        atexit._run_exitfuncs()  # multiprocessing leaves by os._exit, skipping them


def _show_as(command: list[str]) -> None:
    """ps, top and /proc/PID/cmdline show the server's own command, not its fork
    server's (left as is where setproctitle is not installed)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(shlex.join(command))


def _apply_thread_count(env: dict[str, str]) -> None:
    """torch read OMP_NUM_THREADS when the fork server imported it; this server's own
    count is set explicitly. CUDA must still be untouched, or the fork is unusable."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if torch.cuda.is_initialized():
        raise RuntimeError("the fork server initialized CUDA; use launcher.start_method=spawn")
    if threads := env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(threads))


class ForkedServer:
    """A forked server's handle, with the part of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]):
        self._process = process
        self.args = args
        assert process.pid is not None, "a started process"
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode  # None while it runs (asks without blocking)

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode


def _context() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the fork server first starts
    return ctx


def fork_server_process(command: list[str], env: dict[str, str], log_path: Path) -> ForkedServer:
    """Starts ``command`` (``[python, "-m", module, *args]`` as ``server_command`` builds
    it, or ``[python, "-c", code, *args]``) as a fork of the fork server, starting that
    first if needed (once per process)."""
    if len(command) < 3 or command[0] != sys.executable or command[1] not in ("-m", "-c"):
        raise ValueError(f"not a `python -m module` or `python -c code` command: {command}")
    Path(log_path).touch()  # a log folder that cannot be written fails here, not silently
    process = _context().Process(
        target=_run,
        args=(command, env, str(log_path), os.getcwd()),
        name=command[2] if command[1] == "-m" else "python -c",
    )
    # A Ctrl-C at the terminal reaches the fork server too (the launcher's process group),
    # and multiprocessing protects it from SIGINT only once its preload is imported: before,
    # a Ctrl-C in those seconds printed a KeyboardInterrupt traceback from deep in torch's
    # imports. Blocked while it is started, the fork server inherits the mask (and keeps the
    # signal blocked); here the signal waits until the start is done, and is not lost.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    # As with a subprocess, this process's exit neither waits for the server nor stops it
    # (multiprocessing would join its children at exit): the server's parent watch stops
    # it once this process is gone (meshrl.rpc.parent_watch).
    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]  # private
    return ForkedServer(process, command)
