"""The multi-turn rollout against a scripted engine and a real episode table: the batch's
responses are, token for token, the sampled turns and the observations' ids; the loss mask
is 1 exactly on the sampled tokens; rewards sit on the last token of the turn that earned
them; budgets of turns and tokens hold; an environment that fails costs its episode alone."""

import pytest
import torch

from meshrl.config import ConfigError
from meshrl.config.sections import MultiTurnConfig
from meshrl.data.dataset import PromptRecord
from meshrl.ragged import Ragged
from services.coordinator.generation.multi_turn import MultiTurnRollout, multi_turn_rollout
from services.env.episodes import EpisodeTable
from services.env.types import EnvReply
from services.rollout.types import GenerationResult, SamplingParams


def _encode(text):
    return [ord(c) for c in text]


class Tokens:
    """A tokenizer of one id per character (ord)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class TableClient:
    """The env client's calls, answered by an episode table in this process."""

    def __init__(self, table):
        self.table = table
        self.closed = []

    def reset(self, tasks):
        return self.table.reset(tasks)

    def step(self, actions, step_timeout_s=0.0):
        return self.table.step(actions, step_timeout_s or None)

    def close_episodes(self, ids):
        self.closed += ids
        return self.table.close(ids)


class ScriptedEngine:
    """Generates, for each context, the next text of a script chosen by the context's
    first token; records every call (what the engine sampled, with its log-probs)."""

    def __init__(self, scripts, max_model_len=3 + 64):
        self.scripts = scripts  # first prompt token -> list of turn texts
        self.calls = []
        self.max_model_len = max_model_len  # prompt (3) + the response budget, as rollout's

    def __call__(self, contexts: Ragged, sampling: SamplingParams) -> GenerationResult:
        rows, lps, reasons = [], [], []
        for ctx in contexts.tolist():
            # what a rollout server refuses (INVALID_ARGUMENT)
            assert len(ctx) + sampling.max_tokens <= self.max_model_len
            turns = self.scripts[ctx[0]]
            text = turns[min(self._turn(ctx), len(turns) - 1)]
            ids = _encode(text)[: sampling.max_tokens]
            rows.append(ids)
            lps.append([-0.25 * (k + 1) for k in range(len(ids))])  # exact in float32
            reasons.append("length" if len(ids) < len(text) else "stop")
        out = GenerationResult(
            Ragged.from_lists(rows, torch.int64),
            Ragged.from_lists(lps, torch.float32),
            reasons,
            weight_version=3,
        )
        self.calls.append((contexts.tolist(), rows, lps))
        return out

    def _turn(self, ctx):
        return sum(1 for c in ctx if c == ord("|"))  # each observation holds one "|"


class CalcLike:
    """Answers a turn holding "CALL" with an observation, ends a turn without it, raises on
    "BOOM" (served under the calculator's name)."""

    name = "calculator"
    tools: list = []

    def start(self, task):
        return None

    def step(self, state, action):
        if "CALL" in action.text:
            return EnvReply("<obs|>", reward=0.25)
        if "BOOM" in action.text:
            raise RuntimeError("tool crashed")
        return EnvReply("", reward=0.0, done=True)


def _records(first_tokens):
    return [
        PromptRecord(i, [t, 1, 2], "p", "openai/gsm8k", "7", {"index": i})
        for i, t in enumerate(first_tokens)
    ]


def _rollout(scripts, cfg=None):
    table = EpisodeTable({"calculator": CalcLike()}, _encode)
    client = TableClient(table)
    engine = ScriptedEngine(scripts)
    cfg = cfg or MultiTurnConfig(enable=True, max_assistant_turns=4)
    return MultiTurnRollout(cfg, client, engine, Tokens()), engine, client


def _sampling(max_tokens=64, n=1):
    return SamplingParams(max_tokens=max_tokens, n=n, seed=5)


