"""Delta syncs, sender and receiver in one process (two threads, a real gloo group over
loopback): only changed elements travel, the receiver's weights equal the sender's bit for
bit after every sync, and a receiver on another base or with a wrong result refuses the sync
(the sender is not left waiting) until a full one renews it."""

from __future__ import annotations

import threading

import pytest
import torch

from meshrl.weight_sync import WeightGroup, WeightManifest, plan_buckets, send_weights
from meshrl.weight_sync import delta as delta_sync
from meshrl.weight_sync.receiver import WeightReceiver

pytestmark = pytest.mark.timeout(90)


def _params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed": torch.randn(64, 16),  # alone in its bucket
        "wt": torch.randn(12, 8).t(),  # non-contiguous
        "scale": torch.tensor(1.5),  # 0-dim
        "bias": torch.randn(5),
        "head": torch.randn(20, 16),
    }


def _manifest(sender: WeightGroup, params, version: int, dtype, full: bool = False):
    """What the actor's publisher plans: the delta protocol from the kept copy's version."""
    named = [(n, tuple(t.shape)) for n, t in params.items()]
    manifest = WeightManifest(version, plan_buckets(named, dtype, 256 * dtype.itemsize))
    manifest.group_id, manifest.delta = sender.group_id, True
    state = sender.delta_state
    if state is not None and not full:
        manifest.base_version = state.base_for(manifest)
    return manifest


def _sync(pair, params, targets, version, dtype=torch.bfloat16, full=False, manifest=None):
    """One sync into ``targets``; returns (manifest, bytes sent, stats, receiver error)."""
    sender, receiver = pair
    manifest = manifest or _manifest(sender, params, version, dtype, full)
    errors: list[Exception] = []

    def receive():
        try:
            for name, tensor in WeightReceiver(receiver, manifest, targets):
                targets[name].copy_(tensor)
        except Exception as e:  # a thread's exception would not fail the test by itself
            errors.append(e)

    thread = threading.Thread(target=receive)
    thread.start()
    stats: dict[str, int] = {}
    sent, _ = send_weights(sender, iter(params.items()), manifest, stats)
    thread.join(30)
    assert not thread.is_alive()
    return manifest, sent, stats, (errors[0] if errors else None)


def _step(params, fraction: float, seed: int) -> None:
    """Changes about ``fraction`` of each tensor's elements by a visible amount (and every
    element by far less than bf16 resolves: those keep their bf16 bits)."""
    g = torch.Generator().manual_seed(seed)
    for t in params.values():
        t.add_(1e-7 * t)  # below bf16's resolution
        mask = torch.rand(t.shape, generator=g) < fraction
        t.add_(mask * torch.full(t.shape, 0.25))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_equal_bits(targets, params, dtype):
    for name, p in params.items():
        assert torch.equal(_bits(targets[name]), _bits(p.to(dtype))), name


def test_delta_syncs_leave_the_receiver_equal_to_the_sender_bit_for_bit(pair):
    params = _params()
    targets = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in params.items()}
    manifest, full_bytes, stats, err = _sync(pair, params, targets, version=1)
    assert err is None and manifest.base_version == -1
    assert stats["changed"] == stats["elements"] == sum(t.numel() for t in params.values())
    _assert_equal_bits(targets, params, torch.bfloat16)
    assert pair[1].delta_state.version == 1 and pair[0].delta_state.version == 1

    for version in range(2, 8):
        _step(params, fraction=0.05, seed=version)
        manifest, sent, stats, err = _sync(pair, params, targets, version)
        assert err is None
        assert manifest.base_version == version - 1  # from the version before
        assert 0 < stats["changed"] < 0.2 * stats["elements"]
        assert sent < full_bytes / 2
        _assert_equal_bits(targets, params, torch.bfloat16)

    # Nothing visible changed: every bucket goes as its meta alone.
    for t in params.values():
        t.add_(1e-7 * t)
    manifest, sent, stats, err = _sync(pair, params, targets, version=8)
    assert err is None and stats["changed"] == 0
    metas = sum(8 * (delta_sync.META_HEAD + len(b.params)) for b in manifest.buckets)
    assert sent == metas
    _assert_equal_bits(targets, params, torch.bfloat16)


