"""Every rule of the run config that reads more than one key, and only the config: a small
named function each, collected in :data:`RULES`, run by :func:`config_problems`.

A rule yields one line per problem, naming its keys and the way out; each rule says when it
runs (:data:`When`):

- ``load``: every config, as it is built (RunConfig's validator): no server could use it.
- ``run``: a PPO run's start, before any role server (``check_run_config`` of
  services/coordinator/run/preflight.py): a config that brings up one role server alone (a
  test, a benchmark) may well have a gae estimator and no critic.
- ``required``: the keys every run must set, checked at a run's start after the checks of
  the machine (a config without data files still says which logger is missing).

A rule that needs the machine, files or data (a model folder, a GPU, an installed logger)
is no rule here: preflight has those. tests/config/test_rules.py breaks each rule once.

A rule reads the config as :class:`RunSections` (RunConfig's fields and properties): the
schema runs the ``load`` rules, so this module does not import it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from meshrl.algorithms.registry import ESTIMATORS, advantage_estimator
from meshrl.config.errors import ConfigError
from meshrl.config.sections.actor import ActorConfig
from meshrl.config.sections.critic import CriticConfig
from meshrl.config.sections.megatron import RUNNING_SIZES, MegatronConfig
from meshrl.config.sections.run import RunSections

When = Literal["load", "run", "required"]


@dataclass(frozen=True)
class Rule:
    """A rule of the config: ``check`` yields a line for each problem (none: kept)."""

    check: Callable[[RunSections], Iterable[str]]
    when: When

    @property
    def name(self) -> str:
        return self.check.__name__


# -- load: every config ------------------------------------------------------------------


def clip_cov_bounds_ordered(cfg: RunSections) -> Iterator[str]:
    loss = cfg.actor_rollout_ref.actor.policy_loss
    if loss.clip_cov_lb >= loss.clip_cov_ub:
        yield (
            f"actor_rollout_ref.actor.policy_loss: clip_cov_lb={loss.clip_cov_lb} must be "
            f"below clip_cov_ub={loss.clip_cov_ub}: no token would be a clip_cov candidate"
        )


def role_pools_exist(cfg: RunSections) -> Iterator[str]:
    launcher = cfg.launcher
    for role, pool in launcher.role_pool.items():
        if pool != "global" and pool not in launcher.resource_pool:
            yield f"launcher.role_pool.{role}: pool {pool!r} is not in launcher.resource_pool"


def tls_files_in_pairs(cfg: RunSections) -> Iterator[str]:
    security = cfg.security
    for a, b in (("tls_cert", "tls_key"), ("client_cert", "client_key")):
        if bool(getattr(security, a)) != bool(getattr(security, b)):
            have, missing = (a, b) if getattr(security, a) else (b, a)
            yield f"security.{have} is set but security.{missing} is not"
    if security.require_client_cert and not (security.tls_cert and security.tls_ca):
        yield "security.require_client_cert needs security.tls_cert and security.tls_ca"


def mini_batches_divide_the_batch(cfg: RunSections) -> Iterator[str]:
    # As verl: each optimizer step takes a whole mini-batch (a smaller last one would
    # weigh its few prompts as much as a full one). The critic's only when it runs.
    trained: list[tuple[str, ActorConfig | CriticConfig]] = [
        ("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor)
    ]
    if cfg.use_critic:
        trained.append(("critic", cfg.critic))
    batch = cfg.data.train_batch_size
    for name, role in trained:
        assert role.ppo_mini_batch_size is not None  # the critic's is filled in by RunConfig
        if role.ppo_mini_batch_size > batch:
            yield (
                f"{name}.ppo_mini_batch_size ({role.ppo_mini_batch_size}) exceeds "
                f"data.train_batch_size ({batch})"
            )
        elif batch % role.ppo_mini_batch_size:
            yield (
                f"data.train_batch_size ({batch}) must be a multiple of "
                f"{name}.ppo_mini_batch_size ({role.ppo_mini_batch_size})"
            )


def one_step_off_without_dynamic_sampling(cfg: RunSections) -> Iterator[str]:
    # Dynamic sampling decides how many batches a step generates from their scores, so
    # the next step's generation cannot start before this step's is judged.
    if cfg.trainer.one_step_off_policy and cfg.algorithm.filter_groups.enable:
        yield (
            "trainer.one_step_off_policy=true does not go with "
            "algorithm.filter_groups.enable=true (dynamic sampling generates until enough "
            "groups differ, so the next step's batch cannot be started ahead): set one "
            "of them to false"
        )


def vllm_installed() -> bool:
    """Whether vllm can be imported here (looked up, not imported): rollout.name=vllm on a
    CPU run generates with vLLM's CPU build then, else with the native engine. The one
    look beyond the config that a ``load`` rule takes, as the schema always has."""
    return importlib.util.find_spec("vllm") is not None


def partial_rollout_kv_kept_only_off_vllm(cfg: RunSections) -> Iterator[str]:
    rollout = cfg.actor_rollout_ref.rollout
    # vLLM generates on a GPU run, and on a CPU run where vllm is installed
    vllm = rollout.name == "vllm" and (cfg.trainer.device == "cuda" or vllm_installed())
    if rollout.partial_rollout and vllm and rollout.partial_rollout_kv == "keep":
        yield (
            "actor_rollout_ref.rollout.partial_rollout_kv=keep does not go with "
            "rollout.name=vllm (vLLM continues the unfinished responses of a partial "
            "rollout by prefilling them again under the new weights): set "
            "partial_rollout_kv=recompute, or use rollout.name=auto, native or fast"
        )


def async_training_alone(cfg: RunSections) -> Iterator[str]:
    if not cfg.trainer.async_training.enable:
        return
    if cfg.trainer.one_step_off_policy:
        yield (
            "trainer.async_training.enable=true does not go with "
            "trainer.one_step_off_policy=true (fully async mode already generates ahead, "
            "max_staleness=1 bounds it as one step off does): set one of them to false"
        )
    if cfg.algorithm.filter_groups.enable:
        yield (
            "trainer.async_training.enable=true does not go with "
            "algorithm.filter_groups.enable=true (dynamic sampling decides from a step's "
            "scores how many batches it generates, so rollout cannot run ahead): set one "
            "of them to false"
        )
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        yield (
            "trainer.async_training.enable=true does not go with "
            "actor_rollout_ref.rollout.multi_turn.enable=true (an episode's turns are "
            "generated one request each, and their weight versions are not kept across a "
            "sync between turns yet): set one of them to false"
        )


def rollout_log_probs_for_their_consumers(cfg: RunSections) -> Iterator[str]:
    # read after RunConfig's async default of the cap
    rollout, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    if rollout.calculate_log_probs is False and actor.tis_imp_ratio_cap > 0:
        yield (
            "actor_rollout_ref.rollout.calculate_log_probs=false does not go with "
            f"actor.tis_imp_ratio_cap={actor.tis_imp_ratio_cap:g} (truncated IS and "
            "decoupled PPO weigh each token by its rollout log-prob; async training sets "
            "the cap): set calculate_log_probs to true or leave it unset, or "
            "tis_imp_ratio_cap=-1"
        )


def _megatron_problems(
    section: str, strategy: str, megatron: MegatronConfig, world_size: int, lora_rank: int,
    remove_padding: bool,
) -> list[str]:  # fmt: skip
    """One line per setting ``strategy=megatron`` cannot run with, for ``section``
    (``actor_rollout_ref.actor``, ``critic``, ``actor_rollout_ref.ref``); none for FSDP."""
    if strategy != "megatron":
        return []
    problems = []
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    if world_size % (tp * pp):
        problems.append(
            f"{section}.megatron.tensor_model_parallel_size={tp} x "
            f"pipeline_model_parallel_size={pp} does not divide {section}.world_size="
            f"{world_size}: the role's ranks cannot be split so"
        )
    for key, running in RUNNING_SIZES.items():
        value = getattr(megatron, key)
        if value != running:
            problems.append(
                f"{section}.megatron.{key}={value}: meshrl's Megatron backend runs only "
                f"{running} yet (docs/megatron.md)"
            )
    model = "actor_rollout_ref.model" if section != "critic" else "critic.model"
    if lora_rank:
        problems.append(
            f"{model}.lora_rank={lora_rank} does not go with {section}.strategy=megatron "
            "(LoRA adapters are peft's, on the FSDP2 backend): set strategy=fsdp2"
        )
    if remove_padding:
        problems.append(
            f"{model}.use_remove_padding=true does not go with {section}.strategy=megatron "
            "(padding-free rows need varlen attention, which the Megatron backend's torch "
            "attention has not): set use_remove_padding=false"
        )
    return problems


def megatron_runs_as_asked(cfg: RunSections) -> Iterator[str]:
    """strategy=megatron: sizes the role's ranks can give and the backend runs, and what it
    does not go with, for each trainer role."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    padding_free = arr.model.use_remove_padding
    yield from _megatron_problems(
        "actor_rollout_ref.actor", arr.actor.strategy, arr.actor.megatron,
        arr.actor.world_size, arr.model.lora_rank, padding_free,
    )  # fmt: skip
    yield from _megatron_problems(
        "actor_rollout_ref.ref", arr.ref.strategy, arr.ref.megatron, arr.ref.world_size, 0,
        padding_free,
    )  # fmt: skip
    yield from _megatron_problems(
        "critic", critic.strategy, critic.megatron, critic.world_size,
        critic.model.lora_rank, critic.model.use_remove_padding,
    )  # fmt: skip


