"""Which role servers share a GPU, from ``trainer.device`` and ``launcher.role_gpus``.

Both sides of a GPU hand-over read it: the coordinator, to free the rollout KV caches
after generation, and the trainer roles, to give their allocator's cached blocks back
after each call, so that the rollout can take its cache again.
"""

from __future__ import annotations

from meshrl.config.schema import RunConfig

TRAINER_ROLES = ("actor", "critic", "ref")


def rollout_shares_gpu(cfg: RunConfig) -> bool:
    """Whether a rollout server and a trainer role see the same GPUs (roles not placed
    see every GPU)."""
    if cfg.trainer.device != "cuda":
        return False
    placed = cfg.launcher.role_gpus
    return any(placed.get("rollout") == placed.get(role) for role in TRAINER_ROLES)


def hands_gpu_memory_over(cfg: RunConfig) -> bool:
    """``rollout.free_cache_engine`` on a GPU that rollout shares with a trainer role."""
    return cfg.actor_rollout_ref.rollout.free_cache_engine and rollout_shares_gpu(cfg)


def rollout_may_share_trainer_gpus(cfg: RunConfig) -> bool:
    """Whether, as far as the config says, rollout computes on a GPU of a trainer role: the
    local launcher's ``role_gpus`` (as :func:`rollout_shares_gpu`), Ray's ``role_pool``
    (roles of one pool share its bundles; unnamed roles are in "global"). False for servers
    started elsewhere (launcher.kind=external), whose placement the config does not know."""
    if cfg.trainer.device != "cuda":
        return False
    if cfg.launcher.kind == "ray":
        pools = cfg.launcher.role_pool
        return any(pools.get("rollout", "global") == pools.get(r, "global") for r in TRAINER_ROLES)
    return cfg.launcher.kind == "local" and rollout_shares_gpu(cfg)


def updates_share_gpu(cfg: RunConfig) -> bool:
    """Whether the actor and the critic train on the same GPU: their updates then run one
    after the other (together, their activations and gradients would add up, for little
    gain on a device each of them keeps busy)."""
    if cfg.trainer.device != "cuda":
        return False
    placed = cfg.launcher.role_gpus
    if cfg.launcher.kind == "ray":
        pools = cfg.launcher.role_pool
        return pools.get("actor", "global") == pools.get("critic", "global")
    return cfg.launcher.kind == "local" and placed.get("actor") == placed.get("critic")


def loads_one_at_a_time(cfg: RunConfig) -> bool:
    """Whether the role servers load their models one after the other: when a role offloads
    its state on a GPU it shares with rollout. Each loads its whole model on the GPU before
    it shards and offloads it, so loaded together they would need what offloading saves."""
    arr = cfg.actor_rollout_ref
    offloads = (
        arr.actor.param_offload,
        arr.actor.optimizer_offload,
        cfg.critic.param_offload,
        cfg.critic.optimizer_offload,
        arr.ref.param_offload,
    )
    return any(offloads) and rollout_shares_gpu(cfg)
