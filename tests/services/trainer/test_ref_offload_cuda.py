"""The reference's weights offloaded to CPU memory (`actor_rollout_ref.ref.param_offload`,
verl's `ref.fsdp_config.param_offload`): the same log-probs as a reference resident on the
GPU, with its weights back in pinned CPU memory after every pass."""

import pytest
import torch
from trainer_helpers import make_batch, trainer_config

from services.trainer.distributed import World, init_distributed
from services.trainer.reference import RefRole

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _shards(role: RefRole) -> list[torch.Tensor]:
    return [p.to_local() for p in role.model.parameters()]


def test_an_offloaded_reference_scores_as_a_resident_one_from_cpu_memory(tiny_model_dir):
    init_distributed()
    world = World.current("cuda")
    exact = ["trainer.device=cuda", "actor_rollout_ref.model.dtype=float32"]
    resident = RefRole.build(trainer_config(tiny_model_dir, exact), world)
    before = torch.cuda.memory_allocated()
    offloaded = RefRole.build(
        trainer_config(tiny_model_dir, [*exact, "actor_rollout_ref.ref.param_offload=true"]),
        world,
    )
    assert all(t.device.type == "cuda" for t in _shards(resident))
    assert all(t.device.type == "cpu" and t.is_pinned() for t in _shards(offloaded))
    batch = make_batch(5, seed=6)
    want, _ = resident.compute_log_probs(batch)
    got, _ = offloaded.compute_log_probs(batch)
    torch.testing.assert_close(got.values, want.values, atol=1e-6, rtol=0)
    # after the pass the gathered copy is freed: the weights live in CPU memory only
    assert all(t.device.type == "cpu" for t in _shards(offloaded))
    torch.cuda.synchronize()
    weights = sum(t.numel() * t.element_size() for t in _shards(offloaded))
    assert torch.cuda.memory_allocated() - before < weights
