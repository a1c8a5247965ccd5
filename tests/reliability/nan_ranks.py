"""One rank of the two-rank NaN test (test_nan_loss.py), run in a spawned process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class TwoLayers(nn.Module):
    """8 hidden units, one output. FSDP2 shards every parameter along dim 0, so the output
    layer's weight (1, 8) is all on rank 0 and rank 1 holds an empty shard of it."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(4, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, bump: torch.Tensor) -> torch.Tensor:
        # d out / d out.weight = the hidden activations: an inf in `bump` makes that one
        # gradient infinite and leaves the others (out.bias, the hidden layer's) finite.
        return self.out(self.hidden(x) + bump)


def run_rank(rank: int, init_file: str, poison: str, out_path: str) -> None:
    """``poison``: "nan_loss" (rank 1's loss is NaN) or "one_shard" (rank 1 puts an inf
    into the output layer's weight gradient, which lands in rank 0's shard only)."""
    from torch.distributed.fsdp import fully_shard

    from services.trainer.distributed import World
    from services.trainer.optim import LrSchedule
    from services.trainer.update_loop import UpdateSettings, run_update

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        world = World.current("cpu")
        torch.manual_seed(0)  # the same weights on both ranks
        model = TwoLayers()
        fully_shard(model, mesh=world.mesh)  # one unit, as shard_model's "model" units
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        x = torch.ones(4, 4)

        def full_params() -> dict[str, torch.Tensor]:
            return {n: p.full_tensor().clone() for n, p in model.named_parameters()}

        def update(poisoned: bool) -> dict[str, float]:
            def micro_loss(micro, mini):
                bump = torch.zeros(8)
                if poisoned and world.rank == 1 and poison == "one_shard":
                    bump[0] = float("inf")
                loss = model(x[micro.rows], bump).sum()
                if poisoned and world.rank == 1 and poison == "nan_loss":
                    loss = loss * float("nan")
                return loss, {"actor/pg_loss": loss.detach()}

            settings = UpdateSettings(
                mini_batch_rows=2, micro_batch_rows=1, epochs=1, shuffle=False, grad_clip=1.0,
                seed=0,
            )  # fmt: skip
            return run_update(
                torch.full((4,), 3), settings, 1, micro_loss, model, opt, LrSchedule(lr=0.1),
                world, "actor",
            )  # fmt: skip

        before = full_params()
        poisoned = update(True)
        after_poisoned = full_params()
        state_after_poisoned = bool(opt.state)
        clean = update(False)
        after_clean = full_params()
        torch.save(
            {
                "poisoned": poisoned,
                "unchanged": all(torch.equal(before[n], after_poisoned[n]) for n in before),
                "state_after_poisoned": state_after_poisoned,
                "clean": clean,
                "moved": any(not torch.equal(before[n], after_clean[n]) for n in before),
                "finite": all(torch.isfinite(t).all() for t in after_clean.values()),
            },
            out_path,
        )
    finally:
        dist.destroy_process_group()
