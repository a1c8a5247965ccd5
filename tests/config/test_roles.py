"""role_settings: each role's own section and the shared keys it reads."""

import pytest

from meshrl.config import build_config
from meshrl.config.roles import ROLES, role_settings


def test_each_role_reads_its_own_section():
    cfg = build_config({}, ["actor_rollout_ref.model.path=/m/policy"])
    policy = cfg.actor_rollout_ref
    sections = {
        "actor": policy.actor,
        "critic": cfg.critic,
        "ref": policy.ref,
        "rollout": policy.rollout,
        "reward": cfg.reward,
        "env": policy.rollout.multi_turn,
    }
    assert tuple(sections) == ROLES
    for role, section in sections.items():
        settings = role_settings(cfg, role)
        assert settings.role == role and settings.section is section
        assert settings.device == "cpu" and settings.max_sequence_length == 512 + 512


def test_model_paths_world_sizes_and_the_critics_fallback():
    cfg = build_config(
        {},
        [
            "actor_rollout_ref.model.path=/m/policy",
            "actor_rollout_ref.model.tokenizer_path=/m/tok",
            "actor_rollout_ref.actor.world_size=4",
            "actor_rollout_ref.ref.world_size=2",
            "actor_rollout_ref.rollout.replicas=3",
        ],
    )
    paths = {
        r: (s.model_path, s.tokenizer_path, s.world_size)
        for r in ROLES
        for s in [role_settings(cfg, r)]
    }
    assert paths == {
        "actor": ("/m/policy", "/m/tok", 4),
        "critic": ("/m/policy", "/m/policy", 1),  # no model of its own: the actor's
        "ref": ("/m/policy", "/m/tok", 2),
        "rollout": ("/m/policy", "/m/tok", 1),  # each replica a server of its own
        "reward": ("", "", 1),  # no reward model
        "env": ("/m/policy", "/m/tok", 1),
    }
    critic = build_config(
        {},
        [
            "critic.model.path=/m/critic",
            "reward.reward_model.enable=true",
            "reward.reward_model.path=/m/rm",
        ],
    )
    assert role_settings(critic, "critic").model_path == "/m/critic"
    assert role_settings(critic, "critic").model is critic.critic.model
    assert role_settings(critic, "reward").model_path == "/m/rm"
    assert role_settings(critic, "reward").model is None


def test_a_role_without_a_section_is_refused():
    with pytest.raises(ValueError, match="no settings for role 'coordinator'"):
        role_settings(build_config(), "coordinator")
