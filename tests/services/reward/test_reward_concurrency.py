"""Score calls overlap: a slow batch does not hold up a fast one, a hung sample still times
out at its own limit, and a scorer swapped in by Initialize never cuts off a call in flight.
The server is a real process (`python -m services.reward.server`) scored over gRPC; the
ScorerSlot's bounds are checked in-process."""

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from meshrl.config import build_config, config_to_yaml
from meshrl.launcher.ports import free_port
from meshrl.rpc.client import wait_for_health
from services.reward.client import RewardClient
from services.reward.scorer_slot import NotReady, ScorerSlot
from services.reward.server import SERVICE_NAME
from services.reward.types import ScoreItem

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[3]

SLEEPY = '''
import time

def score(data_source, solution_str, ground_truth, extra_info):
    """"sleep S ..." sleeps S seconds first; the score is 1 when the response ends with the
    ground truth."""
    if solution_str.startswith("sleep "):
        time.sleep(float(solution_str.split()[1]))
    return 1.0 if solution_str.endswith(ground_truth) else 0.0
'''


class SleepyServer:
    """A reward server scoring with SLEEPY on 3 workers (a slow call's 2 samples leave one
    free), logging to `log_path`; its own process group, stopped by its id."""

    def __init__(self, fn_spec: str, log_path: Path):
        self.address = f"127.0.0.1:{free_port()}"
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward.server", "--port", self.address.split(":")[1],
             "--custom-function", fn_spec, "--num-workers", "3", "--timeout-s", "30"],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            wait_for_health(self.address, SERVICE_NAME, 90, alive=lambda: self.proc.poll() is None)
        except BaseException:
            self.stop()
            raise

    def log_lines(self) -> list[str]:
        return self.log_path.read_text().splitlines()

    def wait_for_log(self, text: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.log_lines()):
            assert time.monotonic() < deadline, f"no {text!r} in the server log"
            time.sleep(0.02)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its scorer workers
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sleepy")
    (folder / "sleepy.py").write_text(SLEEPY)
    s = SleepyServer(f"{folder / 'sleepy.py'}:score", folder / "server.log")
    yield s
    s.stop()


def _line_of(lines: list[str], text: str) -> int:
    return next(i for i, line in enumerate(lines) if text in line)


def test_fast_call_finishes_while_a_slow_one_runs(server):
    slow = [ScoreItem("any", "sleep 3 x", "x"), ScoreItem("any", "sleep 600 y", "y")]
    fast = [ScoreItem("any", "quick z", "z"), ScoreItem("any", "quick z", "w")]
    with RewardClient(server.address, timeout_s=60) as a, RewardClient(server.address, 60) as b:
        pool = ThreadPoolExecutor(1)
        started = time.monotonic()
        slow_call = pool.submit(a.score, slow, 5.0)  # per-sample timeout 5 s
        server.wait_for_log("rpc Score #1 started")
        fast_out = b.score(fast)
        fast_done = time.monotonic() - started
        assert not slow_call.done(), "the fast call came back while the slow one still ran"
        slow_out = slow_call.result(timeout=60)
        slow_done = time.monotonic() - started
        pool.shutdown()
    assert [(o.score, o.ok) for o in fast_out] == [(1.0, True), (0.0, True)]
    assert fast_done < 5.0 <= slow_done  # one worker was free: no wait behind the slow samples
    # the hung sample is cut at its own 5 s limit, counted from when a worker took it
    assert (slow_out[0].score, slow_out[0].ok) == (1.0, True)
    timed_out = slow_out[1]
    assert (timed_out.score, timed_out.ok, timed_out.reason) == (0.0, False, "timeout after 5.0s")
    assert 5.0 <= slow_done < 15.0
    lines = server.log_lines()
    assert _line_of(lines, "rpc Score #2 finished") < _line_of(lines, "rpc Score #1 finished")


