"""The loss mask of a multi-turn rollout: the response tokens the model did not sample (an
environment's observations) are in the forward, but no loss term and no token count sees
them. Pinned by updates that must not change when the masked tokens' targets do, and by
the hand-counted token totals."""

import pytest
import torch
from trainer_helpers import make_batch, trainer_config

from meshrl.ragged import Ragged
from meshrl.wire import sequences_to_proto
from services.trainer.actor import ActorRole
from services.trainer.convert import batch_from_proto
from services.trainer.critic import CriticRole
from services.trainer.types import SequenceBatch


def _masked(batch: SequenceBatch, seed: int = 3) -> SequenceBatch:
    """Every row's response with its 2nd, 3rd, ... tokens alternately the model's and not."""
    values = torch.ones_like(batch.responses.values, dtype=torch.uint8)
    for i in range(len(batch)):
        start, end = int(batch.responses.offsets[i]), int(batch.responses.offsets[i + 1])
        values[start + 1 : end : 2] = 0
    return SequenceBatch(batch.prompts, batch.responses, batch.responses.with_values(values))


def _scrambled(values: Ragged, mask: Ragged, seed: int) -> Ragged:
    """``values`` with random numbers where ``mask`` is 0."""
    noise = torch.randn(values.values.shape, generator=torch.Generator().manual_seed(seed)) * 5
    return values.with_values(torch.where(mask.values.bool(), values.values, noise))


def test_the_token_counts_are_the_model_tokens():
    batch = SequenceBatch(
        Ragged.from_lists([[1], [2, 3]]),
        Ragged.from_lists([[4, 5, 6, 7], [8]]),
        Ragged.from_lists([[1, 0, 0, 1], [1]], dtype=torch.uint8),
    )
    assert batch.loss_lengths.tolist() == [2, 1]
    assert batch.response_lengths.tolist() == [4, 1]
    assert batch.padded_loss_mask(5).tolist() == [
        [True, False, False, True, False],
        [True, False, False, False, False],
    ]
    assert batch.select(torch.tensor([1])).loss_lengths.tolist() == [1]


def test_the_loss_mask_crosses_the_wire():
    batch = _masked(make_batch(3, seed=1))
    back = batch_from_proto(sequences_to_proto(batch.prompts, batch.responses, batch.loss_mask))
    assert back.loss_mask is not None
    assert torch.equal(back.loss_mask.values, batch.loss_mask.values)
    plain = batch_from_proto(sequences_to_proto(batch.prompts, batch.responses))
    assert plain.loss_mask is None


def test_a_loss_mask_of_another_length_is_refused():
    batch = make_batch(2, seed=1)
    msg = sequences_to_proto(batch.prompts, batch.responses, Ragged.from_lists([[1]]))
    with pytest.raises(ValueError, match="loss_mask has 1 values for .* response tokens"):
        batch_from_proto(msg)


def _actor_after_update(world, model_dir, batch, advantages):
    actor = ActorRole.build(trainer_config(model_dir, []), world)
    old, _ = actor.compute_log_probs(batch)
    metrics = actor.update_policy(batch, old, advantages(old), None, None, global_step=1)
    new, _ = actor.compute_log_probs(batch)
    return metrics, new


def test_the_policy_update_ignores_the_observation_tokens(world, tiny_model_dir):
    batch = _masked(make_batch(4, seed=11))
    assert batch.loss_mask is not None

    def advantages(seed):
        def make(old):
            base = old.with_values(torch.linspace(-1, 1, old.values.numel()))
            return _scrambled(base, batch.loss_mask, seed)

        return make

    metrics_a, new_a = _actor_after_update(world, tiny_model_dir, batch, advantages(1))
    metrics_b, new_b = _actor_after_update(world, tiny_model_dir, batch, advantages(2))
    torch.testing.assert_close(new_a.values, new_b.values, atol=1e-6, rtol=0)
    assert metrics_a["actor/pg_loss"] == pytest.approx(metrics_b["actor/pg_loss"], abs=1e-6)
    # the control: without the mask the same scrambled advantages move the policy apart
    plain = SequenceBatch(batch.prompts, batch.responses)
    _, new_c = _actor_after_update(world, tiny_model_dir, plain, advantages(1))
    _, new_d = _actor_after_update(world, tiny_model_dir, plain, advantages(2))
    assert not torch.allclose(new_c.values, new_d.values, atol=1e-4)


def test_the_pg_loss_is_a_mean_over_the_model_tokens_alone(world, tiny_model_dir):
    # At ratio 1 the PPO loss is -mean(A) over the counted tokens: A is 1 on the model's
    # tokens and 100 on the observations, so the loss is -1 only if the mean leaves them out.
    batch = _masked(make_batch(4, seed=11))
    assert batch.loss_mask is not None
    counted = batch.loss_mask.values.bool()

    def advantages(old):
        return old.with_values(torch.where(counted, 1.0, 100.0))

    metrics, _ = _actor_after_update(world, tiny_model_dir, batch, advantages)
    assert metrics["actor/pg_loss"] == pytest.approx(-1.0, rel=1e-5)


def test_the_value_update_ignores_the_observation_tokens(world, tiny_model_dir):
    batch = _masked(make_batch(4, seed=5))
    assert batch.loss_mask is not None
    after = []
    for seed in (1, 2):
        critic = CriticRole.build(trainer_config(tiny_model_dir, []), world)
        old = critic.compute_values(batch)
        returns = _scrambled(old.with_values(old.values + 1.0), batch.loss_mask, seed)
        critic.update_value(batch, old, returns, global_step=1)
        after.append(critic.compute_values(batch).values)
    torch.testing.assert_close(after[0], after[1], atol=1e-6, rtol=0)
