"""The rollout worker: engine lock, weight syncs over a real gloo group, failed syncs."""

import threading
import time

import pytest
import torch

from meshrl.config import build_config
from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl.weight_sync import GroupSpec, WeightGroup, WeightManifest, plan_buckets, send_weights
from services.rollout import intake as intake_module
from services.rollout.native.engine import NativeEngine
from services.rollout.types import SamplingParams
from services.rollout.worker import (
    NotInitializedError,
    NoWeightGroupError,
    RolloutWorker,
    WeightSyncError,
)

pytestmark = pytest.mark.timeout(120)

PROMPTS = Ragged.from_lists([[1, 4, 5], [1, 6]])
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return str(make_tiny_model_dir(root / "a", seed=0)), str(
        make_tiny_model_dir(root / "b", seed=1)
    )


def _worker(model_dir: str) -> RolloutWorker:
    worker = RolloutWorker()
    worker.initialize(build_config({"actor_rollout_ref": {"model": {"path": model_dir}}}))
    return worker


def _actor_sync(
    source, worker: RolloutWorker, version: int, drop_after: int | None = None, timeout_s=5.0
):
    """Plays the actor: forms a 2-member gloo group with the worker and sends `source`'s
    parameters. drop_after=k: the actor leaves after k buckets (a crash mid-sync)."""
    named = [(n, tuple(p.shape)) for n, p in source.named_parameters()]
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=timeout_s, world_size=2)
    peer = GroupSpec(**{**spec.__dict__, "rank": 1})
    joined = threading.Thread(target=worker.join_group, args=(peer,))
    joined.start()
    group = WeightGroup.join(spec, store)
    joined.join()
    manifest = WeightManifest(version, plan_buckets(named, torch.float32, 16 * 1024), spec.group_id)
    sender_manifest = manifest
    if drop_after is not None:
        sender_manifest = WeightManifest(version, manifest.buckets[:drop_after], spec.group_id)
    sent_names = {s.name for b in sender_manifest.buckets for s in b.params}
    params = ((n, p.detach()) for n, p in source.named_parameters() if n in sent_names)
    sender = threading.Thread(target=send_weights, args=(group, params, sender_manifest))
    sender.start()
    try:
        return worker.receive(manifest)
    finally:
        sender.join()
        if drop_after is not None:
            group.close()  # the actor is gone


def test_calls_before_initialize_fail_precondition():
    worker = RolloutWorker()
    assert not worker.ready
    with pytest.raises(NotInitializedError, match="call Initialize"):
        worker.generate(PROMPTS, GREEDY)


def test_initialize_rejects_a_missing_model_folder(tmp_path):
    cfg = build_config({"actor_rollout_ref": {"model": {"path": str(tmp_path / "none")}}})
    with pytest.raises(ValueError, match="actor_rollout_ref.model.path"):
        RolloutWorker().initialize(cfg)


def test_plain_engine_takes_the_runs_length_limit(model_dirs):
    # The plain engine (CPU, and GPU models off the fast path) used to take any length.
    data = {"max_prompt_length": 4, "max_response_length": 8}
    cfg = build_config({"actor_rollout_ref": {"model": {"path": model_dirs[0]}}, "data": data})
    worker = RolloutWorker()
    worker.initialize(cfg)
    assert worker.engine.max_model_len == 12
    with pytest.raises(ValueError, match="max_model_len 12 .data.max_prompt_length"):
        worker.generate(Ragged.from_lists([[1, 4, 5, 6, 7]]), GREEDY)


def test_receive_without_group_fails_precondition(model_dirs):
    worker = _worker(model_dirs[0])
    with pytest.raises(NoWeightGroupError, match="JoinWeightGroup"):
        worker.receive(WeightManifest(1, []))


def test_weight_sync_swaps_in_the_actors_weights(model_dirs):
    worker = _worker(model_dirs[0])
    source = NativeEngine(model_dirs[1])
    expected = source.generate(PROMPTS, GREEDY).responses.tolist()
    assert worker.generate(PROMPTS, GREEDY).responses.tolist() != expected
    stats = _actor_sync(source.runner.model, worker, version=5)
    assert stats.version == 5 and stats.seconds >= 0
    assert stats.bytes == 4 * source.num_parameters
    result = worker.generate(PROMPTS, GREEDY)
    assert result.weight_version == 5
    assert result.responses.tolist() == expected
    worker.close()


def test_failed_sync_marks_weights_unknown_and_worker_stays_usable(model_dirs):
    worker = _worker(model_dirs[0])
    source = NativeEngine(model_dirs[1])
    with pytest.raises(WeightSyncError, match=r"version 9 failed after \d+ of \d+ tensors"):
        # The receiver notices when its next broadcast times out.
        _actor_sync(source.runner.model, worker, version=9, drop_after=1, timeout_s=5.0)
    assert worker.engine.weight_version == -1  # some tensors of v9 were loaded
    assert worker._group is None
    assert len(worker.generate(PROMPTS, GREEDY).responses) == 2
    # A new group and a full sync repair it.
    assert _actor_sync(source.runner.model, worker, version=10).version == 10
    assert worker.generate(PROMPTS, GREEDY).weight_version == 10


class _SlowEngine:
    """Records when generate and load_weights run, to check that they never overlap."""

    weight_version = 0
    device = torch.device("cpu")

    def __init__(self):
        self.spans: list[tuple[str, float, float]] = []

    def _busy(self, what):
        start = time.monotonic()
        time.sleep(0.05)
        self.spans.append((what, start, time.monotonic()))

    def generate(self, prompts, params, cancelled=None, at_token_boundary=None):
        self._busy("generate")

    def load_weights(self, named_tensors):
        list(named_tensors)
        self._busy("load")

    def weight_targets(self):
        return None

    def reset_prefix_cache(self):
        pass


class _NoBuckets:
    """Stands for the WeightReceiver of an empty sync."""

    wrote_targets = False

    def __init__(self, group, manifest, targets=None):
        pass

    def wait_for_sender(self):
        pass

    def __iter__(self):
        return iter([])


class _FakeGroup:
    group_id = "g"

    def close(self):
        pass


def test_generation_and_weight_swaps_never_overlap(monkeypatch):
    monkeypatch.setattr(intake_module, "WeightReceiver", _NoBuckets)
    worker = RolloutWorker()
    engine = _SlowEngine()
    worker._engine = engine
    worker._group = intake_module.InProcessIntake(engine, _FakeGroup())
    calls = [lambda: worker.generate(PROMPTS, GREEDY)] * 4
    calls += [lambda v=v: worker.receive(WeightManifest(v, [], "g")) for v in range(1, 4)]
    threads = [threading.Thread(target=c) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = sorted(engine.spans, key=lambda s: s[1])
    assert len(spans) == 7
    for (_, _, end), (_, start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end
    assert engine.weight_version in (1, 2, 3)
