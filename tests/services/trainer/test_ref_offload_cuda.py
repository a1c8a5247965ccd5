"""The reference's weights offloaded to CPU memory (`actor_rollout_ref.ref.param_offload`,
verl's `ref.fsdp_config.param_offload`): the same log-probs as a reference resident on the
GPU, with its weights back in pinned CPU memory after every pass."""

import pytest
import torch
from trainer_helpers import make_batch, trainer_config

from meshrl.testing.tiny_model import make_tiny_model_dir
from services.trainer.distributed import World, init_distributed
from services.trainer.reference import RefRole

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXACT = ["trainer.device=cuda", "actor_rollout_ref.model.dtype=float32"]


@pytest.fixture(scope="module")
def model_of_40_mb(tmp_path_factory):
    """About 10M float32 parameters: far more than the GPU's lazy workspaces (cuBLAS)."""
    path = tmp_path_factory.mktemp("ref_model")
    return make_tiny_model_dir(path, seed=0, hidden=512, layers=4, heads=8, intermediate=1024)


def _shards(role: RefRole) -> list[torch.Tensor]:
    return [p.to_local() for p in role.model.parameters()]


def _gpu_bytes() -> int:
    """What this process holds of the GPU: reserved, not only allocated (the caching
    allocator keeps freed blocks for itself, and other processes cannot use them)."""
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved()


def test_an_offloaded_reference_scores_as_a_resident_one_from_cpu_memory(model_of_40_mb):
    init_distributed()
    world = World.current("cuda")
    batch = make_batch(5, seed=6)
    start = _gpu_bytes()
    resident = RefRole.build(trainer_config(model_of_40_mb, EXACT), world)
    want, _ = resident.compute_log_probs(batch)  # also takes the lazy workspaces
    weights = sum(t.numel() * t.element_size() for t in _shards(resident))
    assert all(t.device.type == "cuda" for t in _shards(resident))
    assert _gpu_bytes() - start >= weights
    del resident
    torch.cuda.empty_cache()
    before = _gpu_bytes()
    offload = [*EXACT, "actor_rollout_ref.ref.param_offload=true"]
    offloaded = RefRole.build(trainer_config(model_of_40_mb, offload), world)
    shards = _shards(offloaded)
    assert all(t.device.type == "cpu" for t in shards), {t.device for t in shards}
    assert all(t.is_pinned() for t in shards)
    got, _ = offloaded.compute_log_probs(batch)
    torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=0)
    # after the pass its gathered copy is freed: the weights are in CPU memory only
    assert all(t.device.type == "cpu" for t in _shards(offloaded))
    held = _gpu_bytes() - before
    assert held < weights // 10, f"{held} bytes held on the GPU, the weights are {weights}"