def test_initialize_waits_for_the_call_in_flight(server):
    """The old scorer closes (its workers stop) only after the call that borrowed it has
    all its results; calls after the swap use the new scorer."""
    fn_spec = next(a for a in server.proc.args if a.endswith(":score"))
    cfg = build_config({"reward": {"custom_function": fn_spec, "num_workers": 2}})
    with RewardClient(server.address, timeout_s=90) as a, RewardClient(server.address, 90) as b:
        pool = ThreadPoolExecutor(1)
        before = sum("rpc Score #" in line and "started" in line for line in server.log_lines())
        in_flight = pool.submit(a.score, [ScoreItem("any", "sleep 4 ok", "ok")])
        server.wait_for_log(f"rpc Score #{before + 1} started")
        b.initialize(config_to_yaml(cfg))  # builds a new scorer, swaps it in
        assert in_flight.done(), "the swap closed the old scorer only after its call returned"
        out = in_flight.result()
        pool.shutdown()
        assert [(o.score, o.ok) for o in out] == [(1.0, True)]
        assert [o.score for o in b.score([ScoreItem("any", "after swap", "swap")])] == [1.0]


class _Closable:
    """Stands in for a RewardScorer: the slot only lends it and closes it."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_slot_bounds_calls_and_closes_the_old_scorer_after_its_calls():
    slot = ScorerSlot(max_calls=2)
    with pytest.raises(NotReady):
        with slot.borrow():
            pass
    old, new = _Closable(), _Closable()
    slot.swap(old)
    release = threading.Event()
    got: list = []

    def call() -> None:
        with slot.borrow() as scorer:
            got.append(scorer)
            release.wait(10)

    first = [threading.Thread(target=call) for _ in range(2)]
    for t in first:
        t.start()
    while len(got) < 2:
        time.sleep(0.01)
    third = threading.Thread(target=call)
    third.start()
    time.sleep(0.2)
    assert len(got) == 2, "a third call waits while two hold the slot's places"
    swapper = threading.Thread(target=slot.swap, args=(new,))
    swapper.start()
    time.sleep(0.2)
    assert not old.closed.is_set(), "the old scorer stays open while calls use it"
    release.set()
    for t in (*first, third, swapper):
        t.join(10)
    assert old.closed.is_set() and not new.closed.is_set()
    assert got == [old, old, new]  # the third got a place once one was free, and the new scorer
    slot.close()
    assert new.closed.is_set()


class _Abandonable(_Closable):
    """Stands in for a RewardScorer whose samples a stopping server cancels: its call
    returns once it is abandoned (or never, with `stuck`: a reward-model forward)."""

    def __init__(self, stuck: bool = False) -> None:
        super().__init__()
        self.stuck = stuck
        self.abandoned = threading.Event()

    def abandon(self) -> None:
        self.abandoned.set()

    def score(self) -> None:
        while not self.stuck and not self.abandoned.wait(0.01):
            pass
        if self.stuck:
            time.sleep(2)


def test_slot_abandon_ends_the_calls_it_can_and_counts_the_others():
    slot = ScorerSlot(max_calls=4)
    old, stuck, current = _Abandonable(), _Abandonable(stuck=True), _Abandonable()
    started = threading.Semaphore(0)

    def call() -> None:
        with slot.borrow() as scorer:
            started.release()
            scorer.score()

    calls = []
    for scorer in (old, stuck, current):
        slot._scorer = scorer  # each call borrows a different scorer (as after Initialize)
        calls.append(threading.Thread(target=call))
        calls[-1].start()
        assert started.acquire(timeout=5)
    t0 = time.monotonic()
    assert slot.abandon(timeout_s=0.5) == 1  # the stuck one is still running
    assert time.monotonic() - t0 < 5  # it waited its 0.5 s, not for the stuck call
    assert all(s.abandoned.is_set() for s in (old, stuck, current))
    with pytest.raises(NotReady):  # out of service: later calls are refused
        with slot.borrow():
            pass
    for t in calls:
        t.join(5)


def test_a_scorer_built_while_the_slot_is_abandoned_is_abandoned_too():
    # An Initialize that finishes building its scorer after the server began to stop
    slot = ScorerSlot()
    slot.swap(_Abandonable())
    assert slot.abandon(timeout_s=0.1) == 0
    late = _Abandonable()
    slot.swap(late)
    assert late.abandoned.is_set() and slot.current is None
    with pytest.raises(NotReady, match="stopping"):
        with slot.borrow():
            pass
