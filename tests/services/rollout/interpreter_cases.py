"""Kernel checks run in Triton's CPU interpreter, shared by the kernel test files.

The interpreter is chosen when a kernel is first jitted, from TRITON_INTERPRET, and anything
in the pytest process may have imported triton or jitted the kernels already. So each test
file runs all its checks in one child process: the file itself, run as a script with
TRITON_INTERPRET=1 (:func:`run_child`), calls :func:`run_cases`, which writes each case's
outcome (None or its traceback) to JSON; each pytest item then reads its own
(:func:`report`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (the kernels are checked in its interpreter)",
)


def run_cases(groups: list[tuple[str, dict, Callable[[dict], None]]], results_path: str) -> None:
    """In the child: ``check(case)`` for every case of every (group, cases, check); writes
    {"results": {"group/name": None or traceback}, "seconds": {...}} to ``results_path``."""
    from services.rollout.fast import kernels

    assert kernels.available("cpu"), "the child process must run with TRITON_INTERPRET=1"
    results, seconds = {}, {}
    for group, cases, check in groups:
        for name, case in cases.items():
            key, began = f"{group}/{name}", time.perf_counter()
            try:
                check(case)
                results[key] = None
            except Exception:  # noqa: BLE001 - reported to the pytest item
                results[key] = traceback.format_exc()
            seconds[key] = round(time.perf_counter() - began, 2)
    Path(results_path).write_text(json.dumps({"results": results, "seconds": seconds}))


def run_child(test_file: str, tmp_dir: Path) -> dict[str, str | None]:
    """Runs ``test_file`` as a script under the interpreter; returns its cases' outcomes."""
    results_path = tmp_dir / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    child = subprocess.run(
        [sys.executable, test_file, str(results_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if child.returncode != 0 or not results_path.exists():
        pytest.fail(f"the interpreter process failed ({child.returncode}):\n{child.stderr[-4000:]}")
    return json.loads(results_path.read_text())["results"]


def report(results: dict[str, str | None], key: str) -> None:
    """Fails the calling test with the child's traceback for ``key``, if it failed."""
    assert key in results, f"no result for {key}"
    if results[key] is not None:
        pytest.fail(results[key], pytrace=False)
