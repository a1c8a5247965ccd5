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
