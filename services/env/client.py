"""The environment service's typed client, used by the coordinator's multi-turn rollout:

    with EnvClient("127.0.0.1:50056") as env:
        started = env.reset([EpisodeTask("calculator", ground_truth="72")])
        (result,) = env.step([EpisodeAction(started[0].episode_id, "The answer is 72.")])

A failed call raises ``RoleCallError`` naming the server and the call.
"""

from __future__ import annotations

from meshrl.api.v1 import env_pb2, env_pb2_grpc
from meshrl.rpc.role_client import RoleClient
from services.env.convert import (
    action_to_proto,
    result_from_proto,
    spec_from_proto,
    started_from_proto,
    task_to_proto,
)
from services.env.types import (
    EnvironmentSpec,
    EpisodeAction,
    EpisodeStarted,
    EpisodeTask,
    StepResult,
)


class EnvClient(RoleClient):
    """Blocking calls with a deadline of ``timeout_s`` each."""

    service = "env"

    def __init__(self, address: str, timeout_s: float = 300.0):
        super().__init__(address, timeout_s)
        self.stub = env_pb2_grpc.EnvServiceStub(self.channel)

    def environments(self) -> list[EnvironmentSpec]:
        reply = self._call("ListEnvironments", env_pb2.ListEnvironmentsRequest())
        return [spec_from_proto(s) for s in reply.environments]

    def reset(self, tasks: list[EpisodeTask]) -> list[EpisodeStarted]:
        reply = self._call("Reset", env_pb2.ResetRequest(tasks=[task_to_proto(t) for t in tasks]))
        return [started_from_proto(m) for m in reply.episodes]

    def step(self, actions: list[EpisodeAction], step_timeout_s: float = 0.0) -> list[StepResult]:
        """One result per action; ``step_timeout_s`` 0 = the server's default."""
        request = env_pb2.StepRequest(
            actions=[action_to_proto(a) for a in actions], timeout_s=step_timeout_s
        )
        # The call's own deadline leaves the server its per-step limit and some.
        deadline = max(self.timeout_s, step_timeout_s + 30.0) if step_timeout_s else None
        return [result_from_proto(r) for r in self._call("Step", request, deadline).results]

    def close_episodes(self, episode_ids: list[str]) -> int:
        """Drops episodes that are not done; how many were still open."""
        if not episode_ids:
            return 0
        return self._call("Close", env_pb2.CloseRequest(episode_ids=episode_ids)).closed

    def __enter__(self) -> EnvClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
