"""A trained role's weights and optimizer moments in CPU memory between its calls
(`param_offload`, `optimizer_offload`; docs/memory.md): the same update as a resident
role's, and nothing of either left on the GPU after a call."""

import pytest
import torch
from trainer_helpers import make_batch, trainer_config

from meshrl.testing.tiny_model import make_tiny_model_dir
from services.trainer.actor import ActorRole
from services.trainer.distributed import World, init_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXACT = [
    "trainer.device=cuda",
    "actor_rollout_ref.model.dtype=float32",
    "actor_rollout_ref.actor.use_torch_compile=false",
    "actor_rollout_ref.actor.optim.lr=1e-3",
]
OFFLOAD = [
    "actor_rollout_ref.actor.param_offload=true",
    "actor_rollout_ref.actor.optimizer_offload=true",
]


def _two_updates(actor: ActorRole, after_each_call) -> torch.Tensor:
    for step in (1, 2):
        batch = make_batch(8, seed=step)
        actor.memory.load(with_optimizer=False)
        old, _ = actor.compute_log_probs(batch)
        after_each_call()
        actor.memory.load(with_optimizer=True)
        adv = old.with_values(torch.linspace(-1, 1, old.values.numel()))
        actor.update_policy(batch, old, adv, None, None, global_step=step)
        after_each_call()
    actor.memory.load(with_optimizer=False)
    new, _ = actor.compute_log_probs(make_batch(8, seed=9))
    return new.values.cpu()


def test_an_offloaded_actor_updates_as_a_resident_one(tmp_path):
    init_distributed()
    world = World.current("cuda")
    model = make_tiny_model_dir(
        tmp_path / "m", seed=0, hidden=256, layers=2, heads=4, intermediate=512
    )
    resident = ActorRole.build(trainer_config(model, EXACT), world)
    want = _two_updates(resident, lambda: None)
    del resident
    torch.cuda.empty_cache()

    offloaded = ActorRole.build(trainer_config(model, [*EXACT, *OFFLOAD]), world)
    held: list[int] = []

    def released():
        offloaded.memory.release()
        held.append(offloaded.memory.device_bytes())
        states = [v for s in offloaded.optimizer.state.values() for v in s.values()]
        assert all(t.device.type == "cpu" for t in states if torch.is_tensor(t))

    got = _two_updates(offloaded, released)
    assert held == [0, 0, 0, 0]  # weights and moments off the GPU after every call
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
