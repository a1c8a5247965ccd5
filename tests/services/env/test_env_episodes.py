"""The episode table: many episodes at once, each step under a time limit; a step that
hangs or raises ends its own episode with an error, never the call or the others."""

import threading
import time

import pytest

from services.env.arithmetic_chain import ArithmeticChainEnv
from services.env.episodes import EpisodeTable, UnknownEnvironment
from services.env.types import EnvReply, EpisodeAction, EpisodeTask, ToolCall


class ScriptedEnv:
    """Answers "ok" to a turn, hangs on "hang", raises on "crash"."""

    name = "scripted"
    tools: list = []

    def __init__(self):
        self.release = threading.Event()

    def start(self, task):
        return {"turns": 0}

    def step(self, state, action):
        if action.text == "hang":
            self.release.wait(30)
        if action.text == "crash":
            raise RuntimeError("the tool blew up")
        state["turns"] += 1
        return EnvReply(f"ok {state['turns']}", reward=0.5, done=action.text == "done")


@pytest.fixture
def table():
    env = ScriptedEnv()
    table = EpisodeTable(
        {"scripted": env, "arithmetic_chain": ArithmeticChainEnv()},
        encode=lambda text: [ord(c) for c in text],
        default_timeout_s=0.5,
    )
    yield table
    env.release.set()
    table.shutdown()


def _start(table, count, env="scripted"):
    return [s.episode_id for s in table.reset([EpisodeTask(env) for _ in range(count)])]


def test_episodes_step_side_by_side_with_tokens_of_their_observations(table):
    a, b = _start(table, 2)
    results = table.step([EpisodeAction(a, "go"), EpisodeAction(b, "done")])
    assert [r.episode_id for r in results] == [a, b]
    assert results[0].observation_text == "ok 1"
    assert results[0].observation_ids == [ord(c) for c in "ok 1"]
    assert (results[0].reward, results[0].done, results[0].error) == (0.5, False, "")
    assert results[1].done and len(table) == 1  # a finished episode is dropped


def test_a_step_that_hangs_ends_its_episode_alone(table):
    slow, fine = _start(table, 2)
    t0 = time.monotonic()
    hung, ok = table.step([EpisodeAction(slow, "hang"), EpisodeAction(fine, "go")])
    assert time.monotonic() - t0 < 5
    assert hung.done and hung.error == "the environment's step ran past its limit of 0.5s"
    assert ok.error == "" and ok.observation_text == "ok 1" and not ok.done
    assert len(table) == 1  # the hung episode is closed


def test_a_step_that_raises_ends_its_episode_with_the_reason(table):
    bad, fine = _start(table, 2)
    crashed, ok = table.step([EpisodeAction(bad, "crash"), EpisodeAction(fine, "go")])
    assert crashed.done
    assert crashed.error == "scripted step failed: RuntimeError: the tool blew up"
    assert not ok.done and ok.error == ""


def test_an_unknown_episode_or_environment_is_said_so(table):
    (result,) = table.step([EpisodeAction("nope", "go")])
    assert result.done and result.error == "no open episode with this id"
    with pytest.raises(UnknownEnvironment, match="no environment named 'chess'"):
        table.reset([EpisodeTask("chess")])


def test_close_drops_open_episodes(table):
    ids = _start(table, 3)
    assert table.close(ids[:2] + ["unknown"]) == 2
    assert len(table) == 1


def test_the_arithmetic_chain_takes_a_turn_per_question(table):
    kwargs = {"answers": [42, 126, 117], "questions": ["Now times 3.", "Now minus 9."]}
    task = EpisodeTask("arithmetic_chain", "117", {"interaction_kwargs": kwargs})
    (started,) = table.reset([task])
    ep = started.episode_id
    first = table.step([EpisodeAction(ep, "17+25=42")])[0]
    assert (first.observation_text, first.reward, first.done) == (
        "\nRight. Now times 3.\n",
        1 / 3,
        False,
    )
    second = table.step([EpisodeAction(ep, "I think 100")])[0]
    assert second.observation_text == "\nWrong, it is 126. Now minus 9.\n"
    assert (second.reward, second.done) == (0.0, False)
    third = table.step([EpisodeAction(ep, "#### 117")])[0]
    assert (third.observation_text, third.reward, third.done) == ("", 1 / 3, True)


def test_a_chain_without_its_questions_is_refused_at_reset(table):
    task = EpisodeTask("arithmetic_chain", "1", {"interaction_kwargs": {"answers": [1, 2]}})
    with pytest.raises(ValueError, match="needs answers .* and questions .*got 2 and 0"):
        table.reset([task])


def test_a_tool_call_reaches_the_environment(table):
    class Echo(ScriptedEnv):
        def step(self, state, action):
            return EnvReply(",".join(f"{c.name}{c.arguments}" for c in action.tool_calls))

    table.environments["echo"] = Echo()
    (ep,) = _start(table, 1, "echo")
    call = ToolCall("calculator", {"expression": "1+1"})
    (result,) = table.step([EpisodeAction(ep, "...", [call])])
    assert result.observation_text == "calculator{'expression': '1+1'}"
