"""Finding the role servers a process started (tests check that none are left)."""

from __future__ import annotations

import psutil

_SERVER_MODULES = ("-m services.rollout", "-m services.trainer", "-m services.reward")


def role_server_pids(root_pid: int) -> set[int]:
    """Role servers among the descendants of ``root_pid``: processes whose command line
    runs a server module (a forked server shows its own, fork_server._show_as). The fork
    server itself, which the launcher keeps for the next start, is not one."""
    found = set()
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            line = " ".join(proc.cmdline())
        except psutil.Error:  # gone meanwhile
            continue
        if any(m in line for m in _SERVER_MODULES):
            found.add(proc.pid)
    return found


def without_exit_warnings(stderr: str) -> str:
    """A run's stderr without the warning Python's resource tracker (a process of its own,
    shared with the role servers the launcher forked) may print after the run's last line,
    about semaphores of servers that were killed: what the run itself said, last line last."""
    lines = stderr.rstrip().splitlines()
    while lines and (
        "resource_tracker" in lines[-1] or lines[-1].lstrip().startswith("warnings.warn(")
    ):
        lines.pop()
    return "\n".join(lines)
