"""Bad requests to the trainer's handlers (in the test process, one rank): each fails with
a ValueError (INVALID_ARGUMENT on the wire) that names what is wrong, before any forward."""

import pytest
import torch
from trainer_helpers import batch_to_proto, make_batch, trainer_config

from meshrl.api.v1 import common_pb2, trainer_pb2
from meshrl.config import config_to_yaml
from meshrl.wire import tensor_to_proto
from services.trainer.rank_handlers import RankHandlers


def _handlers(role: str, model_dir) -> RankHandlers:
    handlers = RankHandlers(role, "127.0.0.1")
    config = config_to_yaml(trainer_config(model_dir))
    handlers.Initialize(common_pb2.InitializeRequest(config_yaml=config))
    return handlers


def test_an_update_without_a_required_field_names_it(world, tiny_model_dir):
    # A missing field used to reach the loss as None: "AttributeError: 'NoneType' object
    # has no attribute 'shape'" (INTERNAL), naming nothing.
    batch = make_batch(4, seed=1)
    per_token = tensor_to_proto(torch.zeros(batch.num_response_tokens))
    actor, critic = _handlers("actor", tiny_model_dir), _handlers("critic", tiny_model_dir)
    cases = [
        (actor.UpdatePolicy, trainer_pb2.PolicyUpdateRequest, "old_logprobs", "advantages"),
        (critic.UpdateValue, trainer_pb2.ValueUpdateRequest, "old_values", "returns"),
    ]
    for update, request_type, first, second in cases:
        for missing, given in ((first, second), (second, first)):
            request = request_type(batch=batch_to_proto(batch), **{given: per_token})
            with pytest.raises(ValueError, match=f"{missing} is missing"):
                update(request)


def test_token_ids_outside_the_vocabulary_are_named(world, tiny_model_dir):
    # Used to be the embedding's "IndexError: index out of range in self" on a CPU, and a
    # device-side assert on a GPU, after which every later call of the server fails.
    batch = make_batch(3, seed=2)
    vocab = 22  # the tiny model's character vocabulary
    responses = batch.responses.values.clone()
    responses[4] = vocab
    bad = type(batch)(batch.prompts, batch.responses.with_values(responses))
    row = int(torch.searchsorted(batch.responses.offsets, 4, right=True)) - 1
    actor = _handlers("actor", tiny_model_dir)
    message = rf"responses\[{row}\] holds token id 22, outside the model's vocabulary \[0, 22\)"
    with pytest.raises(ValueError, match=message):
        actor.ComputeLogProbs(common_pb2.LogProbsRequest(batch=batch_to_proto(bad)))
    prompts = batch.prompts.values.clone()
    prompts[0] = -1
    negative = type(batch)(batch.prompts.with_values(prompts), batch.responses)
    critic = _handlers("critic", tiny_model_dir)
    with pytest.raises(ValueError, match=r"prompts\[0\] holds token id -1"):
        critic.ComputeValues(batch_to_proto(negative))
    # The same servers still answer a good batch.
    response = actor.ComputeLogProbs(common_pb2.LogProbsRequest(batch=batch_to_proto(batch)))
    assert response.logprobs.shape == [batch.num_response_tokens]
