"""The multi-turn rollout: the model's turns alternate with an environment's observations.

    reset an episode per sample
    repeat up to multi_turn.max_assistant_turns:
        generate a turn for every open episode (its prompt and everything so far)
        cut the turn after its first tool call (tool_calls.py)
        step the environment with it -> observation tokens, reward, done
        append the observation's tokens

The trained sequence is built from token ids alone, never from text: the sampled tokens as
the engine returned them, then the observation's ids as the environment server returned
them, and so on, so what the trainer sees is, token for token, what was sampled plus what
was observed (no chat template re-renders the history). The observation tokens carry a
loss mask of 0 and log-prob 0; each step's reward is placed on the last token of the turn
that caused it. The whole episode stays within ``data.max_response_length`` tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from meshrl.config import ConfigError
from meshrl.config.sections import MultiTurnConfig
from meshrl.ragged import Ragged
from services.coordinator.generation.generated import GeneratedBatch
from services.coordinator.generation.tool_calls import parse_tool_calls, tokens_through_first_call
from services.env.client import EnvClient
from services.env.types import EpisodeAction, EpisodeTask
from services.rollout.types import FinishReason, GenerationResult, SamplingParams

log = logging.getLogger(__name__)

TURN_SEED_STRIDE = 7_919
"""Seed distance between the turns of one generation batch (each turn samples afresh)."""


@dataclass
class Episode:
    """One sample's response as it grows: the model's turns and the observations."""

    row: int
    """The sample's row in the batch."""
    episode_id: str
    budget: int
    """Response tokens it may hold at most (data.max_response_length)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """1 on the model's tokens, 0 on the observations'."""
    rewards: list[float] = field(default_factory=list)
    """Environment rewards, on the last token of the turn that earned them."""
    turns: int = 0
    tool_calls: int = 0
    done: bool = False
    finish_reason: FinishReason = "length"
    error: str = ""
    env_open: bool = True
    """The env server still holds the episode (it has not said done): closed at the end."""

    @property
    def room(self) -> int:
        return self.budget - len(self.tokens)

    def add(self, ids: list[int], logprobs: list[float], model: bool) -> None:
        self.tokens += ids
        self.logprobs += logprobs
        self.loss_mask += [int(model)] * len(ids)
        self.rewards += [0.0] * len(ids)


Generate = Callable[[Ragged, SamplingParams], GenerationResult]


class MultiTurnRollout:
    """Runs the episodes of a generation batch through the rollout pool and the env server."""

    def __init__(self, cfg: MultiTurnConfig, env: EnvClient, generate: Generate, tokenizer):
        self.cfg = cfg
        self.env = env
        self.generate_turns = generate
        self.tokenizer = tokenizer
        self.turn_limit = cfg.max_turn_tokens or 2**31 - 1  # None: the episode's budget

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, records: list, sampling: SamplingParams) -> GeneratedBatch:
        """B records x ``sampling.n`` episodes -> their batch (rows as ``PPOStep.generate``
        lays them out), with the rollout's ``multi_turn/*`` metrics."""
        n = sampling.n
        rows = [i for i in range(len(records)) for _ in range(n)]
        seed = sampling.seed or 0
        tasks = [
            EpisodeTask(
                self.cfg.environment,
                records[i].ground_truth,
                records[i].extra_info,
                seed=seed + k,
            )
            for k, i in enumerate(rows)
        ]
        started = self.env.reset(tasks)
        episodes = [Episode(k, s.episode_id, sampling.max_tokens) for k, s in enumerate(started)]
        prompts = [list(records[i].prompt_ids) for i in rows]
        weight_version = -1
        try:
            for turn in range(self.cfg.max_assistant_turns):
                open_ = [e for e in episodes if not e.done]
                if not open_:
                    break
                actions = []
                # One request per token cap: a context and its new tokens must stay within
                # the engine's max_model_len, so no episode may be given another's room.
                for cap, group in self.by_cap(open_):
                    turn_sampling = replace(
                        sampling,
                        n=1,
                        max_tokens=cap,
                        seed=None
                        if sampling.seed is None
                        else seed + turn * TURN_SEED_STRIDE + cap,
                    )
                    contexts = Ragged.from_lists([prompts[e.row] + e.tokens for e in group])
                    out = self.generate_turns(contexts, turn_sampling)
                    weight_version = out.weight_version
                    actions += self.take_turns(group, out, turn + 1)
                self.step(actions)
        finally:  # episodes the budgets ended, or all of them after a failure
            left_open = [e.episode_id for e in episodes if e.env_open]
            if left_open:
                self.env.close_episodes(left_open)
        return self.batch(records, rows, episodes, weight_version)

    def by_cap(self, episodes: list[Episode]) -> list[tuple[int, list[Episode]]]:
        """The open episodes grouped by the tokens their next turn may take: their room,
        at most ``max_turn_tokens`` (most share the turn limit: one group)."""
        groups: dict[int, list[Episode]] = {}
        for e in episodes:
            groups.setdefault(min(e.room, self.turn_limit), []).append(e)
        return sorted(groups.items(), key=lambda item: -item[0])

    def take_turns(
        self, episodes: list[Episode], out: GenerationResult, turn: int
    ) -> list[tuple[Episode, EpisodeAction]]:
        """Appends each episode's sampled turn (cut after its first tool call, and to its
        room); the actions of those that go on to an environment step."""
        actions = []
        for e, ids_t, lp_t, reason in zip(
            episodes,
            out.responses.tolist(),
            out.logprobs.tolist(),
            out.finish_reasons,
            strict=True,
        ):
            keep = min(tokens_through_first_call(ids_t, self.decode), e.room)
            ids, logprobs = ids_t[:keep], lp_t[:keep]
            e.add(ids, logprobs, model=True)
            e.turns = turn
            if keep < len(ids_t) and e.room == 0:  # cut by the budget, not by a call
                reason = "length"
            text = self.decode(ids)
            calls, parse_error = parse_tool_calls(text)
            e.tool_calls += len(calls)
            if e.room == 0 and reason == "length":
                e.done, e.finish_reason = True, "length"
                continue
            actions.append((e, EpisodeAction(e.episode_id, text, calls, parse_error)))
        return actions

    def step(self, actions: list[tuple[Episode, EpisodeAction]]) -> None:
        """The environment's answers: rewards on the turns' last tokens, observations
        appended where they fit, episodes ended where it says so (or it failed)."""
        if not actions:
            return
        results = self.env.step([a for _, a in actions], self.cfg.step_timeout_s)
        for (e, _), result in zip(actions, results, strict=True):
            e.rewards[-1] += result.reward
            e.env_open = not (result.done or result.error)
            if result.error:
                e.done, e.finish_reason, e.error = True, "stop", result.error
                log.warning("an episode ended with an environment error: %s", result.error)
            elif result.done:
                e.done, e.finish_reason = True, "stop"
            elif len(result.observation_ids) >= e.room or e.turns >= self.cfg.max_assistant_turns:
                # no room for the observation and a token after it, or no turn left
                e.done, e.finish_reason = True, "length"
            else:
                ids = list(result.observation_ids)
                e.add(ids, [0.0] * len(ids), model=False)

    def batch(
        self, records: list, rows: list[int], episodes: list[Episode], weight_version: int
    ) -> GeneratedBatch:
        prompts = Ragged.from_lists([records[i].prompt_ids for i in rows])
        responses = Ragged.from_lists([e.tokens for e in episodes], dtype=torch.int64)
        return GeneratedBatch(
            prompts=prompts,
            responses=responses,
            rollout_logprobs=Ragged.from_lists([e.logprobs for e in episodes], torch.float32),
            finish_reasons=[e.finish_reason for e in episodes],
            group_ids=torch.tensor(rows, dtype=torch.int64),
            data_sources=[records[i].data_source for i in rows],
            ground_truths=[records[i].ground_truth for i in rows],
            extra_infos=[records[i].extra_info for i in rows],
            weight_version=weight_version,
            chats=[records[i].chat for i in rows],
            loss_mask=Ragged.from_lists([e.loss_mask for e in episodes], torch.uint8),
            turn_rewards=Ragged.from_lists([e.rewards for e in episodes], torch.float32),
            rollout_metrics=self.metrics(episodes),
        )

    @staticmethod
    def metrics(episodes: list[Episode]) -> dict[str, float]:
        count = max(len(episodes), 1)
        observed = [len(e.tokens) - sum(e.loss_mask) for e in episodes]
        return {
            "multi_turn/turns/mean": sum(e.turns for e in episodes) / count,
            "multi_turn/turns/max": float(max((e.turns for e in episodes), default=0)),
            "multi_turn/tool_calls/mean": sum(e.tool_calls for e in episodes) / count,
            "multi_turn/observation_tokens/mean": sum(observed) / count,
            "multi_turn/env_reward/mean": sum(sum(e.rewards) for e in episodes) / count,
            "multi_turn/env_errors": float(sum(bool(e.error) for e in episodes)),
        }


def multi_turn_rollout(
    cfg: MultiTurnConfig, env: EnvClient | None, generate: Generate, tokenizer
) -> MultiTurnRollout | None:
    """The run's multi-turn rollout, or None for single-turn runs (``multi_turn.enable``
    off); an enabled one needs the env server's client."""
    if not cfg.enable:
        return None
    if env is None:  # a launcher that starts none (Ray)
        raise ConfigError(
            "actor_rollout_ref.rollout.multi_turn.enable: this run has no env server; use "
            "the local launcher, or launcher.kind=external with launcher.addresses.env"
        )
    return MultiTurnRollout(cfg, env, generate, tokenizer)
