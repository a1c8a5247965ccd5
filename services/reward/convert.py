"""Proto <-> typed containers of the reward API, used by the server and the client alike."""

from __future__ import annotations

import json

from meshrl.api.v1 import reward_pb2
from services.reward.types import ScoreItem, ScoreOutcome


def item_from_proto(msg: reward_pb2.ScoreItem) -> ScoreItem:
    extra = {}
    if msg.extra_info_json:
        try:
            extra = json.loads(msg.extra_info_json)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"extra_info_json of a {msg.data_source!r} item is not JSON: {e}"
            ) from None
        except RecursionError:  # "[[[[..." nested past the decoder's depth limit
            raise ValueError(
                f"extra_info_json of a {msg.data_source!r} item is nested too deeply"
            ) from None
        if not isinstance(extra, dict):
            raise ValueError(f"extra_info_json of a {msg.data_source!r} item is not a JSON object")
    return ScoreItem(
        data_source=msg.data_source,
        response=msg.response,
        ground_truth=msg.ground_truth,
        prompt=msg.prompt,
        extra_info=extra,
    )


def item_to_proto(item: ScoreItem) -> reward_pb2.ScoreItem:
    return reward_pb2.ScoreItem(
        data_source=item.data_source,
        response=item.response,
        ground_truth=item.ground_truth,
        prompt=item.prompt,
        extra_info_json=json.dumps(item.extra_info, default=str) if item.extra_info else "",
    )


def outcome_to_proto(outcome: ScoreOutcome) -> reward_pb2.ScoreResult:
    return reward_pb2.ScoreResult(
        score=outcome.score,
        ok=outcome.ok,
        reason=outcome.reason,
        extra=outcome.extra,
        pred=outcome.pred,  # None leaves the optional field unset
    )


def outcome_from_proto(msg: reward_pb2.ScoreResult) -> ScoreOutcome:
    return ScoreOutcome(
        score=msg.score,
        ok=msg.ok,
        reason=msg.reason,
        extra=dict(msg.extra),
        pred=msg.pred if msg.HasField("pred") else None,
    )