def test_a_bucket_that_changed_mostly_goes_dense(pair):
    params = _params()
    targets = {n: torch.zeros(t.shape, dtype=torch.float32) for n, t in params.items()}
    _, full_bytes, _, err = _sync(pair, params, targets, version=1, dtype=torch.float32)
    assert err is None
    _step(params, fraction=0.9, seed=3)  # sparse would cost 8 bytes an element, dense 4
    manifest, sent, stats, err = _sync(pair, params, targets, version=2, dtype=torch.float32)
    assert err is None and manifest.base_version == 1
    metas = sum(8 * (delta_sync.META_HEAD + len(b.params)) for b in manifest.buckets)
    assert sent == full_bytes == manifest.nbytes + metas  # every bucket dense
    _assert_equal_bits(targets, params, torch.float32)


def test_a_receiver_on_another_base_refuses_and_a_full_sync_renews_it(pair, caplog):
    params = _params()
    targets = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in params.items()}
    assert _sync(pair, params, targets, version=1)[3] is None
    _step(params, fraction=0.05, seed=1)
    assert _sync(pair, params, targets, version=2)[3] is None
    pair[1].delta_state.version = 1  # as if this receiver had missed version 2
    before = {n: t.clone() for n, t in targets.items()}
    _step(params, fraction=0.05, seed=2)
    manifest, _, _, err = _sync(pair, params, targets, version=3)
    assert manifest.base_version == 2
    assert isinstance(err, delta_sync.WeightIntegrityError) and "holds 1" in str(err)
    assert "refused" in caplog.text and "a full sync follows" in caplog.text
    for name, t in targets.items():  # nothing of the refused sync reached the model
        assert torch.equal(t, before[name]), name
    assert pair[1].delta_state.version is None
    # The group is still whole: the next (full) sync goes through and renews the copies.
    manifest, _, _, err = _sync(pair, params, targets, version=3, full=True)
    assert err is None and manifest.base_version == -1
    _assert_equal_bits(targets, params, torch.bfloat16)
    _step(params, fraction=0.05, seed=4)
    manifest, _, _, err = _sync(pair, params, targets, version=4)
    assert err is None and manifest.base_version == 3
    _assert_equal_bits(targets, params, torch.bfloat16)


def test_a_result_that_differs_from_the_senders_checksum_is_refused(pair):
    params = _params()
    targets = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in params.items()}
    assert _sync(pair, params, targets, version=1)[3] is None
    # The receiver's copy of the first bucket ("embed") goes bad between two syncs.
    pair[1].delta_state.buffers[0][7] += 1
    embed_before = targets["embed"].clone()
    _step(params, fraction=0.05, seed=1)
    _, _, _, err = _sync(pair, params, targets, version=2)
    assert isinstance(err, delta_sync.WeightIntegrityError) and "embed" in str(err)
    assert torch.equal(targets["embed"], embed_before)  # the bad bucket never reached it
    assert pair[1].delta_state.version is None
    manifest, _, _, err = _sync(pair, params, targets, version=2, full=True)
    assert err is None and manifest.base_version == -1
    _assert_equal_bits(targets, params, torch.bfloat16)


def test_another_bucket_plan_is_a_full_sync(pair):
    params = _params()
    targets = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in params.items()}
    assert _sync(pair, params, targets, version=1)[3] is None
    named = [(n, tuple(t.shape)) for n, t in params.items()]
    manifest = WeightManifest(2, plan_buckets(named, torch.bfloat16, 64), pair[0].group_id)
    manifest.delta = True
    assert pair[0].delta_state.base_for(manifest) == -1
    _step(params, fraction=0.05, seed=1)
    _, _, stats, err = _sync(pair, params, targets, version=2, manifest=manifest)
    assert err is None and stats["changed"] == stats["elements"]
    _assert_equal_bits(targets, params, torch.bfloat16)


def test_checksums_see_values_and_their_places():
    x = torch.randn(1000).to(torch.bfloat16)
    y = x.clone()
    y[[3, 4]] = y[[4, 3]]  # the same values, two of them swapped
    assert int(delta_sync.checksum(x)) == int(delta_sync.checksum(x.clone()))
    assert int(delta_sync.checksum(x)) != int(delta_sync.checksum(y))
    big = torch.randn((1 << 22) + 5)  # more than one chunk
    other = big.clone()
    other[-1] += 1
    assert int(delta_sync.checksum(big)) != int(delta_sync.checksum(other))
