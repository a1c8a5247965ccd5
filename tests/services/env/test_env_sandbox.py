"""Tool calls in the sandbox: a call that hangs, or whose process dies, costs that call
alone (a ToolFailed naming why), and the next call is served by a fresh worker."""

import os
import time

import pytest

from services.env.sandbox import Sandbox, ToolFailed
from services.env.sandbox_process import calculate

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(num_workers=1, memory_limit_mb=256)
    yield box
    box.close()


def test_a_calculation_runs_in_a_worker(sandbox):
    assert sandbox.call(calculate, ("(48 / 2) * 3 + 7",), 30) == "79"
    assert sandbox.call(os.getpid, (), 30) != os.getpid()


def test_a_refused_expression_answers_an_error(sandbox):
    assert sandbox.call(calculate, ("__import__('os')",), 30).startswith(
        "error: not allowed in an expression"
    )


def test_a_call_that_hangs_is_stopped_at_its_limit(sandbox):
    t0 = time.monotonic()
    with pytest.raises(ToolFailed, match="ran past its limit of 1s"):
        sandbox.call(time.sleep, (60,), 1.0)
    assert time.monotonic() - t0 < 10
    assert sandbox.call(calculate, ("1+1",), 30) == "2"  # a fresh worker


def test_a_runaway_expression_is_stopped_by_time_or_memory(sandbox):
    # each power is within the exponent bound, the result has ~3e9 digits
    try:
        answer = sandbox.call(calculate, ("((9 ** 999) ** 999) ** 999",), 2.0)
    except ToolFailed as e:
        assert "ran past its limit" in str(e) or "died" in str(e)
    else:
        assert answer == "error: the expression needs more memory than the calculator has"
    assert sandbox.call(calculate, ("2*3",), 30) == "6"


def test_a_worker_that_dies_costs_its_call_alone(sandbox):
    with pytest.raises(ToolFailed, match=r"process died \(exit code 3\)"):
        sandbox.call(os._exit, (3,), 30)
    assert sandbox.call(calculate, ("10-4",), 30) == "6"


def test_a_worker_can_write_no_file(sandbox, tmp_path):
    target = tmp_path / "written"
    with pytest.raises(OSError):  # RLIMIT_FSIZE 0: the write fails (SIGXFSZ is ignored)
        sandbox.call(target.write_text, ("x",), 30)
    assert not target.exists() or target.read_text() == ""
