"""meshrl/config/rules.py: every rule broken once, by a config that breaks it alone, with the
one line it says; and no cross-key rule of the config outside meshrl/config."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from meshrl.algorithms.registry import ESTIMATORS
from meshrl.config import ConfigError, build_config, rules
from meshrl.config.rules import RULES, check_config, config_problems

ROOT = Path(__file__).resolve().parents[2]
CRITIC_FREE = ", ".join(e.name for e in ESTIMATORS.values() if not e.needs_critic)

# rule -> (overrides that break it alone, the line it says)
BROKEN = {
    "clip_cov_bounds_ordered": (
        [
            "actor_rollout_ref.actor.policy_loss.clip_cov_lb=5",
            "actor_rollout_ref.actor.policy_loss.clip_cov_ub=1",
        ],
        "actor_rollout_ref.actor.policy_loss: clip_cov_lb=5.0 must be below clip_cov_ub=1.0: "
        "no token would be a clip_cov candidate",
    ),
    "role_pools_exist": (
        ["launcher.role_pool.actor=nowhere"],
        "launcher.role_pool.actor: pool 'nowhere' is not in launcher.resource_pool",
    ),
    "tls_files_in_pairs": (
        ["security.tls_cert=/c.pem"],
        "security.tls_cert is set but security.tls_key is not",
    ),
    "megatron_runs_as_asked": (
        [
            "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.actor.world_size=3",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3",
        ],
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3: meshrl's Megatron "
        "backend runs only 1 yet (docs/megatron.md)",
    ),
    "mini_batches_divide_the_batch": (
        ["data.train_batch_size=32", "algorithm.adv_estimator=grpo"],  # the actor's 64, no critic
        "actor_rollout_ref.actor.ppo_mini_batch_size (64) exceeds data.train_batch_size (32)",
    ),
    "one_step_off_without_dynamic_sampling": (
        ["trainer.one_step_off_policy=true", "algorithm.filter_groups.enable=true"],
        "trainer.one_step_off_policy=true does not go with algorithm.filter_groups.enable=true "
        "(dynamic sampling generates until enough groups differ, so the next step's batch "
        "cannot be started ahead): set one of them to false",
    ),
    "partial_rollout_kv_kept_only_off_vllm": (
        [
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.partial_rollout=true",
            "trainer.device=cuda",
        ],
        "actor_rollout_ref.rollout.partial_rollout_kv=keep does not go with rollout.name=vllm "
        "(vLLM continues the unfinished responses of a partial rollout by prefilling them "
        "again under the new weights): set partial_rollout_kv=recompute, or use "
        "rollout.name=auto, native or fast",
    ),
    "async_training_alone": (
        ["trainer.async_training.enable=true", "trainer.one_step_off_policy=true"],
        "trainer.async_training.enable=true does not go with trainer.one_step_off_policy=true "
        "(fully async mode already generates ahead, max_staleness=1 bounds it as one step off "
        "does): set one of them to false",
    ),
    "rollout_log_probs_for_their_consumers": (
        [
            "actor_rollout_ref.rollout.calculate_log_probs=false",
            "actor_rollout_ref.actor.tis_imp_ratio_cap=2",
        ],
        "actor_rollout_ref.rollout.calculate_log_probs=false does not go with "
        "actor.tis_imp_ratio_cap=2 (truncated IS and decoupled PPO weigh each token by its "
        "rollout log-prob; async training sets the cap): set calculate_log_probs to true or "
        "leave it unset, or tis_imp_ratio_cap=-1",
    ),
    "critic_for_the_estimator": (
        ["critic.enable=false"],
        "critic.enable=false: algorithm.adv_estimator=gae needs critic values; enable the "
        f"critic or pick a critic-free estimator ({CRITIC_FREE})",
    ),
    "fast_engine_on_a_gpu": (
        ["actor_rollout_ref.rollout.name=fast"],
        "actor_rollout_ref.rollout.name=fast generates on a CUDA GPU, but trainer.device=cpu "
        "puts the run on the CPU (meshrl's default; verl's is cuda): set trainer.device=cuda, "
        "or drop rollout.name for the built-in engines, which run on either",
    ),
    "critic_reads_no_tokenizer": (
        ["actor_rollout_ref.model.path=/m/actor", "critic.model.tokenizer_path=/m/other"],
        "critic.model.tokenizer_path=/m/other: the critic scores the actor's tokens and reads "
        "no tokenizer of its own (its model must share the actor's vocabulary); drop it",
    ),
    "reward_model_has_a_path": (
        ["reward.reward_model.enable=true"],
        "reward.reward_model.enable=true, but reward.reward_model.path is empty: name the "
        "reward model's folder",
    ),
    "val_only_has_val_files": (
        ["trainer.val_only=true"],
        "trainer.val_only=true validates and stops, but data.val_files is empty: name the "
        "validation parquet files",
    ),
    "overlong_buffer_within_responses": (
        ["reward.overlong_buffer.enable=true"],  # its 4096 tokens, past the 512 responses
        "reward.overlong_buffer.len=4096 exceeds data.max_response_length=512: every response "
        "would be penalised; set it to at most the response limit (DAPO: a quarter of it)",
    ),
    "gen_batch_only_with_dynamic_sampling": (
        ["data.gen_batch_size=512"],
        "data.gen_batch_size=512 differs from data.train_batch_size=256, but only dynamic "
        "sampling generates batches apart from the training batch: set "
        "algorithm.filter_groups.enable=true, or drop data.gen_batch_size (verl would train "
        "on all 512 prompts)",
    ),
    "enough_generation_batches": (
        [
            "algorithm.filter_groups.enable=true",
            "actor_rollout_ref.rollout.n=4",
            "data.gen_batch_size=64",
            "algorithm.filter_groups.max_num_gen_batches=2",
        ],
        "data.gen_batch_size=64 x algorithm.filter_groups.max_num_gen_batches=2 prompts are "
        "fewer than data.train_batch_size=256: every step would fail; raise either",
    ),
    "filter_metric_before_the_kl_penalty": (
        [
            "algorithm.filter_groups.enable=true",
            "actor_rollout_ref.rollout.n=4",
            "algorithm.filter_groups.metric=seq_final_reward",
            "algorithm.use_kl_in_reward=true",
        ],
        "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: "
        "the groups are picked right after scoring, before the reference log-probs that the "
        "KL penalty needs exist; filter by seq_reward (the same reward without the KL "
        "penalty) or set algorithm.use_kl_in_reward=false (a KL loss, actor.use_kl_loss, "
        "works with it)",
    ),
    "groups_to_filter": (
        ["algorithm.filter_groups.enable=true"],
        "algorithm.filter_groups.enable=true needs groups to filter: "
        "actor_rollout_ref.rollout.n=1 gives one sample a prompt; set it to 2 or more",
    ),
    "no_greedy_baseline_with_filtering": (
        [
            "algorithm.filter_groups.enable=true",
            "actor_rollout_ref.rollout.n=4",
            "algorithm.adv_estimator=remax",
        ],
        "algorithm.filter_groups.enable=true with algorithm.adv_estimator=remax: its greedy "
        "baseline is generated for the step's prompts before any are filtered; pick grpo, "
        "rloo or another estimator",
    ),
    "train_files_given": (
        ["actor_rollout_ref.model.path=m"],
        "data.train_files is empty: name the training parquet files "
        "(data.train_files=train.parquet, or [a.parquet,b.parquet])",
    ),
    "model_path_given": (
        ["data.train_files=t.parquet"],
        "actor_rollout_ref.model.path is empty: set it to a Hugging Face model folder or hub id",
    ),
}
# what a run's config needs beyond the defaults to break only the rule at hand
GIVEN = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]


def test_every_rule_is_broken_here_once():
    names = [rule.name for rule in RULES]
    assert len(set(names)) == len(names)
    assert sorted(BROKEN) == sorted(names)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_a_config_that_breaks_one_rule_gets_its_one_line(rule, monkeypatch):
    monkeypatch.setattr(rules, "vllm_installed", lambda: False)
    overrides, line = BROKEN[rule.name]
    if rule.when == "load":  # refused as the config is built, with the schema's errors
        with pytest.raises(ConfigError) as refused:
            build_config({}, overrides)
        assert str(refused.value).splitlines() == ["invalid config:", f"  {line}"]
        return
    given = [g for g in GIVEN if g.split("=")[0] not in {o.split("=")[0] for o in overrides}]
    cfg = build_config({}, [*given, *overrides] if rule.when == "run" else overrides)
    assert list(rule.check(cfg)) == [line]
    assert config_problems(cfg, rule.when) == [line]  # and no other rule of its phase
    with pytest.raises(ConfigError) as refused:
        check_config(cfg, rule.when)
    assert str(refused.value) == line  # one alone, as it is


def test_several_broken_rules_are_listed_in_one_message():
    cfg = build_config({}, ["critic.enable=false", "actor_rollout_ref.rollout.name=fast"])
    with pytest.raises(ConfigError) as refused:
        check_config(cfg, "run")
    lines = str(refused.value).splitlines()
    assert lines[0] == "invalid config:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "critic.enable=false",
        "actor_rollout_ref.rollout.name=fast generates on a CUDA GPU, but trainer.device=cpu "
        "puts the run on the CPU (meshrl's default; verl's is cuda)",
    ]


def _python_files() -> list[Path]:
    return [p for pkg in ("meshrl", "services", "meshrl_app") for p in (ROOT / pkg).rglob("*.py")]


def test_no_cross_key_rule_of_the_config_outside_its_rules_module():
    """A pydantic model validator (a rule over a section's or the root's keys) only in the
    root, schema.py, which fills defaults and runs the rules; a "does not go with" (the
    phrase of a combination refused) only in rules.py."""
    validators, combinations = [], []
    for path in _python_files():
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        if where != "meshrl/config/schema.py" and "model_validator" in text:
            validators.append(where)
        if where != "meshrl/config/rules.py" and "does not go with" in text:
            combinations.append(where)
    assert not validators, validators
    assert not combinations, combinations


def test_the_roots_validators_fill_defaults_and_run_the_rules():
    tree = ast.parse((ROOT / "meshrl/config/schema.py").read_text())
    validators = [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any("model_validator" in ast.unparse(d) for d in node.decorator_list)
    ]
    checks = [name for name in validators if "check" in name]
    assert checks == ["_check_rules"], validators
