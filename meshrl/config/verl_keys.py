"""verl keys that meshrl does not have, or has under another name: what to do instead.

Such a key stays an error (a key silently ignored would let a verl user believe it took
effect); the table makes the error say what meshrl does instead. The exceptions, each
marked in its entry: a value that asks for what meshrl does anyway (``same_here``), a knob
of verl's own machinery that changes nothing of a run's result (``any_value``), and a key
that means exactly a meshrl key (``moves_to``). A table key also
answers for the keys below it: `actor_rollout_ref.actor.fsdp_config` covers
`actor_rollout_ref.actor.fsdp_config.param_offload`. tests/config/test_verl_keys.py checks
that every key here is unknown to the schema and every key it points to exists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerlKey:
    use: str = ""
    """The meshrl key to set instead (optionally as `key=<what>`); empty when there is none."""
    why: str = ""
    """What meshrl does instead, or why the key is not needed here."""
    same_here: tuple[object, ...] = ()
    """Values with which the key asks for what meshrl does anyway (one GPU for a rollout
    server, one node, no CPU offload): accepted and dropped, so that verl's example lines
    run as pasted."""
    any_value: bool = False
    """A knob of verl's own machinery (data loader workers, shared-memory loading, vLLM's
    chunked prefill) that changes nothing of a run's result, and that meshrl's own machinery
    has no counterpart of: accepted and dropped with any value."""
    moves_to: str = ""
    """The meshrl key that means exactly what this one does, values and all: its value goes
    there unless the config sets that key (then the two must agree, or this one is
    refused)."""
    implies: tuple[tuple[str, object], ...] = ()
    """(meshrl key, value) pairs that an accepted value asks for where verl's defaults
    differ from meshrl's, set where the config does not set them: `n_gpus_per_node=1`
    trains on a GPU, verl's default device, not on meshrl's CPU."""

    def hint(self) -> str:
        accepted = ""
        if self.same_here:
            values = " or ".join(
                str(v).lower() if isinstance(v, bool) else str(v) for v in self.same_here
            )
            accepted = f"; only {values}, which asks for what meshrl does anyway, is accepted"
        if not self.use:
            return f"unknown config key (verl's), not used here: {self.why}{accepted}"
        note = f" ({self.why})" if self.why else ""
        return f"unknown config key (verl's): set {self.use} instead{note}{accepted}"


_FSDP = (
    "each trainer role is FSDP2-sharded over its world_size ranks (or split by Megatron-Core "
    "with strategy=megatron, <role>.megatron.*); its weights and optimizer in CPU memory "
    "between calls: <role>.param_offload / optimizer_offload"
)
_PER_RANK = "responses per forward on each rank"
_MASTERS = "master weights stay float32; this is the dtype forwards and backwards compute in"
_LOADS = "model folders are read from local disk as they are"
_ENGINE = "the native engine sizes its prefill chunks itself; with vLLM, vLLM's defaults"

VERL_KEYS: dict[str, VerlKey] = {
    # data
    "data.tokenizer": VerlKey(use="actor_rollout_ref.model.tokenizer_path"),
    "data.return_raw_chat": VerlKey(
        why="rollout gets the prompts as data.apply_chat_template renders them, and a reward "
        "model always gets each row's chat messages, rendered with its own chat template",
        # verl's true hands the messages to a rollout server that renders them the same way
        same_here=(True, False),
    ),
    "data.dataloader_num_workers": VerlKey(
        why="the prompts are read once, into memory", any_value=True
    ),
    "data.reward_fn_key": VerlKey(why="scorers are picked by each row's data_source column"),
    # actor, rollout, reference
    "actor_rollout_ref.model.trust_remote_code": VerlKey(
        why="models load without remote code: only architectures transformers ships"
    ),
    "actor_rollout_ref.actor.fsdp_config": VerlKey(
        why=f"{_FSDP}; the compute dtype is actor_rollout_ref.model.dtype"
    ),
    "actor_rollout_ref.actor.fsdp_config.param_offload": VerlKey(
        use="actor_rollout_ref.actor.param_offload",
        why="the same setting; this config gives both, with different values",
        moves_to="actor_rollout_ref.actor.param_offload",
    ),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": VerlKey(
        use="actor_rollout_ref.actor.optimizer_offload",
        why="the same setting; this config gives both, with different values",
        moves_to="actor_rollout_ref.actor.optimizer_offload",
    ),
    "actor_rollout_ref.actor.fsdp_config.grad_offload": VerlKey(why=_FSDP, same_here=(False,)),
    "actor_rollout_ref.actor.fsdp_config.model_dtype": VerlKey(
        use="actor_rollout_ref.model.dtype", why=_MASTERS
    ),
    "actor_rollout_ref.model.enable_activation_offload": VerlKey(
        use="actor_rollout_ref.model.enable_gradient_checkpointing=true",
        why="activations are not offloaded to the CPU; recomputing them saves the memory",
        same_here=(False,),
    ),
    "actor_rollout_ref.model.use_shm": VerlKey(why=_LOADS, any_value=True),
    "actor_rollout_ref.model.lora": VerlKey(
        use="actor_rollout_ref.model.lora_rank",
        why="LoRA is actor_rollout_ref.model.lora_rank, lora_alpha and target_modules",
    ),
    "actor_rollout_ref.model.lora.merge": VerlKey(
        why="rollout always gets the adapters merged into the base weights", same_here=(True,)
    ),
    "actor_rollout_ref.actor.ppo_micro_batch_size": VerlKey(
        use="actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", why=_PER_RANK
    ),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": VerlKey(
        why="no sequence parallelism: a trainer role's ranks shard the model (FSDP2)"
    ),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": VerlKey(
        use="actor_rollout_ref.actor.optim.lr_warmup_steps",
        why="a number of steps, not a ratio",
        same_here=(0, 0.0),  # no warm-up
    ),
    "actor_rollout_ref.actor.optim.warmup_style": VerlKey(
        use="actor_rollout_ref.actor.optim.lr_scheduler_type"
    ),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": VerlKey(
        why="each rollout server holds the whole model on one device (vLLM too); more servers: "
        "actor_rollout_ref.rollout.replicas",
        same_here=(1,),
    ),
    "actor_rollout_ref.rollout.do_sample": VerlKey(
        use="actor_rollout_ref.rollout.temperature=0",
        why="training rollouts sample; greedy ones have temperature 0",
        same_here=(True,),
    ),
    "data.train_max_samples": VerlKey(
        use="data.max_samples",
        why="the same setting; this config gives both, with different values",
        moves_to="data.max_samples",
    ),
    "actor_rollout_ref.rollout.enable_sleep_mode": VerlKey(
        use="actor_rollout_ref.rollout.free_cache_engine",
        why="the same setting; this config gives both, with different values",
        moves_to="actor_rollout_ref.rollout.free_cache_engine",
    ),
    "actor_rollout_ref.rollout.max_model_len": VerlKey(
        why="the engine's context is data.max_prompt_length + data.max_response_length"
    ),
    "actor_rollout_ref.rollout.max_num_batched_tokens": VerlKey(why=_ENGINE, any_value=True),
    "actor_rollout_ref.rollout.enable_chunked_prefill": VerlKey(why=_ENGINE, any_value=True),
    "actor_rollout_ref.rollout.load_format": VerlKey(why=_LOADS, any_value=True),
    "actor_rollout_ref.rollout.layered_summon": VerlKey(
        why="the actor streams its weights to rollout in buckets, not layer by layer gathered",
        any_value=True,
    ),
    "actor_rollout_ref.rollout.engine_kwargs": VerlKey(
        why="vLLM's options are not passed through: meshrl's adapter sets its dtype, "
        "gpu_memory_utilization, enforce_eager, max_num_seqs and max_model_len from "
        "actor_rollout_ref.rollout"
    ),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": VerlKey(
        use="actor_rollout_ref.rollout.multi_turn.environment",
        why="tools are those of the env server's environments (docs/multi_turn.md)",
    ),
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": VerlKey(
        use="actor_rollout_ref.rollout.multi_turn.environment",
        why="interactions are the env server's environments (docs/multi_turn.md)",
    ),
    "actor_rollout_ref.rollout.mode": VerlKey(
        why="rollout always runs as servers of its own (no sync or async mode, no agent "
        "loop); more servers: actor_rollout_ref.rollout.replicas"
    ),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": VerlKey(
        use="actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", why=_PER_RANK
    ),
    "actor_rollout_ref.ref.fsdp_config": VerlKey(
        why="the reference is always FSDP2-sharded over its world_size ranks; its weights in "
        "CPU memory: actor_rollout_ref.ref.param_offload; the compute dtype is "
        "actor_rollout_ref.model.dtype"
    ),
    "actor_rollout_ref.ref.fsdp_config.param_offload": VerlKey(
        use="actor_rollout_ref.ref.param_offload",
        why="the same setting; this config gives both, with different values",
        moves_to="actor_rollout_ref.ref.param_offload",
    ),
    "actor_rollout_ref.ref.fsdp_config.model_dtype": VerlKey(
        use="actor_rollout_ref.model.dtype", why=_MASTERS
    ),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": VerlKey(
        use="actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", why=_PER_RANK
    ),
    # critic
    "critic.model.fsdp_config": VerlKey(why=f"{_FSDP}; the compute dtype is critic.model.dtype"),
    "critic.model.fsdp_config.param_offload": VerlKey(
        use="critic.param_offload",
        why="the same setting; this config gives both, with different values",
        moves_to="critic.param_offload",
    ),
    "critic.model.fsdp_config.optimizer_offload": VerlKey(
        use="critic.optimizer_offload",
        why="the same setting; this config gives both, with different values",
        moves_to="critic.optimizer_offload",
    ),
    "critic.model.fsdp_config.grad_offload": VerlKey(why=_FSDP, same_here=(False,)),
    "critic.model.fsdp_config.model_dtype": VerlKey(use="critic.model.dtype", why=_MASTERS),
    "critic.model.use_shm": VerlKey(why=_LOADS, any_value=True),
    "critic.model.enable_activation_offload": VerlKey(
        use="critic.model.enable_gradient_checkpointing=true",
        why="activations are not offloaded to the CPU; recomputing them saves the memory",
        same_here=(False,),
    ),
    "critic.ppo_micro_batch_size": VerlKey(
        use="critic.ppo_micro_batch_size_per_gpu", why=_PER_RANK
    ),
    "critic.optim.lr_warmup_steps_ratio": VerlKey(
        use="critic.optim.lr_warmup_steps", why="a number of steps, not a ratio", same_here=(0, 0.0)
    ),
    "critic.optim.warmup_style": VerlKey(use="critic.optim.lr_scheduler_type"),
    # reward
    "custom_reward_function": VerlKey(
        use="reward.custom_function=path/to/file.py:function_name",
        why="verl's path and name in one value; the name defaults to compute_score",
    ),
    "reward_model": VerlKey(
        why="the reward model is reward.reward_model, DAPO's overlong penalty "
        "reward.overlong_buffer"
    ),
    "reward_model.enable": VerlKey(use="reward.reward_model.enable", same_here=(False,)),
    "reward_model.model.path": VerlKey(use="reward.reward_model.path"),
    "reward_model.micro_batch_size_per_gpu": VerlKey(use="reward.reward_model.micro_batch_size"),
    "reward_model.max_length": VerlKey(use="reward.reward_model.max_length"),
    "reward_model.overlong_buffer": VerlKey(use="reward.overlong_buffer"),
    "reward_model.reward_manager": VerlKey(
        why="rule scorers are picked by each row's data_source; your own function: "
        "reward.custom_function"
    ),
    # trainer
    "trainer.critic_warmup": VerlKey(
        use="critic.critic_warmup",
        why="the actor then starts at step N+1, verl's at step N",
        same_here=(0,),  # the actor trains from the first step in both
    ),
    "trainer.n_gpus_per_node": VerlKey(
        why="with trainer.device=cuda the roles take the GPUs: ranks per trainer role "
        "(actor_rollout_ref.actor.world_size, critic.world_size, "
        "actor_rollout_ref.ref.world_size), actor_rollout_ref.rollout.replicas rollout "
        "servers, placed by launcher.role_gpus",
        same_here=(1,),
        implies=(("trainer.device", "cuda"),),  # unless trainer.device is set
    ),
    "trainer.nnodes": VerlKey(
        why="the local launcher runs every role here; across nodes: --launcher ray with "
        "launcher.resource_pool (a trainer role's ranks stay on one node)",
        same_here=(1,),
    ),
    "trainer.max_actor_ckpt_to_keep": VerlKey(
        use="trainer.max_ckpt_to_keep", why="one count: each checkpoint holds every role"
    ),
    "trainer.max_critic_ckpt_to_keep": VerlKey(
        use="trainer.max_ckpt_to_keep", why="one count: each checkpoint holds every role"
    ),
    "trainer.resume_from_path": VerlKey(use="trainer.resume_mode=<checkpoint path>"),
    "trainer.val_generations_to_log_to_wandb": VerlKey(use="trainer.log_val_generations"),
    "trainer.default_hdfs_dir": VerlKey(
        why="no HDFS copy: checkpoints stay in the run folder, trainer.default_local_dir",
        same_here=(None,),  # verl's default: no copy
    ),
    "trainer.balance_batch": VerlKey(
        why="with use_dynamic_bsz each trainer rank gets a share of the batch balanced by "
        "tokens; the result does not depend on it",
        any_value=True,
    ),
    "trainer.use_legacy_worker_impl": VerlKey(
        why="verl's choice between its own worker implementations", any_value=True
    ),
    # Ray
    "ray_init": VerlKey(
        why="--ray-address (launcher.ray_address) names the cluster; each pool's CPUs and GPUs "
        "are in launcher.resource_pool"
    ),
}


def verl_key(key: str) -> tuple[str, VerlKey] | None:
    """The table entry answering for dotted ``key``: its own, else its nearest section's."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in VERL_KEYS:
            return prefix, VERL_KEYS[prefix]
    return None


