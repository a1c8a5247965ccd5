"""The reward server as a real process: `python -m services.reward.server` on a free port,
scored over gRPC; evaluate() through it."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshrl.api.v1 import reward_pb2, reward_pb2_grpc
from meshrl.config import ConfigError, build_config, config_to_yaml
from meshrl.launcher.ports import free_port
from meshrl.rpc.client import open_channel, wait_for_health
from meshrl.rpc.role_client import RoleCallError
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl_app import cli
from services.reward.client import RewardClient
from services.reward.evaluate import CHUNK, evaluate, score_deadline_s
from services.reward.reward_model import RewardModel
from services.reward.scorers.registry import known_data_sources
from services.reward.server import SERVICE_NAME, start_up_errors
from services.reward.types import ScoreItem

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[3]


def _children(pid: int) -> list[int]:
    """Direct child processes of `pid` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Server:
    def __init__(self, log_path: Path, *args: str):
        self.address = f"127.0.0.1:{free_port()}"
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.reward.server",
                "--port",
                self.address.split(":")[1],
                "--timeout-s",
                "2",
                *args,
            ],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.workers: list[int] = []
        try:
            wait_for_health(
                self.address, SERVICE_NAME, timeout_s=90, alive=lambda: self.proc.poll() is None
            )
        except Exception:
            self.stop()
            raise RuntimeError(f"server did not start:\n{log_path.read_text()}") from None
        self.workers = _children(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pid in self.workers + _children(self.proc.pid):  # ours only, by id
            if _alive(pid):
                os.kill(pid, 9)
        self._log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("reward") / "server.log")
    yield s
    s.stop()


@pytest.fixture
def client(server):
    with RewardClient(server.address, timeout_s=60) as c:
        yield c


def test_answers_reach_the_coordinators_client_for_majority_votes(server):
    role = RewardClient(server.address, timeout_s=60)
    try:
        out = role.score(
            [
                ScoreItem("openai/gsm8k", "#### 7", "7"),
                ScoreItem("openai/gsm8k", "none", "7"),
                ScoreItem("math", "\\boxed{9^{999999999}}", "5"),
            ]
        )
    finally:
        role.close()
    assert [o.pred for o in out] == ["7", "", None]  # the timed-out sample says nothing
    assert [o.ok for o in out] == [True, True, False]


def test_info_and_scorers(client):
    info = client.info()
    assert info.service == "reward" and info.ready and info.api_version == "meshrl.api.v1"
    assert client.list_scorers() == known_data_sources()


def test_score_over_grpc(client):
    endings = ["a", "b", "c", "d"]
    items = [
        ScoreItem("openai/gsm8k", "so #### 1,234", "1234"),
        ScoreItem("openai/gsm8k", "#### 5", "6"),
        ScoreItem("HuggingFaceH4/MATH-500", "$\\boxed{\\frac{1}{2}}$", "0.5"),
        ScoreItem("Rowan/hellaswag", "The answer is C", "2", extra_info={"endings": endings}),
        ScoreItem("math", "\\boxed{9^{999999999}}", "5"),  # killed at the 2 s timeout
    ]
    out = client.score(items)
    assert [o.score for o in out] == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert [o.ok for o in out] == [True, True, True, True, False]
    assert out[4].reason == "timeout after 2.0s"
    assert out[0].extra == {"rule_score": 1.0, "acc": 1.0}
    # the request's own per-sample timeout wins
    assert client.score(items[4:], per_sample_timeout_s=1.0)[0].reason == "timeout after 1.0s"


def test_unknown_data_source_is_invalid_argument(client):
    with pytest.raises(RoleCallError) as e:
        client.score([ScoreItem("openai/gsm8k", "#### 1", "1"), ScoreItem("my/own", "x", "y")])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown data_source 'my/own'" in e.value.details
    assert ", ".join(known_data_sources()) in e.value.details


def test_bad_extra_info_json_is_invalid_argument(server):
    channel = open_channel(server.address)
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    req = reward_pb2.ScoreRequest(
        items=[reward_pb2.ScoreItem(data_source="gsm8k", extra_info_json="{oops")]
    )
    with pytest.raises(grpc.RpcError) as e:
        stub.Score(req, timeout=30)
    channel.close()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not JSON" in e.value.details()


def test_evaluate_through_server(server, tmp_path):
    data = tmp_path / "test.parquet"
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"split": "test", "index": i},
        }
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(rows), data)
    (tmp_path / "r.jsonl").write_text(
        "".join(json.dumps({"index": i, "response": f"#### {i}"}) + "\n" for i in (0, 1))
    )
    report = evaluate(data, tmp_path / "r.jsonl", server=server.address)
    assert (report.overall.responses, report.overall.acc, report.missing_rows) == (2, 1.0, 1)


