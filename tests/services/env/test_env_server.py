"""The environment service over gRPC: Reset, Step and Close through the typed client, the
calculator's calls in the sandbox, observations as the run tokenizer's ids; and the server
as its own process (`python -m services.env.server`)."""

import subprocess
import sys
from pathlib import Path

import pytest

from meshrl.api.v1 import env_pb2_grpc
from meshrl.config import build_config, config_to_yaml
from meshrl.launcher.ports import free_port
from meshrl.rpc.client import wait_for_health
from meshrl.rpc.role_client import RoleCallError
from meshrl.rpc.server import GrpcServer
from meshrl.testing.char_tokenizer import PRINTABLE_CHARS, build_char_tokenizer
from meshrl.testing.tiny_model import make_tiny_model_dir
from services.env.client import EnvClient
from services.env.sandbox import Sandbox
from services.env.server import SERVICE_NAME, EnvServicer
from services.env.types import EpisodeAction, EpisodeTask, ToolCall

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    return make_tiny_model_dir(path, chars=PRINTABLE_CHARS, hidden=32, intermediate=64)


@pytest.fixture(scope="module")
def env(model_dir):
    sandbox = Sandbox(num_workers=1, memory_limit_mb=256)
    server = GrpcServer(SERVICE_NAME, "127.0.0.1", 0, name="env server")
    servicer = EnvServicer(sandbox, tool_timeout_s=1.0, step_timeout_s=10.0)
    server.add(env_pb2_grpc.add_EnvServiceServicer_to_server, servicer)
    server.start()
    server.mark_ready()
    client = EnvClient(f"127.0.0.1:{server.port}", timeout_s=60)
    cfg = build_config(
        {},
        [
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.tool_timeout_s=1",
        ],
    )
    info = client.initialize(config_to_yaml(cfg))
    assert info.service == "env" and info.ready and info.model_path == str(model_dir)
    yield client
    client.close()
    server.stop()
    sandbox.close()


def test_the_environments_and_their_tools_are_listed(env):
    specs = {s.name: s for s in env.environments()}
    assert set(specs) == {"calculator", "arithmetic_chain"}
    (tool,) = specs["calculator"].tools
    assert tool.name == "calculator" and tool.parameters["required"] == ["expression"]


def test_a_calculator_episode_over_grpc(env):
    (started,) = env.reset([EpisodeTask("calculator", ground_truth="79")])
    assert [t.name for t in started.tools] == ["calculator"]
    call = ToolCall("calculator", {"expression": "(48 / 2) * 3 + 7"})
    (result,) = env.step([EpisodeAction(started.episode_id, "<tool_call>...", [call])])
    text = "\n<tool_response>\n79\n</tool_response>\n"
    assert result.observation_text == text and not result.done and result.error == ""
    assert result.observation_ids == build_char_tokenizer(PRINTABLE_CHARS).encode(
        text, add_special_tokens=False
    )
    (final,) = env.step([EpisodeAction(started.episode_id, "#### 79")])
    assert final.done and final.observation_ids == [] and final.error == ""


def test_a_tool_call_that_hangs_answers_an_error_and_the_episode_goes_on(env):
    (started,) = env.reset([EpisodeTask("calculator")])
    hang = ToolCall("calculator", {"expression": "((9 ** 999) ** 999) ** 999"})
    (result,) = env.step([EpisodeAction(started.episode_id, "", [hang])])
    assert "error: " in result.observation_text and not result.done
    ok = ToolCall("calculator", {"expression": "2+2"})
    (after,) = env.step([EpisodeAction(started.episode_id, "", [ok])])
    assert "\n4\n" in after.observation_text


def test_a_bad_tool_call_is_answered_not_failed(env):
    (started,) = env.reset([EpisodeTask("calculator")])
    wrong_name = ToolCall("search", {"query": "x"})
    (result,) = env.step([EpisodeAction(started.episode_id, "", [wrong_name])])
    assert "error: no tool named 'search'" in result.observation_text
    unreadable = EpisodeAction(started.episode_id, "<tool_call>{", parse_error="bad JSON")
    (result,) = env.step([unreadable])
    assert "error: bad JSON" in result.observation_text and not result.done


def test_a_result_python_cannot_write_out_is_answered_not_failed(env):
    """(999**999)**2 is an int of 5,992 digits, past Python's limit for str() of an int:
    the tool answers why, and the episode goes on (it used to fail the whole env step)."""
    (started,) = env.reset([EpisodeTask("calculator")])
    huge = ToolCall("calculator", {"expression": "(999**999)*(999**999)"})
    (result,) = env.step([EpisodeAction(started.episode_id, "", [huge])])
    assert "error: the result cannot be written out (Exceeds the limit" in result.observation_text
    assert not result.done
    small = ToolCall("calculator", {"expression": "6*7"})
    (result,) = env.step([EpisodeAction(started.episode_id, "", [small])])
    assert "42" in result.observation_text


def test_an_unknown_environment_fails_the_reset(env):
    with pytest.raises(RoleCallError, match="INVALID_ARGUMENT.*no environment named 'chess'"):
        env.reset([EpisodeTask("chess")])


def test_close_drops_episodes_left_open(env):
    started = env.reset([EpisodeTask("calculator"), EpisodeTask("calculator")])
    assert env.close_episodes([s.episode_id for s in started]) == 2
    assert env.close_episodes([]) == 0


@pytest.mark.slow
def test_the_server_runs_as_its_own_process(tmp_path):
    port = free_port()
    log = (tmp_path / "env.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.env.server", "--port", str(port), "--tool-workers", "1"],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_health(f"127.0.0.1:{port}", SERVICE_NAME, 60)
        with EnvClient(f"127.0.0.1:{port}", 30) as client:
            (started,) = client.reset([EpisodeTask("calculator")])
            call = ToolCall("calculator", {"expression": "6*7"})
            (result,) = client.step([EpisodeAction(started.episode_id, "", [call])])
            assert "\n42\n" in result.observation_text and result.observation_ids == []
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
