import pytest
import torch

from meshrl.weight_sync import BucketPlan, GroupSpec, ParamSlot, WeightManifest, plan_buckets


def test_params_fill_buckets_in_order():
    # float32: 4 bytes each; bucket of 40 bytes = 10 elements.
    shapes = [("a", (2, 3)), ("b", (4,)), ("c", (3,)), ("d", (1,))]
    buckets = plan_buckets(shapes, torch.float32, 40)
    # a (6) + b (4) = 10 fills the first; c (3) + d (1) the second.
    assert [[s.name for s in b.params] for b in buckets] == [["a", "b"], ["c", "d"]]
    assert [b.numel for b in buckets] == [10, 4]
    assert [(s.offset, s.numel) for s in buckets[0].params] == [(0, 6), (6, 4)]
    assert [(s.offset, s.numel) for s in buckets[1].params] == [(0, 3), (3, 1)]


def test_large_param_gets_its_own_bucket():
    shapes = [("small", (2,)), ("big", (100,)), ("tail", (2,))]
    buckets = plan_buckets(shapes, torch.bfloat16, 20)  # 10 bf16 elements
    assert [[s.name for s in b.params] for b in buckets] == [["small"], ["big"], ["tail"]]
    assert buckets[1].nbytes == 200


def test_dtype_sets_the_capacity():
    shapes = [(f"p{i}", (4,)) for i in range(4)]
    assert len(plan_buckets(shapes, torch.float32, 32)) == 2  # 8 fp32 per bucket
    assert len(plan_buckets(shapes, torch.bfloat16, 32)) == 1  # 16 bf16 per bucket


def test_empty_and_bad_sizes():
    assert plan_buckets([], torch.float32, 10) == []
    with pytest.raises(ValueError):
        plan_buckets([("a", (1,))], torch.float32, 0)


def test_manifest_round_trip():
    manifest = WeightManifest(
        version=7,
        buckets=[
            BucketPlan([ParamSlot("w", (2, 3), 0, 6), ParamSlot("b", (), 6, 1)], 7, torch.bfloat16)
        ],
        group_id="g1",
    )
    back = WeightManifest.from_proto(manifest.to_proto())
    assert back == manifest
    assert back.nbytes == 14 and back.param_names == ["w", "b"]


def test_group_spec_round_trip_and_defaults():
    spec = GroupSpec("gloo", "127.0.0.1", 1234, 3, 2, 5.0, "abc")
    assert GroupSpec.from_proto(spec.to_proto()) == spec
    empty = GroupSpec.from_proto(GroupSpec(transport="", timeout_s=0).to_proto())
    assert empty.transport == "gloo" and empty.timeout_s > 0
