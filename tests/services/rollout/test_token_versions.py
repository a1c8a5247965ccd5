"""Each token's weight version from the points where the weights changed, worked by hand."""

import pytest
import torch

from meshrl.ragged import Ragged
from services.rollout.convert import generation_from_proto, generation_to_proto
from services.rollout.token_versions import TokenVersions
from services.rollout.types import GenerationResult


def test_versions_follow_the_switch_points():
    # 3 sequences of 4, 2 and 3 tokens. Weights 5 -> 6 when they had 2, 2 (finished) and 0
    # tokens; 6 -> 7 when the first had 3 and the last 1.
    versions = TokenVersions(3, version=5)
    versions.switch(6, torch.tensor([2, 2, 0]))
    versions.switch(7, torch.tensor([3, 2, 1]))
    newest, per_token = versions.result(torch.tensor([4, 2, 3]))
    assert newest == 7
    assert per_token is not None
    assert per_token.tolist() == [[5, 5, 6, 7], [5, 5], [6, 7, 7]]


def test_one_version_for_every_token_is_none():
    versions = TokenVersions(2, version=3)
    assert versions.result(torch.tensor([2, 1])) == (3, None)
    # A switch after every token was sampled changes none of them: still version 3.
    versions.switch(4, torch.tensor([2, 1]))
    assert versions.current == 4
    assert versions.result(torch.tensor([2, 1])) == (3, None)
    # Before any token: every token is of the new version.
    first = TokenVersions(2, version=3)
    first.switch(4, torch.tensor([0, 0]))
    assert first.result(torch.tensor([2, 1])) == (4, None)


def test_generated_must_cover_every_sequence():
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        TokenVersions(3, version=0).switch(1, torch.tensor([1, 2]))


def _result(token_versions):
    responses = Ragged.from_lists([[4, 5, 6], [7]])
    return GenerationResult(
        responses=responses,
        logprobs=responses.with_values(torch.tensor([-0.5, -1.0, -1.5, -2.0])),
        finish_reasons=["length", "stop"],
        weight_version=2,
        token_versions=token_versions,
    )


def test_token_versions_cross_the_wire_both_ways():
    versions = Ragged(torch.tensor([1, 2, 2, 2]), torch.tensor([0, 3, 4]))
    back = generation_from_proto(generation_to_proto(_result(versions)))
    assert back.token_versions is not None
    assert back.token_versions.tolist() == [[1, 2, 2], [2]]
    assert back.token_versions.values.dtype == torch.int64
    # None stays None: the field is left empty.
    msg = generation_to_proto(_result(None))
    assert not msg.HasField("token_versions")
    assert generation_from_proto(msg).token_versions is None


def test_token_versions_of_another_length_are_refused():
    msg = generation_to_proto(_result(Ragged(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))))
    with pytest.raises(ValueError, match="token_versions has 2 values for 4 response tokens"):
        generation_from_proto(msg)