def drop_same_meaning(tree: dict) -> None:
    """Takes out of ``tree`` the verl keys set to a value that asks for what meshrl does
    anyway (``VerlKey.same_here``: `tensor_model_parallel_size=1`, `trainer.nnodes=1`,
    `fsdp_config.param_offload=false`, ...; ``any_value``), moves those that mean exactly a
    meshrl key to it (``moves_to``), sets what an accepted value implies (``implies``), and
    drops a verl section left empty by that. Any other value stays, to be refused with its
    hint."""
    for key, entry in VERL_KEYS.items():
        *parents, name = key.split(".")
        path = _sections_along(tree, parents)
        if path is None or name not in path[-1]:
            continue
        if entry.moves_to:
            if not _moved(tree, path[-1][name], entry.moves_to.split(".")):
                continue
        elif not (entry.same_here or entry.any_value):
            continue
        elif not entry.any_value and not _same(path[-1][name], entry.same_here):
            continue
        del path[-1][name]
        for implied, value in entry.implies:
            _set_unless_given(tree, implied.split("."), value)
        # `fsdp_config: {}` left behind would be refused as a verl key of its own
        for depth in range(len(parents), 0, -1):
            if path[depth] or ".".join(parents[:depth]) not in VERL_KEYS:
                break
            del path[depth - 1][parents[depth - 1]]


def _moved(tree: dict, value: object, parts: list[str]) -> bool:
    """Sets the key at ``parts`` to ``value`` unless it is set; whether the two now agree."""
    _set_unless_given(tree, parts, value)
    *parents, name = parts
    path = _sections_along(tree, parents)
    # plain equality: `true` and `1` agree, as the schema reads both
    return path is not None and path[-1].get(name) == value


def _set_unless_given(tree: dict, parts: list[str], value: object) -> None:
    *parents, name = parts
    for part in parents:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):  # a wrong section: the schema refuses it, named
            return
        tree = node
    tree.setdefault(name, value)


def _sections_along(tree: dict, parents: list[str]) -> list[dict] | None:
    """``tree`` and the mappings at each of ``parents`` below it; None where one is not a
    mapping (or is missing)."""
    path = [tree]
    for part in parents:
        node = path[-1].get(part)
        if not isinstance(node, dict):
            return None
        path.append(node)
    return path


def _same(value: object, accepted: tuple[object, ...]) -> bool:
    # by type too: True == 1 and 0 == False in Python, but nnodes=true is no node count
    return any(type(value) is type(v) and value == v for v in accepted)
