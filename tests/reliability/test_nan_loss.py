"""A NaN loss: the trainer skips the optimizer step (weights and optimizer state untouched),
counts it in `<role>/nonfinite_grad_steps`, and the coordinator says so in its log."""

from __future__ import annotations

import multiprocessing as mp
from types import SimpleNamespace

import pytest
import torch
from nan_ranks import run_rank
from torch import nn

from services.coordinator.step.ppo_step import skipped_update_warnings
from services.trainer.optim import LrSchedule
from services.trainer.update_loop import UpdateSettings, run_update

ONE_RANK = SimpleNamespace(rank=0, world_size=1, all_reduce_sum=lambda t: t)


def _update(model: nn.Module, opt: torch.optim.Optimizer, loss_value: float | None) -> dict:
    x = torch.ones(4, 2)

    def micro_loss(micro, mini):
        out = model(x[micro.rows]).sum()
        loss = out * (float("nan") if loss_value is None else loss_value)
        return loss, {"actor/pg_loss": loss.detach()}

    settings = UpdateSettings(
        mini_batch_rows=2, micro_batch_rows=1, epochs=1, shuffle=False, grad_clip=1.0, seed=0
    )
    return run_update(
        torch.full((4,), 3),
        settings,
        1,
        micro_loss,
        model,
        opt,
        LrSchedule(lr=0.1),
        ONE_RANK,
        "actor",
    )


def test_nan_loss_skips_the_step_and_is_counted():
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = _update(model, opt, None)
    assert metrics["actor/nonfinite_grad_steps"] == 2.0  # both mini-batches skipped
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q), "weights must not move on a non-finite gradient"
    assert not opt.state, "no optimizer state was updated with NaN"
    # the next finite step trains normally: nothing was poisoned
    metrics = _update(model, opt, 1.0)
    assert metrics["actor/nonfinite_grad_steps"] == 0.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("poison", ["nan_loss", "one_shard"])
def test_two_real_ranks_skip_together(tmp_path, poison):
    """Two processes in a gloo group, the model sharded by FSDP2: a non-finite gradient on
    rank 1 alone makes both ranks skip the step, through the gradients' reduce-scatter
    ("nan_loss") or, when the inf lands in rank 0's shard only, through the all-reduce of
    the global norm ("one_shard"): rank 1's own shards stay finite there."""
    ctx = mp.get_context("spawn")
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    procs = [
        ctx.Process(target=run_rank, args=(r, str(tmp_path / "init"), poison, str(outs[r])))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(150)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for out in outs:
        result = torch.load(out)
        # 4 rows, mini-batches of 2: two optimizer steps, both skipped on both ranks
        assert result["poisoned"]["actor/nonfinite_grad_steps"] == 2.0
        assert result["unchanged"], "weights must not move on a non-finite gradient"
        assert not result["state_after_poisoned"]
        assert result["clean"]["actor/nonfinite_grad_steps"] == 0.0
        assert result["moved"] and result["finite"]


def test_coordinator_reports_skipped_steps():
    metrics = {"actor/nonfinite_grad_steps": 2.0, "critic/nonfinite_grad_steps": 0.0}
    assert skipped_update_warnings(metrics) == [
        "the actor skipped 2 optimizer step(s): the gradient norm was not finite (NaN/inf "
        "loss); its weights did not change in them"
    ]
    assert skipped_update_warnings({"actor/nonfinite_grad_steps": 0.0}) == []


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_each_role_is_named(role):
    (line,) = skipped_update_warnings({f"{role}/nonfinite_grad_steps": 1.0})
    assert line.startswith(f"the {role} skipped 1 optimizer step(s)")


def test_metrics_sink_writes_nan_as_null(tmp_path):
    """A NaN metric (e.g. the loss of a skipped step) does not break the JSONL file."""
    from services.coordinator.metrics.sinks import JsonlSink, read_jsonl

    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.log(1, {"actor/pg_loss": float("nan"), "actor/nonfinite_grad_steps": 1.0})
    sink.close()
    (row,) = read_jsonl(tmp_path / "m.jsonl")
    assert row["actor/pg_loss"] is None and row["actor/nonfinite_grad_steps"] == 1.0
