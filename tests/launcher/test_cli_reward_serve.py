"""`meshrl reward serve` as a real process: the same flags as `python -m services.reward.server`
(one argument definition), and a start-up that cannot go as asked ends in one line, exit 2."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshrl.config.sections import RewardConfig, RewardModelConfig
from meshrl.launcher.ports import free_port
from meshrl.rpc.client import wait_for_health
from meshrl.testing.tiny_model import make_tiny_reward_model_dir
from meshrl_app import cli
from services.reward import arguments
from services.reward.client import RewardClient
from services.reward.scorer_slot import DEFAULT_MAX_CALLS
from services.reward.server import SERVICE_NAME
from services.reward.types import ScoreItem

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
MESHRL = [sys.executable, "-m", "meshrl_app.cli"]
SERVER_MODULE = [sys.executable, "-m", "services.reward.server"]

# The scorer workers' address-space limit, as the custom function sees it in its worker.
RLIMIT_SCORER = """
import resource

def score(data_source, response, ground_truth, extra_info):
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return {"score": 0.0, "limit_mb": limit // 2**20}
"""


def test_the_defaults_written_out_for_the_parser_are_the_servers():
    # arguments.py does not import the scorer (0.25 s on every meshrl command), so it
    # writes these out
    assert arguments.DEFAULT_MAX_CALLS == DEFAULT_MAX_CALLS
    assert arguments.DEFAULT_TIMEOUT_S == RewardConfig().timeout_s
    assert arguments.DEFAULT_NUM_WORKERS == RewardConfig().num_workers
    rm = RewardModelConfig()
    assert arguments.DEFAULT_RM_MAX_LENGTH == rm.max_length
    assert arguments.DEFAULT_RM_MICRO_BATCH_SIZE == rm.micro_batch_size
    assert arguments.DEFAULT_RM_WEIGHT == rm.weight


def test_meshrl_reward_serve_applies_the_server_modules_flags(tmp_path):
    """Before: --reward-model, --memory-limit-mb and --max-calls were refused by `meshrl
    reward serve`, though `python -m services.reward.server` takes them."""
    rm = make_tiny_reward_model_dir(tmp_path / "rm")
    fn = tmp_path / "rlimit.py"
    fn.write_text(RLIMIT_SCORER)
    port = free_port()
    argv = ["reward", "serve", "--port", str(port), "--num-workers", "1", "--timeout-s", "30"]
    argv += ["--custom-function", f"{fn}:score", "--reward-model", str(rm)]
    argv += ["--memory-limit-mb", "3000", "--max-calls", "1", "--reward-model-weight", "0.5"]
    argv += ["--reward-model-max-length", "64", "--reward-model-micro-batch-size", "2"]
    assert cli.build_parser().parse_args(argv).max_calls == 1
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            MESHRL + argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=os.environ
        )
    try:
        wait_for_health(
            f"127.0.0.1:{port}", SERVICE_NAME, timeout_s=120, alive=lambda: proc.poll() is None
        )
        with RewardClient(f"127.0.0.1:{port}", timeout_s=60) as client:
            info = client.info()
            [outcome] = client.score([ScoreItem("my/set", "an answer", "gt", "a prompt")])
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(30)
    assert info.model_path == str(rm) and info.num_parameters > 0, log.read_text()
    assert outcome.ok and outcome.extra["limit_mb"] == 3000 and "rm_score" in outcome.extra
    # the custom function scores 0: the score is the model's, weighed by --reward-model-weight
    assert outcome.score == pytest.approx(0.5 * outcome.extra["rm_score"])
    assert exit_code == 0, log.read_text()


BAD_FUNCTIONS = {
    "a missing file": ("nope.py", "reward.custom_function: file nope.py does not exist"),
    "a syntax error": ("syntax.py:score", "SyntaxError: invalid syntax (syntax.py, line 1)"),
    "a missing name": ("fine.py:missing", "fine.py has no function 'missing'; callables there"),
}


def start_with_custom_function(command: list[str], cwd: Path, spec: str):
    (cwd / "syntax.py").write_text("def score(:\n")
    (cwd / "fine.py").write_text("def score(data_source, response, ground_truth, extra):\n  pass\n")
    argv = [*command, "--port", "0", "--num-workers", "1", "--custom-function", spec]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # run from `cwd`, where the files are
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("case", BAD_FUNCTIONS)
def test_a_custom_function_that_cannot_be_loaded_is_one_line_and_exit_2(tmp_path, case):
    """Before: two stacked tracebacks (the worker's RemoteTraceback, then the main one) ending
    in the message, exit 1."""
    spec, message = BAD_FUNCTIONS[case]
    done = start_with_custom_function([*MESHRL, "reward", "serve"], tmp_path, spec)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [error] = [line for line in done.stderr.splitlines() if line.startswith("meshrl: ")]
    assert message in error


def test_the_server_module_ends_the_same_way(tmp_path):
    spec, message = BAD_FUNCTIONS["a missing file"]
    done = start_with_custom_function(SERVER_MODULE, tmp_path, spec)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [error] = [line for line in done.stderr.splitlines() if line.startswith("meshrl: ")]
    assert message in error


def test_the_reward_model_flags_set_its_config_and_are_refused_without_one(tmp_path):
    """Before, `meshrl reward serve` could not set the reward model's max_length,
    micro_batch_size or weight: a run sends them by Initialize, a server alone kept the
    defaults."""
    from services.reward.arguments import reward_config, reward_model_settings

    argv = ["reward", "serve", "--reward-model", str(tmp_path), "--reward-model-weight", "-2"]
    args = cli.build_parser().parse_args([*argv, "--reward-model-max-length", "512"])
    settings = reward_model_settings(args)
    assert settings == {"max_length": 512, "weight": -2.0}  # micro_batch_size: not given
    rm = reward_config(reward_model_path=str(tmp_path), reward_model_settings=settings).reward_model
    assert (rm.enable, rm.max_length, rm.micro_batch_size, rm.weight) == (True, 512, 16, -2.0)
    with pytest.raises(
        ValueError, match="--reward-model-max-length, --reward-model-weight need --reward-model"
    ):
        reward_config(reward_model_settings=settings)


def test_a_reward_model_flag_without_a_reward_model_is_one_line_and_exit_2(tmp_path):
    argv = [*MESHRL, "reward", "serve", "--port", "0", "--reward-model-micro-batch-size", "4"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [error] = [line for line in done.stderr.splitlines() if line.startswith("meshrl: ")]
    assert "--reward-model-micro-batch-size needs --reward-model DIR" in error


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--reward-model-max-length", "0", "must be at least 1, got 0"),
        ("--reward-model-micro-batch-size", "two", "must be a whole number, got 'two'"),
        ("--reward-model-weight", "nan", "must be a finite number, got nan"),
    ],
)
def test_a_bad_reward_model_setting_is_refused_by_the_parser(capsys, flag, value, says):
    with pytest.raises(SystemExit) as done:
        cli.main(["reward", "serve", flag, value])
    assert done.value.code == 2
    assert f"argument {flag}: {says}" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["reward", "serve"], ["serve", "reward"]])
def test_a_port_out_of_range_is_refused(capsys, command):
    from meshrl_app import cli

    with pytest.raises(SystemExit) as done:
        cli.main([*command, "--port", "99999"])
    assert done.value.code == 2
    assert "argument --port: must be 0 to 65535, got 99999" in capsys.readouterr().err


def test_an_error_after_the_start_up_is_not_called_a_start_up_error(monkeypatch):
    """Only the start-up's ValueError / OSError become the one-line exit 2; before, an error
    of a server already serving (a closed stdout at its ready line) was one too."""
    from meshrl.config import ConfigError
    from services.reward import server as server_module

    with pytest.raises(ConfigError, match="no such file"), server_module.start_up_errors():
        raise FileNotFoundError("no such file")
    monkeypatch.setattr(server_module, "start_scorer", lambda *a: _raise(BrokenPipeError()))
    with pytest.raises(ConfigError):  # still the start-up: building the scorer
        server_module.serve(port=0, num_workers=1)

    class ServingFails:
        def wait(self, *a):
            raise BrokenPipeError("stdout closed")  # after the start-up

    monkeypatch.setattr(server_module, "start_scorer", lambda *a: "a scorer")
    monkeypatch.setattr(server_module.RewardServicer, "swap", lambda self, s: None)
    monkeypatch.setattr(server_module, "StopSignal", ServingFails)
    with pytest.raises(BrokenPipeError):
        server_module.serve(port=0, num_workers=1)


def _raise(error: BaseException):
    raise error


@pytest.mark.parametrize(
    "argv",
    [
        ["reward", "serve", "--custom-function", "my.py:score"],
        ["serve", "reward", "--custom-function", "my.py:score"],
        ["-v", "serve", "reward", "--custom-function", "my.py:score"],
    ],
)
def test_serve_reward_is_reward_serve_with_its_arguments_and_defaults(monkeypatch, argv):
    """Before, `meshrl serve reward` took no --custom-function or --reward-model and
    listened on any free port, where `meshrl reward serve` listens on 50055 (the reward
    server's port in the mesh's defaults; it was 50051, rollout's, while the docs said
    50053, the critic's)."""
    from meshrl_app import cli
    from services.reward import server as server_module

    served = []
    monkeypatch.setattr(server_module, "serve_from_args", served.append)
    assert cli.main(argv) == 0
    (args,) = served
    assert (args.host, args.port, args.custom_function) == ("127.0.0.1", 50055, "my.py:score")


def test_serve_reward_after_its_options_serves_on_the_port_given(monkeypatch):
    from meshrl_app import cli
    from services.reward import server as server_module

    served = []
    monkeypatch.setattr(server_module, "serve_from_args", served.append)
    assert cli.main(["serve", "--port", "5305", "reward"]) == 0
    assert served[0].port == 5305 and served[0].num_workers is not None


def test_the_reward_servers_default_port_is_the_one_the_docs_and_the_mesh_use():
    from services.reward.arguments import DEFAULT_PORT

    root = Path(__file__).resolve().parents[2]
    assert "MESHRL_REWARD_PORT:-50055" in (root / "deploy/compose.yaml").read_text()
    for doc in ("docs/running.md", "docs/reward.md"):
        text = (root / doc).read_text()
        ports = set(re.findall(r"reward (?:serve|\.server) --port (\d+)", text))
        ports |= set(re.findall(r'RewardClient\("127\.0\.0\.1:(\d+)"', text))
        ports |= set(re.findall(r"--server 127\.0\.0\.1:(\d+)", text))
        ports |= set(re.findall(r"reward service alone, port (\d+)", text))
        assert ports == {str(DEFAULT_PORT)}, (doc, ports)
    assert f"`--port` defaults to {DEFAULT_PORT}" in (root / "docs/reward.md").read_text()