def test_evaluate_through_server_leaves_an_unknown_data_source_unscored(server, tmp_path):
    """The server's own list of scorers decides: before, its INVALID_ARGUMENT for one unknown
    data_source failed the whole evaluation."""
    from services.reward.evaluate import evaluate_samples

    samples = tmp_path / "s.jsonl"
    rows = [
        {"data_source": "openai/gsm8k", "response": "#### 4", "ground_truth": "4"},
        {"data_source": "my/own", "response": "4", "ground_truth": "4"},
    ]
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = evaluate_samples(samples, server=server.address)
    assert (report.overall.responses, report.overall.acc, report.unscored) == (
        1,
        1.0,
        {"my/own": 1},
    )
    with pytest.raises(ValueError, match="unknown data_source 'my/own'; known: openai/gsm8k"):
        evaluate_samples(samples, server=server.address, strict=True)


def test_evaluate_through_server_sends_its_sample_timeout(server, tmp_path):
    """--timeout-s reaches the server: a hanging sample costs itself, after 1 s, not the call;
    and the call's deadline covers a chunk whose every sample runs to its timeout."""
    fn = tmp_path / "slow.py"
    fn.write_text(
        "import time\n"
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    if solution_str == 'hang':\n"
        "        time.sleep(60)\n"
        "    return 1.0\n"
    )
    data = tmp_path / "test.parquet"
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": "q",
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"index": i},
        }
        for i in range(2)
    ]
    pq.write_table(pa.Table.from_pylist(rows), data)
    responses = tmp_path / "r.jsonl"
    responses.write_text('{"index": 0, "response": "hang"}\n{"index": 1, "response": "x"}\n')
    custom = build_config({"reward": {"custom_function": f"{fn}:score", "num_workers": 1}})
    with RewardClient(server.address, timeout_s=90) as c:
        c.initialize(config_to_yaml(custom))
        try:
            report = evaluate(data, responses, server=server.address, sample_timeout_s=1)
        finally:
            c.initialize(config_to_yaml(build_config({})))  # back to the rule scorers
    hung, fine = report.samples
    assert (hung.ok, hung.reason, fine.ok, fine.score) == (False, "timeout after 1.0s", True, 1.0)
    assert score_deadline_s(CHUNK, 10.0) > CHUNK * 10.0


def test_initialize_with_custom_function_then_bad_config(server, tmp_path):
    fn = tmp_path / "reward_fn.py"
    fn.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n    return 0.25\n"
    )
    cfg = build_config({"reward": {"custom_function": f"{fn}:score", "num_workers": 1}})
    with RewardClient(server.address, timeout_s=90) as c:
        c.initialize(config_to_yaml(cfg))
        assert "*" in c.list_scorers()
        assert c.score([ScoreItem("whatever", "x", "y")])[0].score == 0.25
        with pytest.raises(RoleCallError) as e:
            c.initialize("reward:\n  timeout_s: -1\n")
        assert (
            e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            and "reward.timeout_s" in e.value.details
        )
        c.initialize(config_to_yaml(build_config({})))  # back to the rule scorers
        assert c.list_scorers() == known_data_sources()


def test_initialize_with_a_reward_model_path_that_does_not_exist(server, tmp_path):
    """Before: INTERNAL, `OSError: Repo id must be in the form 'repo_name' or
    'namespace/repo_name'`, so the run failed with exit 1 instead of a config error (the
    coordinator makes INVALID_ARGUMENT at start exit 2)."""
    missing = tmp_path / "nope"
    cfg = build_config(
        {"reward": {"num_workers": 1, "reward_model": {"enable": True, "path": str(missing)}}}
    )
    with RewardClient(server.address, timeout_s=90) as c:
        with pytest.raises(RoleCallError) as e:
            c.initialize(config_to_yaml(cfg))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"reward.reward_model.path: {missing} does not exist (a Hugging Face model " in (
            e.value.details
        )
        assert c.list_scorers() == known_data_sources()  # the scorer in place serves on


def test_serve_with_a_causal_lm_as_reward_model_is_one_line_and_exit_2(tmp_path, capsys):
    """Before: `reward model X has 2 labels; one is needed` (transformers' default num_labels
    of a config that sets none). `meshrl reward serve` in this process (the same path as the
    command's; tests/launcher/test_cli_reward_serve.py runs it as a process): refused before
    any worker starts."""
    lm = make_tiny_model_dir(tmp_path / "lm", hidden=32, intermediate=64)
    argv = ["reward", "serve", "--port", "0", "--num-workers", "1", "--reward-model", str(lm)]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert cli.main(argv) == 2
    finally:  # the server's StopSignal took them
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"meshrl: --reward-model: {lm} is a LlamaForCausalLM (a language model); a reward "
        "model needs a sequence- or token-classification head with one label (num_labels=1)"
    )


def test_a_reward_model_error_at_start_up_names_the_flag(tmp_path):
    """`serve` took the path from --reward-model, so its error names the flag, not the key."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as e, start_up_errors():
        RewardModel(str(empty), device="cpu")
    assert str(e.value) == (
        f"--reward-model: {empty} has no config.json "
        "(a Hugging Face model folder with a classification head is needed)"
    )


def test_sigterm_stops_server_and_workers(tmp_path):
    s = Server(tmp_path / "own.log", "--num-workers", "2")
    workers = list(s.workers)
    assert len(workers) >= 2  # the scorer workers (and multiprocessing's resource tracker)
    s.proc.terminate()
    assert s.proc.wait(15) == 0 or s.proc.returncode is not None
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in workers if _alive(p)]
    s.stop()
    assert not left, f"processes left behind: {left}"


HUNG = """
import time