# -- run: a PPO run's start --------------------------------------------------------------


def critic_for_the_estimator(cfg: RunSections) -> Iterator[str]:
    estimator = advantage_estimator(cfg.algorithm.adv_estimator)
    if estimator.needs_critic and not cfg.use_critic:
        critic_free = ", ".join(e.name for e in ESTIMATORS.values() if not e.needs_critic)
        yield (
            f"critic.enable=false: algorithm.adv_estimator={estimator.name} needs critic "
            f"values; enable the critic or pick a critic-free estimator ({critic_free})"
        )


def fast_engine_on_a_gpu(cfg: RunSections) -> Iterator[str]:
    # (servers of one's own, launcher.kind=external, are started as their owner chose)
    engine = cfg.actor_rollout_ref.rollout.name
    # vllm on a CPU without vllm is generated by the native engine (preflight's
    # vllm_on_cpu_warning): verl names an engine in every command line, so its lines name
    # vLLM wherever pasted
    gpu_only = engine == "fast" and cfg.launcher.kind != "external"
    if gpu_only and cfg.trainer.device != "cuda":
        yield (
            f"actor_rollout_ref.rollout.name={engine} generates on a CUDA GPU, but trainer."
            f"device={cfg.trainer.device} puts the run on the CPU (meshrl's default; verl's is "
            "cuda): set trainer.device=cuda, or drop rollout.name for the built-in engines, "
            "which run on either"
        )


