"""Sender and receiver in one process (two threads, a real gloo group over loopback):
casts, parameters larger than a bucket, non-contiguous and 0-dim tensors, staging buffers
reused from sync to sync, and the test hook that slows a sync down."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from meshrl.weight_sync import (
    WeightGroupError,
    WeightManifest,
    plan_buckets,
    receive_weights,
    send_weights,
)
from meshrl.weight_sync.receiver import WeightReceiver
from meshrl.weight_sync.sender import TEST_DELAY_ENV

pytestmark = pytest.mark.timeout(60)


def _params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed": torch.randn(40, 8),  # 320 elements: larger than a bucket, alone in its own
        "wt": torch.randn(6, 4).t(),  # non-contiguous (a transposed view)
        "scale": torch.tensor(1.5),  # 0-dim
        "bias": torch.randn(5),
        "head": torch.randn(7, 8),
    }


def _sync(pair, params, dtype, bucket_bytes, version=1):
    sender, receiver = pair
    named = [(n, tuple(t.shape)) for n, t in params.items()]
    manifest = WeightManifest(version, plan_buckets(named, dtype, bucket_bytes), sender.group_id)
    got, errors = {}, []

    def receive():
        try:
            for name, tensor in receive_weights(receiver, manifest):
                got[name] = tensor.clone()  # the view is reused by a later bucket
        except Exception as e:  # a thread's exception would not fail the test by itself
            errors.append(e)

    thread = threading.Thread(target=receive)
    thread.start()
    sent, _ = send_weights(sender, iter(params.items()), manifest)
    thread.join(30)
    assert not thread.is_alive() and not errors, errors
    return manifest, sent, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tensor_arrives_cast_to_the_wire_dtype(pair, dtype):
    params = _params()
    manifest, sent, got = _sync(pair, params, dtype, bucket_bytes=64 * dtype.itemsize)
    assert len(manifest.buckets) == 3 and sent == manifest.nbytes
    assert list(got) == list(params)
    for name, want in params.items():
        assert got[name].dtype == dtype and got[name].shape == want.shape
        assert torch.equal(got[name], want.to(dtype)), name


def test_staging_buffers_are_reused_between_syncs(pair):
    params = _params()
    _sync(pair, params, torch.float32, bucket_bytes=256)
    first = {k: v.data_ptr() for k, v in pair[1]._staging.items()}
    params["bias"] += 1
    _, _, got = _sync(pair, params, torch.float32, bucket_bytes=256, version=2)
    assert torch.equal(got["bias"], params["bias"])
    assert {k: v.data_ptr() for k, v in pair[1]._staging.items()} == first


def test_delay_hook_sleeps_between_buckets(pair, monkeypatch):
    monkeypatch.setenv(TEST_DELAY_ENV, "0.2")
    start = time.monotonic()
    manifest, _, _ = _sync(pair, _params(), torch.float32, bucket_bytes=256)
    assert time.monotonic() - start >= 0.2 * (len(manifest.buckets) - 1)


def test_a_closed_group_refuses_to_broadcast(pair):
    sender, _ = pair
    sender.close()
    with pytest.raises(WeightGroupError, match="closed"):
        sender.broadcast(torch.zeros(1))


def _sync_into(pair, params, targets, bucket_bytes):
    """One float32 sync received with ``targets``: (receiver, {name: (data_ptr, copy)})
    of what the receiver handed out."""
    sender, receiver = pair
    named = [(n, tuple(t.shape)) for n, t in params.items()]
    manifest = WeightManifest(1, plan_buckets(named, torch.float32, bucket_bytes), sender.group_id)
    stream = WeightReceiver(receiver, manifest, targets)
    got, errors = {}, []

    def receive():
        try:
            got.update({n: (t.data_ptr(), t.clone()) for n, t in stream})
        except Exception as e:  # a thread's exception would not fail the test by itself
            errors.append(e)

    thread = threading.Thread(target=receive)
    thread.start()
    send_weights(sender, iter(params.items()), manifest)
    thread.join(30)
    assert not thread.is_alive() and not errors, errors
    return stream, manifest, got


@pytest.fixture
def receiver_calls(pair, monkeypatch):
    """What the receiver asked for: the staging slots ``(slot, numel)`` of its group and the
    names it copied into a target (``copied``)."""
    calls = {"staging": [], "copied": []}
    staging, copy_target = pair[1].staging, WeightReceiver._copy_target

    def spy_staging(slot, numel, dtype):
        calls["staging"].append((slot, numel))
        return staging(slot, numel, dtype)

    def spy_copy_target(self, name, view):
        t = copy_target(self, name, view)
        if t is not None:
            calls["copied"].append(name)
        return t

    monkeypatch.setattr(pair[1], "staging", spy_staging)
    monkeypatch.setattr(WeightReceiver, "_copy_target", spy_copy_target)
    return calls


def test_more_buckets_than_staging_buffers_rotate_through_them(pair, receiver_calls):
    # 8-element buckets: every parameter but scale and bias alone, more buckets than the
    # pipeline's depth (3 on CPU), so later buckets are posted as earlier ones are consumed.
    params = _params()
    manifest, _, got = _sync(pair, params, torch.float32, bucket_bytes=32)
    depth = pair[1].pipeline_depth
    assert len(manifest.buckets) > depth
    assert list(got) == list(params)
    assert all(torch.equal(got[n], params[n]) for n in params)
    slots = [slot for slot, _ in receiver_calls["staging"]]
    assert slots == [k % depth for k in range(len(manifest.buckets))]
    assert [n for _, n in receiver_calls["staging"]] == [b.numel for b in manifest.buckets]


def test_single_parameter_buckets_land_in_the_callers_tensors(pair, receiver_calls):
    params = _params()
    targets = {"embed": torch.zeros(40, 8), "head": torch.zeros(7, 8, dtype=torch.bfloat16)}
    stream, manifest, got = _sync_into(pair, params, targets, bucket_bytes=128)
    assert stream.wrote_targets
    # The embedding's bucket (it alone) was received into its target: no staging buffer,
    # no copy. The head's (another dtype) was staged, then copied.
    (embed_bucket,) = [k for k, b in enumerate(manifest.buckets) if b.params[0].name == "embed"]
    assert [s for s in receiver_calls["staging"] if s[0] == embed_bucket % 3 and s[1] == 320] == []
    assert receiver_calls["copied"] == ["head"]
    assert torch.equal(targets["embed"], params["embed"])  # received in place ...
    assert got["embed"][0] == targets["embed"].data_ptr()  # ... and handed out as itself
    # A target of another dtype cannot take the broadcast: the bucket is cast into it.
    assert torch.equal(targets["head"], params["head"].bfloat16())
    assert got["head"][0] == targets["head"].data_ptr()
    assert all(torch.equal(got[n][1], params[n].to(got[n][1].dtype)) for n in params)


def test_parameters_sharing_a_bucket_are_copied_into_their_targets_as_it_arrives(pair):
    # One multi-tensor copy a bucket instead of one copy per parameter by the consumer (its
    # host time held the broadcasts up). Names without a target still come as views.
    params = _params()
    # a model's own parameters require grad: written as data all the same
    targets = {
        "wt": torch.nn.Parameter(torch.zeros(4, 6)),
        "bias": torch.zeros(5, dtype=torch.bfloat16),
    }
    stream, manifest, got = _sync_into(pair, params, targets, bucket_bytes=1 << 20)
    assert len(manifest.buckets) == 1  # all five share it
    assert stream.wrote_targets
    assert torch.equal(targets["wt"], params["wt"])  # a transposed view sent, rows kept
    assert torch.equal(targets["bias"], params["bias"].bfloat16())  # cast on the way in
    assert {n for n in got if got[n][0] in (t.data_ptr() for t in targets.values())} == {
        "wt",
        "bias",
    }
    assert all(torch.equal(got[n][1], params[n].to(got[n][1].dtype)) for n in params)


def test_a_sender_on_another_version_is_refused_before_any_bucket(pair):
    sender, receiver = pair
    params = _params()
    named = [(n, tuple(t.shape)) for n, t in params.items()]
    manifest = WeightManifest(2, plan_buckets(named, torch.float32, 256), sender.group_id)
    target = torch.zeros(40, 8)
    stream = WeightReceiver(receiver, dataclasses.replace(manifest, version=3), {"embed": target})
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(send_weights, sender, iter(params.items()), manifest)
        with pytest.raises(WeightGroupError, match="sends version 2, the manifest here is for 3"):
            stream.wait_for_sender()
        sending.exception(timeout=30)  # small buckets: the sender is not held up
    assert not stream.wrote_targets and not target.any()


def test_only_the_embedding_landing_marks_the_targets_written(pair, receiver_calls):
    params = _params()
    targets = {"embed": torch.zeros(40, 8)}
    stream, _, got = _sync_into(pair, params, targets, bucket_bytes=128)
    assert stream.wrote_targets and receiver_calls["copied"] == []
    assert torch.equal(targets["embed"], params["embed"])


def test_a_target_of_another_shape_is_left_alone(pair):
    params = _params()
    targets = {"bias": torch.zeros(6), "embed": torch.zeros(8, 40)}  # neither fits
    stream, _, got = _sync_into(pair, params, targets, bucket_bytes=1 << 20)
    assert not stream.wrote_targets
    assert not targets["bias"].any() and not targets["embed"].any()
    assert all(torch.equal(got[n][1], params[n]) for n in params)


def test_receive_weights_passes_the_targets_on(pair):
    sender, receiver = pair
    params = _params()
    named = [(n, tuple(t.shape)) for n, t in params.items()]
    manifest = WeightManifest(1, plan_buckets(named, torch.float32, 128), sender.group_id)
    target = torch.zeros(40, 8)
    got = {}
    thread = threading.Thread(
        target=lambda: got.update(
            {
                n: t.data_ptr()
                for n, t in receive_weights(receiver, manifest, targets={"embed": target})
            }
        )
    )
    thread.start()
    send_weights(sender, iter(params.items()), manifest)
    thread.join(30)
    assert torch.equal(target, params["embed"]) and got["embed"] == target.data_ptr()


def test_a_manifest_of_another_group_is_refused(pair):
    sender, receiver = pair
    manifest = WeightManifest(1, plan_buckets([("w", (2,))], torch.float32, 64), "another-group")
    with pytest.raises(
        ValueError, match=f"^manifest is for group another-group, not {receiver.group_id}$"
    ):
        WeightReceiver(receiver, manifest)


def test_waiting_for_the_sender_first_reads_its_header_once(pair):
    # The rollout worker waits for the header, then iterates: the header is not read again.
    sender, receiver = pair
    params = _params()
    named = [(n, tuple(t.shape)) for n, t in params.items()]
    manifest = WeightManifest(1, plan_buckets(named, torch.float32, 128), sender.group_id)
    stream = WeightReceiver(receiver, manifest)
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(send_weights, sender, iter(params.items()), manifest)
        stream.wait_for_sender()
        got = {n: t.clone() for n, t in stream}
        sending.result(timeout=30)
    assert all(torch.equal(got[n], params[n]) for n in params)
