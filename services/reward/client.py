"""The reward service's typed client, used by the coordinator, by evaluation and by users:

    with RewardClient("127.0.0.1:50055", timeout_s=60) as rc:
        outcomes = rc.score([ScoreItem("openai/gsm8k", "... #### 72", "72")])

A failed call raises ``RoleCallError`` naming the server and the call.
"""

from __future__ import annotations

from meshrl.api.v1 import reward_pb2, reward_pb2_grpc
from meshrl.rpc.role_client import RoleClient
from services.reward.convert import item_to_proto, outcome_from_proto
from services.reward.types import ScoreItem, ScoreOutcome


class RewardClient(RoleClient):
    """Blocking calls with a deadline of ``timeout_s`` each (None: no deadline)."""

    service = "reward"

    def __init__(self, address: str, timeout_s: float | None = 300.0):
        super().__init__(address, timeout_s)  # type: ignore[arg-type]
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)

    def score(
        self, items: list[ScoreItem], per_sample_timeout_s: float = 0.0
    ) -> list[ScoreOutcome]:
        """One outcome per item; ``per_sample_timeout_s`` 0 = the server's default."""
        request = reward_pb2.ScoreRequest(
            items=[item_to_proto(it) for it in items], timeout_s=per_sample_timeout_s
        )
        return [outcome_from_proto(r) for r in self._call("Score", request).results]

    def list_scorers(self) -> list[str]:
        """data_source names the server scores ("*" = any)."""
        return list(self._call("ListScorers", reward_pb2.ListScorersRequest()).data_sources)

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