def score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "hang":
        open(__file__ + ".hanging", "w").close()  # the test waits for this
        time.sleep(600)
    return 1.0
"""


def _wait_for_file(path: Path, what: str, timeout_s: float = 60.0) -> None:
    """Until ``path`` exists: a reward function's own signal that it has got that far."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _hung_server(tmp_path: Path) -> Server:
    """A server of its own, one worker, whose reward function hangs on "hang" (60 s
    timeout)."""
    fn = tmp_path / "hung.py"
    fn.write_text(HUNG)
    args = ("--timeout-s", "60", "--num-workers", "1", "--custom-function", f"{fn}:score")
    return Server(tmp_path / "own.log", *args)


def test_ctrl_c_does_not_wait_for_a_hung_reward_function(tmp_path):
    """The call in flight is cancelled after the grace period, its samples and workers too:
    before, the server lived on until the sample timeout (here 60 s)."""
    s = _hung_server(tmp_path)
    workers = list(s.workers)
    errors: list[RoleCallError] = []

    def call() -> None:
        with RewardClient(s.address, timeout_s=90) as c:
            try:
                c.score([ScoreItem("any", "hang", "y")])
            except RoleCallError as e:
                errors.append(e)

    caller = threading.Thread(target=call)
    caller.start()
    _wait_for_file(tmp_path / "hung.py.hanging", "the reward function never started")
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(30) == 0
    took = time.monotonic() - t0
    caller.join(10)
    log = (tmp_path / "own.log").read_text()
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker leaves last
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in workers if _alive(p)]
    s.stop()
    assert took < 15, f"stopping took {took:.1f} s:\n{log}"
    assert len(errors) == 1
    assert errors[0].code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert "Traceback" not in log, log
    assert not left, f"processes left behind: {left}"


def test_a_call_past_its_deadline_frees_the_workers_for_the_next_one(tmp_path):
    """Its samples are cancelled when its RPC ends; before, the next call's samples waited
    behind them on the one worker (2 x 60 s here)."""
    s = _hung_server(tmp_path)
    try:
        stub = reward_pb2_grpc.RewardServiceStub(open_channel(s.address))
        hung = [reward_pb2.ScoreItem(data_source="any", response="hang", ground_truth="y")] * 2
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(reward_pb2.ScoreRequest(items=hung), timeout=2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        t0 = time.monotonic()
        with RewardClient(s.address, timeout_s=90) as c:
            out = c.score([ScoreItem("any", "fine", "y")])
        assert out[0].ok and out[0].score == 1.0
        assert time.monotonic() - t0 < 20, (tmp_path / "own.log").read_text()
    finally:
        s.stop()


SLOW_IMPORT = """
import time

open(__file__ + ".importing", "w").close()  # the test waits for this
time.sleep(20)  # a custom module that takes long to import: Initialize builds for 20 s


def score(data_source, solution_str, ground_truth, extra_info):
    return 1.0
"""


def test_ctrl_c_does_not_wait_for_an_initialize_building_its_scorer(tmp_path):
    """Before, the process waited for the Initialize (17.7 s of this one's 20 s), and put
    the scorer it built into service after it had begun to stop."""
    fn = tmp_path / "slow_import.py"
    fn.write_text(SLOW_IMPORT)
    s = Server(tmp_path / "own.log", "--num-workers", "1")
    cfg = build_config({"reward": {"custom_function": f"{fn}:score", "num_workers": 1}})
    init = RewardClient(s.address, timeout_s=90)
    errors: list[RoleCallError] = []

    def initialize() -> None:
        try:
            init.initialize(config_to_yaml(cfg))
        except RoleCallError as e:
            errors.append(e)

    caller = threading.Thread(target=initialize)
    caller.start()
    _wait_for_file(tmp_path / "slow_import.py.importing", "the import never started")
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(30) == 0
    took = time.monotonic() - t0
    caller.join(10)
    init.close()
    log = (tmp_path / "own.log").read_text()
    s.stop()
    assert took < 15, f"stopping took {took:.1f} s:\n{log}"  # the import had 18 s left
    assert "initialized:" not in log, log
    assert "exiting without waiting for 1 call(s) still running" in log, log
    assert len(errors) == 1


def test_ctrl_c_at_a_terminal_while_the_workers_start_is_a_clean_stop(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: the scorer workers, still
    starting, die of it. Before, that failed the server's start-up: a traceback, exit 1."""
    log_path = tmp_path / "own.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward.server", "--port", "0"],
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # a group of its own, as a terminal's foreground job
        )
        try:
            deadline = time.monotonic() + 60
            while "listening on" not in log_path.read_text():  # the workers start now
                assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()
                time.sleep(0.02)
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(30) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    log = log_path.read_text()
    # The workers' own KeyboardInterrupt tracebacks (Python's start-up, cut short) are the
    # terminal's; the server's start-up must not fail with one of its own.
    assert 'reward/server.py", line' not in log, log
    assert "stopped while starting its workers" in log or "stopping" in log, log
