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
