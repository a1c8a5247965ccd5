"""Two real processes form a gloo group; the test process sends, a spawned one receives."""

import json
import multiprocessing as mp
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import LlamaForCausalLM
from weight_sync_peer import join_then_exit, receive_deltas_to_file, receive_to_file

from meshrl.testing.tiny_model import tiny_llama_config
from meshrl.weight_sync import (
    GroupSpec,
    WeightGroup,
    WeightGroupError,
    WeightManifest,
    plan_buckets,
    send_weights,
)


def _small_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(22, hidden=32, layers=2, heads=2, intermediate=64))


def _sync_once(tmp_path, dtype: torch.dtype, timeout_s: float = 30.0) -> None:
    model = _small_model()
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    # 8 KiB buckets: several buckets, and the embedding (22x32 fp32 = 2.8 KiB) shares one.
    manifest = WeightManifest(version=3, buckets=plan_buckets(named, dtype, 8 * 1024))
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=timeout_s, world_size=2)
    manifest.group_id = spec.group_id
    peer_spec = GroupSpec(**{**spec.__dict__, "rank": 1})
    out = tmp_path / f"received_{dtype}.safetensors"
    ctx = mp.get_context("spawn")
    peer = ctx.Process(
        target=receive_to_file,
        args=(
            peer_spec.to_proto().SerializeToString(),
            manifest.to_proto().SerializeToString(),
            str(out),
        ),
    )
    peer.start()
    try:
        group = WeightGroup.join(spec, store)
        sent, seconds = send_weights(
            group, ((n, p.detach()) for n, p in model.named_parameters()), manifest
        )
        group.close()
        peer.join(60)
        assert peer.exitcode == 0
    finally:
        if peer.is_alive():
            peer.kill()
            peer.join()
    assert sent == manifest.nbytes and seconds >= 0
    received = load_file(str(out))
    # A safetensors file does not keep the order its tensors were saved in: the peer wrote
    # the order they arrived in as metadata. It is the manifest's: the model's own order.
    with safe_open(str(out), "pt") as f:
        arrival = json.loads(f.metadata()["order"])
    assert arrival == [n for n, _ in named]
    assert set(received) == set(arrival)
    for name, param in model.named_parameters():
        assert received[name].dtype == dtype
        assert torch.equal(received[name], param.detach().to(dtype)), name
    assert len(manifest.buckets) > 1


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_processes_sync_weights(tmp_path, dtype):
    _sync_once(tmp_path, dtype)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_join_without_receiver_times_out_then_fresh_group_works(tmp_path):
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=2.0, world_size=2)
    start = time.monotonic()
    with pytest.raises(WeightGroupError, match="could not join within 2s"):
        WeightGroup.join(spec, store)
    assert time.monotonic() - start < 15
    del store
    _sync_once(tmp_path, torch.float32)


def test_cuda_ipc_is_sent_to_its_own_group():
    # cuda_ipc is a different group type (handles, not collectives): named, not half-formed
    with pytest.raises(ValueError, match="forms an IpcGroup"):
        WeightGroup.open("127.0.0.1", transport="cuda_ipc")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_receiver_death_fails_the_send_but_drains_the_params():
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=30.0, world_size=2)
    peer_spec = GroupSpec(**{**spec.__dict__, "rank": 1})
    peer = mp.get_context("spawn").Process(
        target=join_then_exit, args=(peer_spec.to_proto().SerializeToString(),)
    )
    peer.start()
    group = WeightGroup.join(spec, store)
    peer.join(60)
    named = [(f"p{i}", (1000,)) for i in range(4)]
    manifest = WeightManifest(1, plan_buckets(named, torch.float32, 4000), spec.group_id)
    consumed = []

    def params():
        for name, _ in named:
            consumed.append(name)  # on a trainer, each of these is an FSDP gather
            yield name, torch.ones(1000)

    with pytest.raises(WeightGroupError, match="broadcast .* failed on rank 0"):
        send_weights(group, params(), manifest)
    assert consumed == [n for n, _ in named]  # the other FSDP ranks are not left waiting
    group.close()


def test_send_refuses_a_stale_manifest_after_draining():
    manifest = WeightManifest(1, plan_buckets([("a", (1,))], torch.float32, 64), group_id="old")
    stream = iter([("a", torch.zeros(1))])

    class CurrentGroup:
        group_id = "new"
        device = torch.device("cpu")

    with pytest.raises(ValueError, match="manifest is for group old, not new"):
        send_weights(CurrentGroup(), stream, manifest)
    assert next(stream, None) is None  # the other FSDP ranks' gathers were matched


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_processes_after_delta_syncs_of_real_adamw_steps_hold_the_senders_bits(tmp_path):
    """A full sync, then 5 delta syncs, each after a real AdamW step of a language-model
    loss: the receiving process's bf16 weights equal the sender's cast, bit for bit."""
    model = _small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)  # verl's default
    tokens = torch.randint(0, 22, (4, 12), generator=torch.Generator().manual_seed(1))
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=30.0, world_size=2)
    manifests = []
    for version in range(1, 7):  # what the actor's publisher plans: v from v - 1
        m = WeightManifest(version, plan_buckets(named, torch.bfloat16, 4 * 1024), spec.group_id)
        m.delta, m.base_version = True, version - 1 if version > 1 else -1
        manifests.append(m)
    out = tmp_path / "held.safetensors"
    peer_spec = GroupSpec(**{**spec.__dict__, "rank": 1})
    peer = mp.get_context("spawn").Process(
        target=receive_deltas_to_file,
        args=(
            peer_spec.to_proto().SerializeToString(),
            [m.to_proto().SerializeToString() for m in manifests],
            str(out),
        ),
    )
    peer.start()
    sent = []
    try:
        group = WeightGroup.join(spec, store)
        for manifest in manifests:
            if manifest.version > 1:
                opt.zero_grad()
                model(input_ids=tokens, labels=tokens).loss.backward()
                opt.step()
            stats: dict[str, int] = {}
            nbytes, _ = send_weights(
                group, ((n, p.detach()) for n, p in model.named_parameters()), manifest, stats
            )
            sent.append((nbytes, stats["changed"] / stats["elements"]))
            assert group.delta_state is not None and group.delta_state.version == manifest.version
        group.close()
        peer.join(60)
        assert peer.exitcode == 0
    finally:
        if peer.is_alive():
            peer.kill()
            peer.join()
    held = load_file(str(out))
    for name, param in model.named_parameters():
        want = param.detach().to(torch.bfloat16)
        assert torch.equal(held[name].view(torch.int16), want.view(torch.int16)), name
    assert sent[0][1] == 1.0  # the full sync
    assert all(0 < fraction < 1 for _, fraction in sent[1:]), sent  # AdamW at 1e-6 in bf16: some
    assert all(nbytes < sent[0][0] for nbytes, _ in sent[1:]), sent
