"""Proto <-> typed containers of the environment API, used by the server and the client."""

from __future__ import annotations

import json
from typing import Any

import torch

from meshrl.api.v1 import env_pb2
from meshrl.ragged import Ragged
from meshrl.wire import ragged_from_proto, ragged_to_proto
from services.env.types import (
    EnvironmentSpec,
    EpisodeAction,
    EpisodeStarted,
    EpisodeTask,
    StepResult,
    ToolCall,
    ToolSpec,
)


def _json_object(text: str, what: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{what} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a JSON object")
    return value


def tool_to_proto(tool: ToolSpec) -> env_pb2.ToolSpec:
    return env_pb2.ToolSpec(
        name=tool.name, description=tool.description, parameters_json=json.dumps(tool.parameters)
    )


def tool_from_proto(msg: env_pb2.ToolSpec) -> ToolSpec:
    params = _json_object(msg.parameters_json, f"parameters of tool {msg.name!r}")
    return ToolSpec(msg.name, msg.description, params)


def spec_to_proto(spec: EnvironmentSpec) -> env_pb2.EnvironmentSpec:
    return env_pb2.EnvironmentSpec(name=spec.name, tools=[tool_to_proto(t) for t in spec.tools])


def spec_from_proto(msg: env_pb2.EnvironmentSpec) -> EnvironmentSpec:
    return EnvironmentSpec(msg.name, [tool_from_proto(t) for t in msg.tools])


def task_to_proto(task: EpisodeTask) -> env_pb2.EpisodeTask:
    return env_pb2.EpisodeTask(
        environment=task.environment,
        ground_truth=task.ground_truth,
        extra_info_json=json.dumps(task.extra_info, default=str) if task.extra_info else "",
        seed=task.seed,
    )


def task_from_proto(msg: env_pb2.EpisodeTask) -> EpisodeTask:
    extra = _json_object(msg.extra_info_json, f"extra_info_json of a {msg.environment!r} task")
    return EpisodeTask(msg.environment, msg.ground_truth, extra, msg.seed)


def started_to_proto(started: EpisodeStarted) -> env_pb2.EpisodeStarted:
    return env_pb2.EpisodeStarted(
        episode_id=started.episode_id, tools=[tool_to_proto(t) for t in started.tools]
    )


def started_from_proto(msg: env_pb2.EpisodeStarted) -> EpisodeStarted:
    return EpisodeStarted(msg.episode_id, [tool_from_proto(t) for t in msg.tools])


def action_to_proto(action: EpisodeAction) -> env_pb2.EpisodeAction:
    return env_pb2.EpisodeAction(
        episode_id=action.episode_id,
        text=action.text,
        tool_calls=[
            env_pb2.ToolCall(name=c.name, arguments_json=json.dumps(c.arguments))
            for c in action.tool_calls
        ],
        parse_error=action.parse_error,
    )


def action_from_proto(msg: env_pb2.EpisodeAction) -> EpisodeAction:
    calls = [
        ToolCall(c.name, _json_object(c.arguments_json, f"arguments of a {c.name!r} call"))
        for c in msg.tool_calls
    ]
    return EpisodeAction(msg.episode_id, msg.text, calls, msg.parse_error)


def result_to_proto(result: StepResult) -> env_pb2.StepResult:
    ids = Ragged.from_lists([result.observation_ids])
    return env_pb2.StepResult(
        episode_id=result.episode_id,
        observation=env_pb2.Observation(text=result.observation_text, tokens=ragged_to_proto(ids)),
        reward=result.reward,
        done=result.done,
        error=result.error,
    )


def result_from_proto(msg: env_pb2.StepResult) -> StepResult:
    tokens = ragged_from_proto(msg.observation.tokens)
    ids: list[int] = tokens.values.to(torch.int64).tolist() if len(tokens) else []
    return StepResult(msg.episode_id, msg.observation.text, ids, msg.reward, msg.done, msg.error)