def critic_reads_no_tokenizer(cfg: RunSections) -> Iterator[str]:
    actor_model, critic_tokenizer = cfg.actor_rollout_ref.model, cfg.critic.model.tokenizer_path
    if critic_tokenizer and critic_tokenizer not in (actor_model.tokenizer_path, actor_model.path):
        yield (
            f"critic.model.tokenizer_path={critic_tokenizer}: the critic scores the actor's "
            "tokens and reads no tokenizer of its own (its model must share the actor's "
            "vocabulary); drop it"
        )


def reward_model_has_a_path(cfg: RunSections) -> Iterator[str]:
    # (that a local path is a folder is preflight's: it reads this machine's files)
    rm = cfg.reward.reward_model
    if rm.enable and not rm.path:
        yield (
            "reward.reward_model.enable=true, but reward.reward_model.path is empty: name the "
            "reward model's folder"
        )


def val_only_has_val_files(cfg: RunSections) -> Iterator[str]:
    if cfg.trainer.val_only and not cfg.data.val_files:
        yield (
            "trainer.val_only=true validates and stops, but data.val_files is empty: name the "
            "validation parquet files"
        )


def overlong_buffer_within_responses(cfg: RunSections) -> Iterator[str]:
    overlong = cfg.reward.overlong_buffer
    if overlong.enable and overlong.len > cfg.data.max_response_length:
        yield (
            f"reward.overlong_buffer.len={overlong.len} exceeds data.max_response_length="
            f"{cfg.data.max_response_length}: every response would be penalised; set it to at "
            "most the response limit (DAPO: a quarter of it)"
        )


def gen_batch_only_with_dynamic_sampling(cfg: RunSections) -> Iterator[str]:
    gen, train = cfg.data.gen_batch_size, cfg.data.train_batch_size
    if gen not in (None, train) and not cfg.algorithm.filter_groups.enable:
        yield (
            f"data.gen_batch_size={gen} differs from data.train_batch_size={train}, but only "
            "dynamic sampling generates batches apart from the training batch: set "
            "algorithm.filter_groups.enable=true, or drop data.gen_batch_size (verl would "
            f"train on all {gen} prompts)"
        )


