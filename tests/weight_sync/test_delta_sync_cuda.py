"""Delta syncs on CUDA tensors: the same code as on CPU (meshrl.weight_sync.delta), run where
the weights are. One GPU: checksums equal the CPU's for the same bits, and a bucket encoded
and applied on the GPU is rebuilt bit for bit. Two GPUs: delta syncs over NCCL, one process
a GPU (NCCL refuses two ranks on one GPU), leave the receiver's weights equal to the
sender's bit for bit."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from meshrl.weight_sync import delta as delta_sync
from meshrl.weight_sync.types import BucketPlan, ParamSlot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]


def _bucket(numel: int, dtype=torch.bfloat16) -> BucketPlan:
    half = numel // 2 + 1  # an odd split: the second parameter starts unaligned
    return BucketPlan(
        [ParamSlot("a", (half,), 0, half), ParamSlot("b", (numel - half,), half, numel - half)],
        numel,
        dtype,
    )


def test_checksums_on_the_gpu_equal_those_on_the_cpu():
    x = torch.randn(3_000_001).to(torch.bfloat16)
    bucket = _bucket(x.numel())
    cpu = delta_sync.bucket_checksums(bucket, x)
    gpu = delta_sync.bucket_checksums(bucket, x.cuda())
    assert gpu.device.type == "cuda" and torch.equal(cpu, gpu.cpu())


@pytest.mark.parametrize("fraction", [0.001, 0.9])  # sparse, then dense
def test_a_bucket_encoded_and_applied_on_the_gpu_is_rebuilt_bit_for_bit(fraction):
    old = torch.randn(1_000_003, device="cuda").to(torch.bfloat16)
    new = old.clone()
    mask = torch.rand(old.shape, device="cuda") < fraction
    new[mask] += 1
    bucket = _bucket(old.numel())
    kept, held = old.clone(), old.clone()
    enc = delta_sync.encode(bucket, new, kept, full=False)
    assert enc.changed == int(mask.sum()) and enc.meta.device.type == "cuda"
    assert int(enc.meta[0]) == (delta_sync.SPARSE if fraction < 0.5 else delta_sync.DENSE)
    delta_sync.apply(bucket, enc.meta, enc.payload.clone(), held)
    assert torch.equal(held.view(torch.int16), new.view(torch.int16))
    assert torch.equal(kept.view(torch.int16), new.view(torch.int16))


def _nccl_member(rank: int, spec_bytes: bytes, versions: int, out: str | None) -> None:
    from meshrl.api.v1 import common_pb2
    from meshrl.weight_sync import GroupSpec, WeightGroup, WeightManifest, plan_buckets
    from meshrl.weight_sync.receiver import WeightReceiver
    from meshrl.weight_sync.sender import send_weights

    torch.cuda.set_device(rank)
    spec = GroupSpec.from_proto(common_pb2.WeightGroupSpec.FromString(spec_bytes))
    spec.rank = rank
    group = WeightGroup.join(spec)  # both connect to the test process's store
    torch.manual_seed(0)
    params = {f"p{i}": torch.randn(1000 + 37 * i, 64, device="cuda") for i in range(6)}
    named = [(n, tuple(t.shape)) for n, t in params.items()]
    held = {n: torch.zeros(t.shape, dtype=torch.bfloat16, device="cuda") for n, t in params.items()}
    for version in range(1, versions + 1):
        manifest = WeightManifest(version, plan_buckets(named, torch.bfloat16, 256 * 1024))
        manifest.group_id, manifest.delta = spec.group_id, True
        manifest.base_version = -1 if version == 1 else version - 1
        if version > 1:
            for t in params.values():  # the sender's weights move; both sides draw alike
                t.add_((torch.rand(t.shape, device="cuda") < 0.01) * 0.5)
        if rank == 0:
            send_weights(group, iter(params.items()), manifest)
        else:
            for name, tensor in WeightReceiver(group, manifest, held):
                held[name].copy_(tensor)
    group.close()
    if rank == 1 and out is not None:
        want = {n: t.to(torch.bfloat16) for n, t in params.items()}
        same = all(torch.equal(held[n].view(torch.int16), want[n].view(torch.int16)) for n in want)
        with open(out, "w") as f:
            f.write("equal" if same else "differs")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_delta_syncs_over_nccl_leave_the_receiver_equal_bit_for_bit(tmp_path):
    from meshrl.weight_sync import WeightGroup

    store, spec = WeightGroup.open("127.0.0.1", timeout_s=60, world_size=2, transport="nccl")
    out = tmp_path / "verdict"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_nccl_member, args=(r, spec.to_proto().SerializeToString(), 5, str(out)))
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    del store
    assert [p.exitcode for p in procs] == [0, 0]
    assert out.read_text() == "equal"
