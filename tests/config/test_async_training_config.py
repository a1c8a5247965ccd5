"""trainer.async_training: its refusals (one line each, docs/reliability.md rows 130-133)
and decoupled PPO's behaviour weight on by default."""

from __future__ import annotations

import pytest

from meshrl.config import ConfigError, build_config, config_from_yaml, config_to_yaml
from services.trainer.actor import PolicyLossSettings

ASYNC = "trainer.async_training.enable=true"


def test_refused_with_one_step_off_policy():  # row 130
    with pytest.raises(ConfigError) as e:
        build_config({}, [ASYNC, "trainer.one_step_off_policy=true"])
    assert (
        "trainer.async_training.enable=true does not go with trainer.one_step_off_policy=true"
        in str(e.value)
    )


def test_refused_with_dynamic_sampling():  # row 131
    with pytest.raises(ConfigError) as e:
        build_config({}, [ASYNC, "algorithm.filter_groups.enable=true"])
    assert (
        "trainer.async_training.enable=true does not go with algorithm.filter_groups.enable=true"
        in str(e.value)
    )


def test_refused_with_multi_turn_rollouts():  # row 133
    with pytest.raises(ConfigError) as e:
        build_config({}, [ASYNC, "actor_rollout_ref.rollout.multi_turn.enable=true"])
    assert (
        "trainer.async_training.enable=true does not go with "
        "actor_rollout_ref.rollout.multi_turn.enable=true" in str(e.value)
    )


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.async_training.max_staleness=0", "trainer.async_training.max_staleness"),
        ("trainer.async_training.stale=block", "trainer.async_training.stale"),
        ("trainer.async_training.buffer_batches=0", "trainer.async_training.buffer_batches"),
    ],
)
def test_bad_values_name_their_key(override, key):  # row 132
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config({}, [ASYNC, override])


def test_the_behaviour_weight_is_on_by_default_in_async_mode_only():
    loss = PolicyLossSettings.from_config(build_config({}, [ASYNC]))
    assert loss.tis_imp_ratio_cap == 2.0
    assert build_config({}).actor_rollout_ref.actor.tis_imp_ratio_cap == -1.0  # off in sync
    chosen = build_config({}, [ASYNC, "actor_rollout_ref.actor.tis_imp_ratio_cap=-1"])
    assert chosen.actor_rollout_ref.actor.tis_imp_ratio_cap == -1.0  # a choice is kept
    again = config_from_yaml(config_to_yaml(build_config({}, [ASYNC])))
    assert again.actor_rollout_ref.actor.tis_imp_ratio_cap == 2.0