def test_the_trained_sequence_is_the_sampled_turns_and_the_observations():
    rollout, engine, _ = _rollout({10: ["aCALLb", "cCALL", "final"], 11: ["only"]})
    batch = rollout.generate(_records([10, 11]), _sampling())
    obs = _encode("<obs|>")
    # row 0: three turns, two observations between them; row 1: one turn
    expected = _encode("aCALLb") + obs + _encode("cCALL") + obs + _encode("final")
    assert batch.responses.tolist() == [expected, _encode("only")]
    # token for token what the engine returned, turn by turn, with its log-probs
    sampled = [rows[0] for _, rows, _ in engine.calls]
    assert sampled == [_encode("aCALLb"), _encode("cCALL"), _encode("final")]
    model = [1] * 6 + [0] * len(obs) + [1] * 5 + [0] * len(obs) + [1] * 5
    assert batch.loss_mask.tolist() == [model, [1] * 4]
    lp = batch.rollout_logprobs.tolist()[0]
    assert lp[:6] == engine.calls[0][2][0] and lp[6 : 6 + len(obs)] == [0.0] * len(obs)
    # each turn's context is the prompt and the response so far, never re-tokenized
    assert engine.calls[1][0] == [[10, 1, 2, *_encode("aCALLb"), *obs]]
    # rewards of the two tool steps on the last token of their turns
    rewards = batch.turn_rewards.tolist()[0]
    assert [i for i, r in enumerate(rewards) if r] == [5, 6 + len(obs) + 4]
    assert sum(rewards) == 0.5
    assert batch.finish_reasons == ["stop", "stop"]
    assert batch.weight_version == 3
    assert batch.rollout_metrics["multi_turn/turns/mean"] == 2.0
    assert batch.rollout_metrics["multi_turn/env_errors"] == 0.0


def test_the_response_mask_covers_exactly_the_model_tokens():
    rollout, _, _ = _rollout({10: ["aCALL", "end"]})
    batch = rollout.generate(_records([10]), _sampling())
    mask = batch.response_mask()
    obs = len("<obs|>")
    assert mask.tolist() == [[1.0] * 5 + [0.0] * obs + [1.0] * 3]


def test_the_token_budget_ends_an_episode():
    rollout, _, client = _rollout({10: ["aCALL", "bCALL", "cCALL"]})
    batch = rollout.generate(_records([10]), _sampling(max_tokens=14))
    (response,) = batch.responses.tolist()
    # 5 + 6 observation + 3 of the second turn (cut to the budget), no observation after
    assert len(response) == 14 and batch.finish_reasons == ["length"]
    assert response[-3:] == _encode("bCA")
    assert len(client.table) == 0  # closed


def test_episodes_of_different_lengths_are_never_given_more_than_their_room():
    # row 0 writes long turns, row 1 short ones: in turn 2 their rooms differ, and each is
    # asked for no more than its own (a rollout server refuses a context + max_tokens past
    # max_model_len)
    rollout, engine, _ = _rollout({10: ["a" * 40 + "CALL", "b" * 30], 11: ["xCALL", "yCALL", "z"]})
    batch = rollout.generate(_records([10, 11]), _sampling(max_tokens=64))
    long_row, short_row = batch.responses.tolist()
    assert len(long_row) == 64 and batch.finish_reasons[0] == "length"
    assert short_row[-1] == ord("z") and batch.finish_reasons[1] == "stop"
    assert len(engine.calls) > 3  # turn 2 took two requests, one per room


def test_the_turn_budget_ends_an_episode():
    cfg = MultiTurnConfig(enable=True, max_assistant_turns=2)
    rollout, engine, client = _rollout({10: ["aCALL"] * 5}, cfg)
    batch = rollout.generate(_records([10]), _sampling())
    assert len(engine.calls) == 2 and batch.finish_reasons == ["length"]
    # the second turn's observation is not appended: no turn is left to read it
    assert batch.loss_mask.tolist()[0][-5:] == [1] * 5
    assert len(client.table) == 0


def test_an_environment_that_fails_ends_that_episode_alone():
    rollout, _, _ = _rollout({10: ["BOOM"], 11: ["aCALL", "fine"]})
    batch = rollout.generate(_records([10, 11]), _sampling())
    assert batch.responses.tolist()[0] == _encode("BOOM")
    assert batch.responses.tolist()[1][-4:] == _encode("fine")
    assert batch.rollout_metrics["multi_turn/env_errors"] == 1.0


def test_n_samples_a_prompt_are_grouped_as_single_turn_batches_are():
    rollout, _, _ = _rollout({10: ["x"], 11: ["y"]})
    batch = rollout.generate(_records([10, 11]), _sampling(n=2))
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.responses.tolist() == [_encode("x")] * 2 + [_encode("y")] * 2


def test_a_multi_turn_run_without_an_env_server_is_refused():
    cfg = MultiTurnConfig(enable=True)
    with pytest.raises(ConfigError, match="multi_turn.enable: this run has no env server"):
        multi_turn_rollout(cfg, None, ScriptedEngine({}), Tokens())
    assert multi_turn_rollout(MultiTurnConfig(), None, ScriptedEngine({}), Tokens()) is None
