import math

import pytest
import torch

from meshrl.config.sections import OptimConfig
from services.trainer.optim import LrSchedule, build_optimizer, clipped_step


def test_warmup_then_constant():
    s = LrSchedule(lr=1.0, warmup_steps=4)
    # PPO steps are 1-based: step 1 already learns at lr / warmup.
    assert [s.lr_at(step) for step in range(1, 7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_to_the_floor():
    s = LrSchedule(lr=2.0, warmup_steps=0, kind="cosine", min_lr_ratio=0.1, total_steps=10)
    assert s.lr_at(1) == pytest.approx(2.0)
    # Update index 5 of a 10-step span (HF/verl's convention): cos(pi/2) = 0 -> half-way.
    assert s.lr_at(6) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))
    assert s.lr_at(11) == pytest.approx(0.2)
    assert s.lr_at(50) == pytest.approx(0.2)  # stays at the floor past the end


def test_cosine_needs_a_length():
    cfg = OptimConfig(lr=1e-3, lr_scheduler_type="cosine")
    with pytest.raises(ValueError, match="total_training_steps"):
        LrSchedule.from_config(cfg, None)
    assert LrSchedule.from_config(cfg, 100).total_steps == 100


def test_optimizer_follows_the_config():
    layer = torch.nn.Linear(3, 2)
    opt = build_optimizer(
        layer.parameters(), OptimConfig(lr=0.5, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    )
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        0.5,
        (0.8, 0.9),
        1e-6,
        0.1,
    )


def test_clipping_and_skipping_a_non_finite_step():
    layer = torch.nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    layer.weight.grad = torch.tensor([[3.0, 4.0]])  # norm 5, clipped to 1
    before = layer.weight.detach().clone()
    result = clipped_step(list(layer.parameters()), opt, max_norm=1.0)
    assert float(result.grad_norm) == pytest.approx(5.0) and not result.skipped
    torch.testing.assert_close(layer.weight.detach(), before - torch.tensor([[0.6, 0.8]]))
    assert layer.weight.grad is None  # zeroed for the next mini-batch

    layer.weight.grad = torch.tensor([[float("nan"), 1.0]])
    before = layer.weight.detach().clone()
    result = clipped_step(list(layer.parameters()), opt, max_norm=1.0)
    assert result.skipped and math.isnan(float(result.grad_norm))
    assert torch.equal(layer.weight.detach(), before)


def test_clip_on_local_shards_equals_torch_clip_on_dtensors():
    """Our norm and scaling over FSDP2's local shards = clip_grad_norm_ over the DTensors."""
    from torch.distributed.fsdp import fully_shard

    from services.trainer.distributed import World, init_distributed
    from services.trainer.optim import clip_grad_norm

    init_distributed()
    mesh = World.current("cpu").mesh
    torch.manual_seed(0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = fully_shard(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)), mesh=mesh
        )
        model(
            torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
        ).square().sum().backward()
        models.append(model)
    ours = clip_grad_norm(list(models[0].parameters()), 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(list(models[1].parameters()), 0.5)
    assert float(ours) == pytest.approx(float(theirs.full_tensor()), rel=1e-6)
    assert float(ours) > 0.5  # so the gradients were scaled
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor())


def test_fused_adamw_on_local_shards_equals_its_step():
    """The fused AdamW step on FSDP2's local shards = AdamW(fused=True).step() on the
    DTensors, bit for bit; before the moments exist it declines (the first step)."""
    from torch.distributed.fsdp import fully_shard

    from services.trainer.distributed import World, init_distributed
    from services.trainer.optim import fused_adamw_on_local_shards

    init_distributed()
    mesh = World.current("cpu").mesh
    pairs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = fully_shard(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)), mesh=mesh
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        pairs.append((model, opt))

    def backward(model, seed):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
        model(x).square().sum().backward()

    for model, _opt in pairs:
        backward(model, 1)
    assert not fused_adamw_on_local_shards(pairs[0][1])  # no moments yet: declined
    for model, opt in pairs:
        opt.step()
        opt.zero_grad()
        backward(model, 2)
    assert fused_adamw_on_local_shards(pairs[0][1])
    pairs[1][1].step()
    for a, b in zip(pairs[0][0].parameters(), pairs[1][0].parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor())
        sa, sb = pairs[0][1].state[a], pairs[1][1].state[b]
        assert torch.equal(sa["exp_avg"].full_tensor(), sb["exp_avg"].full_tensor())
        assert torch.equal(sa["step"], sb["step"]) and float(sa["step"]) == 2


def test_fused_adamw_skips_a_non_finite_step_on_the_device():
    """A nan gradient: the fused step on local shards changes no parameter, moment or step
    count, decided by the kernel (found_inf), not by the host."""
    from torch.distributed.fsdp import fully_shard

    from services.trainer.distributed import World, init_distributed

    init_distributed()
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 2), mesh=World.current("cpu").mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    params = list(model.parameters())
    for _ in range(2):  # the first step creates the moments (torch's own step)
        model(torch.randn(3, 4)).sum().backward()
        result = clipped_step(params, opt, max_norm=1.0)
        assert not result.skipped
    before = {id(p): (p.full_tensor().clone(), opt.state[p]["exp_avg"].full_tensor().clone())
              for p in params}  # fmt: skip
    model(torch.randn(3, 4)).sum().backward()
    params[0].grad.to_local()[0, 0] = float("nan")
    result = clipped_step(params, opt, max_norm=1.0)
    assert result.skipped and math.isnan(float(result.grad_norm))
    for p in params:
        weight, moment = before[id(p)]
        assert torch.equal(p.full_tensor(), weight)
        assert torch.equal(opt.state[p]["exp_avg"].full_tensor(), moment)
        assert float(opt.state[p]["step"]) == 2
        assert p.grad is None


def test_schedule_counts_from_the_roles_first_update():
    # A role whose first update is at PPO step 3 (the actor after critic_warmup=2) warms
    # up over its own updates 3, 4, 5, 6, not over the PPO steps.
    s = LrSchedule(lr=1.0, warmup_steps=4, first_step=3)
    assert [s.lr_at(step) for step in range(3, 9)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cfg = OptimConfig(lr=1.0, lr_warmup_steps=4)
    assert LrSchedule.from_config(cfg, None, first_step=3) == s
