"""One rank of a Megatron actor, reference and critic on the CPU (gloo), run under torchrun
by test_megatron_tensor_parallel.py: ``python -m torch.distributed.run --nproc_per_node N
tp_worker.py MODEL_DIR OUT TP [CHECKPOINT_TO_LOAD]``. Scores, updates, reads the weights out
and round-trips a checkpoint; rank 0 writes what it saw to OUT (torch.save)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # trainer_helpers

from trainer_helpers import make_batch, trainer_config  # noqa: E402

from meshrl.ragged import Ragged  # noqa: E402
from services.trainer.actor import ActorRole  # noqa: E402
from services.trainer.critic import CriticRole  # noqa: E402
from services.trainer.distributed import World, init_distributed  # noqa: E402
from services.trainer.reference import RefRole  # noqa: E402


def _advantages(logprobs: Ragged, seed: int = 0) -> Ragged:
    g = torch.Generator().manual_seed(seed)
    return Ragged(torch.randn(logprobs.values.shape, generator=g), logprobs.offsets)


def main(model_dir: str, out: str, tp: int) -> None:
    torch.set_num_threads(1)
    init_distributed()
    world = World.current("cpu")
    sizes = [f"{role}.megatron.tensor_model_parallel_size={tp}"
             for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")]  # fmt: skip
    cfg = trainer_config(model_dir, [
        "actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.ref.strategy=megatron",
        "critic.strategy=megatron", "actor_rollout_ref.actor.grad_clip=0.5",
        f"actor_rollout_ref.actor.world_size={world.world_size}",
        f"actor_rollout_ref.ref.world_size={world.world_size}",
        f"critic.world_size={world.world_size}", *sizes,
    ])  # fmt: skip
    batch = make_batch(8, seed=1)
    r: dict = {}

    actor = ActorRole.build(cfg, world)
    r["data_ranks"] = actor.world.world_size
    r["num_parameters"] = actor.num_parameters
    lp, ent = actor.compute_log_probs(batch, with_entropy=True)
    r["logprobs"], r["entropy"] = lp.values, ent.values
    r["metrics"] = actor.update_policy(batch, lp, _advantages(lp), None, None, 1)
    r["after"] = actor.compute_log_probs(batch)[0].values
    r["weights"] = {n: t.clone() for n, t in actor.iter_full_params()}
    r["shapes"] = actor.named_param_shapes()

    r["ref"] = RefRole.build(cfg, world).compute_log_probs(batch)[0].values

    critic = CriticRole.build(cfg, world)
    values = critic.compute_values(batch)
    g = torch.Generator().manual_seed(4)
    returns = Ragged(torch.randn(values.values.shape, generator=g), values.offsets)
    r["critic_metrics"] = critic.update_value(batch, values, returns, 1)
    critic.update_value(batch, values, returns, 2)
    r["values"] = critic.compute_values(batch).values

    # a checkpoint round trip: the restored actor's weights, and its next update, are the
    # saved actor's (the optimizer's moments came back too)
    path = str(Path(out).parent / f"actor_tp{tp}_ws{world.world_size}")
    actor.save(path, with_optimizer=True)
    r["checkpoint"] = path
    r["next_metrics"] = actor.update_policy(batch, lp, _advantages(lp, 1), None, None, 2)
    restored = ActorRole.build(cfg, world)
    restored.load(path, with_optimizer=True)
    r["restored_weights"] = {n: t.clone() for n, t in restored.iter_full_params()}
    r["restored_metrics"] = restored.update_policy(batch, lp, _advantages(lp, 1), None, None, 2)
    r["restored_after"] = {n: t.clone() for n, t in restored.iter_full_params()}
    r["next_after"] = {n: t.clone() for n, t in actor.iter_full_params()}
    if world.rank == 0:
        torch.save(r, out)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
