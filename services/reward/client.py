"""A small Python client of the reward server.

with RewardClient("127.0.0.1:50053") as rc:
    outcomes = rc.score([ScoreItem("openai/gsm8k", "... #### 72", "72")])
"""

from __future__ import annotations

from meshrl.api.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from meshrl.rpc.client import open_channel
from services.reward.convert import item_to_proto, outcome_from_proto
from services.reward.types import ScoreItem, ScoreOutcome


class RewardClient:
    """Blocking calls with a deadline of `timeout_s` each (None: no deadline)."""

    def __init__(self, address: str, timeout_s: float | None = 300.0):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = open_channel(address)
        self._stub = reward_pb2_grpc.RewardServiceStub(self._channel)

    def score(
        self, items: list[ScoreItem], per_sample_timeout_s: float = 0.0
    ) -> list[ScoreOutcome]:
        """One outcome per item; `per_sample_timeout_s` 0 = the server's default."""
        request = reward_pb2.ScoreRequest(
            items=[item_to_proto(it) for it in items], timeout_s=per_sample_timeout_s
        )
        response = self._stub.Score(request, timeout=self.timeout_s)
        return [outcome_from_proto(r) for r in response.results]

    def list_scorers(self) -> list[str]:
        return list(
            self._stub.ListScorers(
                reward_pb2.ListScorersRequest(), timeout=self.timeout_s
            ).data_sources
        )

    def info(self) -> common_pb2.ServerInfo:
        return self._stub.GetInfo(common_pb2.GetInfoRequest(), timeout=self.timeout_s)

    def initialize(self, config_yaml: str, run_dir: str = "") -> common_pb2.ServerInfo:
        request = common_pb2.InitializeRequest(config_yaml=config_yaml, run_dir=run_dir)
        return self._stub.Initialize(request, timeout=self.timeout_s).info

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
