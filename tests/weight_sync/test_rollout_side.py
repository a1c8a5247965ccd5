"""The rollout worker's side of a sync with the native engine: generation is paused only for
the swap, not while the rollout waits for the actor's first bucket."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from meshrl.config import build_config
from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl.weight_sync import GroupSpec, WeightGroup, WeightManifest, plan_buckets, send_weights
from meshrl.weight_sync.receiver import WeightReceiver
from services.rollout.types import SamplingParams
from services.rollout.worker import RolloutWorker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_generation_goes_on_until_the_first_bucket_arrives(tmp_path, monkeypatch):
    model_dir = str(make_tiny_model_dir(tmp_path / "m", hidden=32, intermediate=64))
    worker = RolloutWorker()
    worker.initialize(build_config({"actor_rollout_ref": {"model": {"path": model_dir}}}))
    model = worker.engine.runner.model
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=20, world_size=2)
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(worker.join_group, GroupSpec(**{**spec.__dict__, "rank": 1}))
        actor = WeightGroup.join(spec, store)
        joined.result()
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    manifest = WeightManifest(3, plan_buckets(named, torch.float32, 8 * 1024), spec.group_id)
    new = {n: torch.full_like(p, 0.01) for n, p in model.named_parameters()}

    # The receive tells when it starts waiting for the actor's header: everything it does
    # before (locks included) is done, and nothing can arrive before send_weights below.
    waiting = threading.Event()
    wait_for_sender = WeightReceiver.wait_for_sender

    def signalled_wait(self):
        waiting.set()
        wait_for_sender(self)

    monkeypatch.setattr(WeightReceiver, "wait_for_sender", signalled_wait)
    receiving = threading.Thread(target=worker.receive, args=(manifest,))
    receiving.start()
    assert waiting.wait(30)
    # A generation that waited for the sync would never end: the sync needs send_weights,
    # which comes after it. The test's timeout catches that.
    result = worker.generate(Ragged.from_lists([[1, 4, 5]]), SamplingParams(temperature=0))
    assert receiving.is_alive()
    assert result.weight_version == 0

    send_weights(actor, iter(new.items()), manifest)
    receiving.join(30)
    assert worker.engine.weight_version == 3
    assert all(torch.equal(p, new[n]) for n, p in model.named_parameters())
    worker.close()
    actor.close()


def test_the_engines_weights_after_delta_syncs_equal_the_actors_bit_for_bit(tmp_path):
    """The rollout worker and its native engine (bf16 weights) take a full sync, then five
    delta syncs, each after a real AdamW step of a language-model loss on the actor's fp32
    copy of the same model: after every sync the engine's weights are the actor's cast to
    bf16, bit for bit, and only a part of them travelled."""
    from transformers import AutoModelForCausalLM

    model_dir = str(make_tiny_model_dir(tmp_path / "m", hidden=32, intermediate=64))
    worker = RolloutWorker()
    tree = {"actor_rollout_ref": {"model": {"path": model_dir}, "rollout": {"dtype": "bfloat16"}}}
    worker.initialize(build_config(tree))
    engine_model = worker.engine.runner.model
    actor_model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(actor_model.parameters(), lr=1e-5)
    tokens = torch.randint(3, 20, (4, 12), generator=torch.Generator().manual_seed(0))
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=20, world_size=2)
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(worker.join_group, GroupSpec(**{**spec.__dict__, "rank": 1}))
        actor = WeightGroup.join(spec, store)
        joined.result()
    named = [(n, tuple(p.shape)) for n, p in actor_model.named_parameters()]
    fractions = []
    for version in range(1, 7):
        if version > 1:
            opt.zero_grad()
            actor_model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
        manifest = WeightManifest(version, plan_buckets(named, torch.bfloat16, 4 * 1024))
        manifest.group_id, manifest.delta = spec.group_id, True
        if actor.delta_state is not None:
            manifest.base_version = actor.delta_state.base_for(manifest)
        receiving = threading.Thread(target=worker.receive, args=(manifest,))
        receiving.start()
        stats: dict[str, int] = {}
        params = ((n, p.detach()) for n, p in actor_model.named_parameters())
        send_weights(actor, params, manifest, stats)
        receiving.join(30)
        assert worker.engine.weight_version == version
        assert manifest.base_version == (-1 if version == 1 else version - 1)
        fractions.append(stats["changed"] / stats["elements"])
        served = dict(engine_model.named_parameters())
        for name, p in actor_model.named_parameters():
            want = p.detach().to(torch.bfloat16).view(torch.int16)
            assert torch.equal(served[name].detach().view(torch.int16), want), (version, name)
    assert fractions[0] == 1.0 and all(0 < f < 1 for f in fractions[1:]), fractions
    worker.close()
    actor.close()
