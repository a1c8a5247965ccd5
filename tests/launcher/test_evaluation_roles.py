"""An evaluation (`trainer.val_only`) starts the servers it validates with and no others:
rollout, actor (which holds the evaluated weights) and reward. Before, a GAE run with a KL
penalty started its critic and reference servers too, each loading a model, for nothing."""

from __future__ import annotations

import pytest

from meshrl.config import build_config
from meshrl.launcher.external import needed_roles
from meshrl.launcher.local import LocalLauncher

# GAE with a KL penalty: training starts all five kinds of server.
TRAINING = ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true"]


def _local_names(cfg, tmp_path) -> list[str]:
    return [p.name for p in LocalLauncher(cfg, tmp_path).plan()]


def _ray_names(cfg, tmp_path) -> list[str]:
    ray_launcher = pytest.importorskip("meshrl.launcher.ray_launcher")
    return [s.name for s in ray_launcher.role_specs(cfg)]


def _external_names(cfg, tmp_path) -> list[str]:
    return [f"{r}0" if r == "rollout" else r for r in needed_roles(cfg)]


@pytest.mark.parametrize("names_of", [_local_names, _ray_names, _external_names])
def test_an_evaluation_starts_no_critic_and_no_reference(tmp_path, names_of):
    training = build_config({}, TRAINING)
    assert sorted(names_of(training, tmp_path)) == ["actor", "critic", "ref", "reward", "rollout0"]
    evaluation = build_config({}, [*TRAINING, "trainer.val_only=true"])
    assert sorted(names_of(evaluation, tmp_path)) == ["actor", "reward", "rollout0"]


def test_an_evaluation_keeps_its_estimator_and_config_checks():
    """Only what is started changes: the config still reads as the training run's."""
    evaluation = build_config({}, [*TRAINING, "trainer.val_only=true"])
    assert evaluation.use_critic and evaluation.use_ref
    assert not evaluation.use_critic_server and not evaluation.use_ref_server


@pytest.mark.parametrize("names_of", [_local_names, _external_names])
def test_a_multi_turn_run_starts_an_env_server(tmp_path, names_of):
    cfg = build_config({}, ["actor_rollout_ref.rollout.multi_turn.enable=true"])
    assert "env" in names_of(cfg, tmp_path)
    assert "env" not in names_of(build_config({}, []), tmp_path)


def test_an_external_multi_turn_run_needs_the_env_address():
    from meshrl.config import ConfigError
    from meshrl.launcher.external import external_endpoints

    addresses = {"rollout": ["h:1"], "actor": ["h:2"], "reward": ["h:3"]}
    cfg = build_config(
        {"launcher": {"kind": "external", "addresses": addresses}},
        ["actor_rollout_ref.rollout.multi_turn.enable=true", "algorithm.adv_estimator=grpo"],
    )
    with pytest.raises(ConfigError, match="launcher.addresses.env: no address given"):
        external_endpoints(cfg)
    cfg.launcher.addresses["env"] = ["h:4"]
    assert external_endpoints(cfg).env == "h:4"