def enough_generation_batches(cfg: RunSections) -> Iterator[str]:
    fg = cfg.algorithm.filter_groups
    gen, train = cfg.data.gen_batch_size, cfg.data.train_batch_size
    if fg.enable and 0 < fg.max_num_gen_batches and (gen or train) * fg.max_num_gen_batches < train:
        yield (
            f"data.gen_batch_size={gen} x algorithm.filter_groups.max_num_gen_batches="
            f"{fg.max_num_gen_batches} prompts are fewer than data.train_batch_size={train}: "
            "every step would fail; raise either"
        )


def filter_metric_before_the_kl_penalty(cfg: RunSections) -> Iterator[str]:
    fg = cfg.algorithm.filter_groups
    if fg.enable and fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        yield (
            "algorithm.filter_groups.metric=seq_final_reward with "
            "algorithm.use_kl_in_reward=true: the groups are picked right after scoring, "
            "before the reference log-probs that the KL penalty needs exist; filter by "
            "seq_reward (the same reward without the KL penalty) or set "
            "algorithm.use_kl_in_reward=false (a KL loss, actor.use_kl_loss, works with it)"
        )


def groups_to_filter(cfg: RunSections) -> Iterator[str]:
    n = cfg.actor_rollout_ref.rollout.n
    if cfg.algorithm.filter_groups.enable and n < 2:
        yield (
            f"algorithm.filter_groups.enable=true needs groups to filter: "
            f"actor_rollout_ref.rollout.n={n} gives one sample a prompt; set it to 2 or more"
        )


def no_greedy_baseline_with_filtering(cfg: RunSections) -> Iterator[str]:
    estimator = advantage_estimator(cfg.algorithm.adv_estimator)
    if cfg.algorithm.filter_groups.enable and estimator.needs_greedy_baseline:
        yield (
            f"algorithm.filter_groups.enable=true with algorithm.adv_estimator={estimator.name}: "
            "its greedy baseline is generated for the step's prompts before any are filtered; "
            "pick grpo, rloo or another estimator"
        )


# -- required: the keys a run must set ---------------------------------------------------


def train_files_given(cfg: RunSections) -> Iterator[str]:
    # an evaluation (trainer.val_only) reads none; the readers' own error names no key
    if not cfg.data.train_files and not cfg.trainer.val_only:
        yield (
            "data.train_files is empty: name the training parquet files "
            "(data.train_files=train.parquet, or [a.parquet,b.parquet])"
        )


def model_path_given(cfg: RunSections) -> Iterator[str]:
    if not cfg.actor_rollout_ref.model.path:
        yield (
            "actor_rollout_ref.model.path is empty: set it to a Hugging Face model folder or hub id"
        )


RULES: tuple[Rule, ...] = (
    Rule(clip_cov_bounds_ordered, "load"),
    Rule(role_pools_exist, "load"),
    Rule(tls_files_in_pairs, "load"),
    Rule(mini_batches_divide_the_batch, "load"),
    Rule(one_step_off_without_dynamic_sampling, "load"),
    Rule(partial_rollout_kv_kept_only_off_vllm, "load"),
    Rule(async_training_alone, "load"),
    Rule(rollout_log_probs_for_their_consumers, "load"),
    Rule(megatron_runs_as_asked, "load"),
    Rule(critic_for_the_estimator, "run"),
    Rule(fast_engine_on_a_gpu, "run"),
    Rule(critic_reads_no_tokenizer, "run"),
    Rule(reward_model_has_a_path, "run"),
    Rule(val_only_has_val_files, "run"),
    Rule(overlong_buffer_within_responses, "run"),
    Rule(gen_batch_only_with_dynamic_sampling, "run"),
    Rule(enough_generation_batches, "run"),
    Rule(filter_metric_before_the_kl_penalty, "run"),
    Rule(groups_to_filter, "run"),
    Rule(no_greedy_baseline_with_filtering, "run"),
    Rule(train_files_given, "required"),
    Rule(model_path_given, "required"),
)
"""Every cross-key rule of the config, in the order their lines are reported."""


def config_problems(cfg: RunSections, when: When) -> list[str]:
    """The lines of every rule of ``when`` that ``cfg`` breaks: all of them, so that a
    pasted command line is fixed in one round."""
    return [line for rule in RULES if rule.when == when for line in rule.check(cfg)]


def raise_problems(problems: list[str]) -> None:
    """One ConfigError for all of them: one alone as it is, several listed as the schema's
    errors are (``invalid config:`` then a line each)."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def check_config(cfg: RunSections, when: When) -> None:
    """Raises one ConfigError naming every rule of ``when`` that ``cfg`` breaks."""
    raise_problems(config_problems(cfg, when))
