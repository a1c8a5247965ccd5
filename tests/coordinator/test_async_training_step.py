"""Fully async training (trainer.async_training) through the real PPOStep.run and PPORun
loop, over the stand-in role servers of the one-step-off tests: the staleness bound holds
under a slow trainer (wait: rollout idles; drop: stale prompts are dropped and counted), no
weight sync lands during a request without partial rollouts, a checkpoint resumes at the
prompts drawn but not trained, and a rewind empties the buffer."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from meshrl.data.loader import PromptLoader
from meshrl.ragged import Ragged
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.generation.rollout_memory import RolloutMemory
from services.coordinator.roles.roles import Roles
from services.coordinator.step.ppo_step import PPOStep
from services.rollout.types import GenerationResult
from tests.coordinator.test_one_step_off_step import (
    Actor,
    Events,
    Record,
    Reward,
    Rollout,
    Syncer,
    Tokenizer,
)
from tests.coordinator.test_run_bookkeeping import Unavailable, make_run


class SlowActor(Actor):
    """An update that takes ``seconds``: the trainer is the slow side."""

    def __init__(self, events: Events, seconds: float):
        super().__init__(events)
        self.seconds = seconds

    def update_policy(self, prompts, responses, old, advantages, step, **kw):
        time.sleep(self.seconds)
        firsts = sorted({row[0] for row in prompts.tolist()})
        self.events.add("update", step, tuple(firsts))
        return {"actor/pg_loss": 0.0}


class CountingRollout(Rollout):
    """Counts requests in flight under a lock (the pool sends two at a time); each response
    is (first prompt id, sample index), of the version it serves."""

    def __init__(self, events: Events, seconds: float):
        super().__init__(events, seconds)
        self.lock = threading.Lock()

    def generate(self, prompts, sampling):
        with self.lock:
            self.running += 1
        try:
            self.events.add("gen start", prompts.tolist()[0][0], self.version)
            time.sleep(self.seconds)
            rows = [[row[0], j] for row in prompts.tolist() for j in range(sampling.n)]
            return GenerationResult(
                responses=Ragged.from_lists(rows),
                logprobs=Ragged.from_lists([[0.0, 0.0]] * len(rows), dtype=torch.float32),
                finish_reasons=["length"] * len(rows),
                weight_version=self.version,
            )
        finally:
            with self.lock:
                self.running -= 1


@pytest.fixture(autouse=True)
def _close_runs():
    """Every run's producer thread stops at the test's end, as PPORun.close does."""
    yield
    for run in OPEN_RUNS:
        producer = run.async_rollout._thread
        run.close()
        if producer is not None:  # not left generating while the interpreter ends
            producer.join(timeout=10)
    OPEN_RUNS.clear()


OPEN_RUNS: list = []


def async_run(
    tmp_path, *overrides, steps=6, gen_seconds=0.01, train_seconds=0.0, prompts=4, start=0
):
    """A PPORun in async mode over the stand-ins (GRPO, n=2, ``prompts`` prompts a step from
    ``start``, in order, 2 prompts a request)."""
    cfg = [
        "trainer.async_training.enable=true",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.prompts_per_request=2",
        f"data.train_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        *overrides,
    ]
    run = make_run(tmp_path, cfg)
    records = [Record(i) for i in range(1000)]
    run.progress.loader = PromptLoader(records, prompts, shuffle=False)
    run.total_steps = steps
    events = Events()
    rollout = CountingRollout(events, gen_seconds)
    actor = SlowActor(events, train_seconds)
    run.servers.roles = Roles(rollouts=[rollout], actor=actor, reward=Reward())
    run.tokenizer = Tokenizer()
    syncer = Syncer(rollout)
    run.step_runner = PPOStep(run.cfg, run.servers.roles, Tokenizer(), syncer, run.progress.kl_ctrl)
    run.step_runner.memory = RolloutMemory([rollout], enabled=True)
    rows: list[dict] = []
    run.on_step = lambda step, metrics: rows.append(metrics)
    OPEN_RUNS.append(run)
    return run, events, rows


def trained(events: Events) -> list[int]:
    """The first prompt id of every prompt trained on, in order."""
    return [p for e in events.log if e[0] == "update" for p in e[2]]


def test_the_staleness_bound_holds_under_a_slow_trainer_rollout_waiting(tmp_path):
    run, events, rows = async_run(
        tmp_path,
        "trainer.async_training.max_staleness=1",
        "trainer.async_training.buffer_batches=4",
        train_seconds=0.15,
    )
    run.train()
    assert trained(events) == list(range(24))  # every prompt once, in order
    assert len(rows) == 6
    for row in rows:
        assert row["async/staleness/max"] <= 1
        assert row["async/dropped_samples"] == 0
        assert row["async/staleness/lag_0"] + row["async/staleness/lag_1"] == pytest.approx(1)
    # rollout ran ahead as far as the bound allows, then idled: waiting for the trainer
    assert max(r["async/staleness/max"] for r in rows) == 1
    assert sum(r["timing_s/rollout_idle"] for r in rows) > 0.2
    assert sum(r["timing_s/gen"] for r in rows) > 0  # the producer's, since the step before
    # a batch is started only once rollout serves a version recent enough: that of step
    # k (prompts 4(k-1)..) needs version k - 2 or newer
    for prompt, version in [(e[1], e[2]) for e in events.log if e[0] == "gen start"]:
        assert version >= prompt // 4 + 1 - 2


def test_drop_mode_never_waits_and_drops_what_is_too_stale(tmp_path):
    run, events, rows = async_run(
        tmp_path,
        "trainer.async_training.max_staleness=1",
        "trainer.async_training.stale=drop",
        "trainer.async_training.buffer_batches=4",
        train_seconds=0.15,
    )
    run.train()
    assert all(r["async/staleness/max"] <= 1 for r in rows)  # the bound holds for what trains
    dropped = sum(r["async/dropped_samples"] for r in rows)
    assert dropped > 0 and dropped % 2 == 0  # whole prompts: n=2 samples each
    done = trained(events)
    assert len(done) == 24 and done == sorted(set(done))  # none twice, in order
    skipped = sorted(set(range(done[-1] + 1)) - set(done))
    assert len(skipped) == dropped // 2  # each prompt not trained was dropped, and counted


def test_no_weight_sync_lands_during_a_request_without_partial_rollouts(tmp_path):
    # The stand-in syncer asserts that no Generate call runs while it syncs.
    run, events, rows = async_run(tmp_path, gen_seconds=0.05, train_seconds=0.02)
    run.train()
    assert trained(events) == list(range(24))
    assert all("timing_s/gen_drain" in r for r in rows)
    assert [e[1] for e in events.log if e[0] == "sync"] == [1, 2, 3, 4, 5, 6]


def test_with_partial_rollouts_the_sync_runs_beside_the_requests(tmp_path):
    run, events, rows = async_run(
        tmp_path, "actor_rollout_ref.rollout.partial_rollout=true", gen_seconds=0.05
    )
    overlapped = []
    syncer = run.step_runner.syncer
    plain_sync = Syncer.sync

    def sync(version):  # the rollout server applies it at a token boundary
        overlapped.append(syncer.rollout.running > 0)
        syncer.rollout.running, running = 0, syncer.rollout.running
        try:
            return plain_sync(syncer, version)
        finally:
            syncer.rollout.running += running

    syncer.sync = sync
    run.train()
    assert trained(events) == list(range(24))
    assert not any("timing_s/gen_drain" in r for r in rows)
    assert any(overlapped)


def test_a_checkpoint_resumes_at_the_prompts_drawn_but_not_trained(tmp_path):
    run, events, _ = async_run(
        tmp_path,
        "trainer.save_freq=2",
        "trainer.async_training.max_staleness=2",
        "trainer.async_training.buffer_batches=3",
        steps=4,
        train_seconds=0.1,
    )
    saves = []
    save = run.checkpoints.save

    def save_and_see(*args):  # what rollout had drawn when step 2 was saved
        saves.append({e[1] for e in events.log if e[0] == "gen start"})
        return save(*args)

    run.checkpoints.save = save_and_see
    run.train()
    assert trained(events) == list(range(16))
    assert max(saves[0]) >= 8  # rollout had generated prompts of step 3 and on
    folder = run.checkpoints.manager.root / "global_step_2"
    saved = run.checkpoints.manager.load_state(folder)
    assert (saved.step, saved.loader["batch_in_epoch"]) == (2, 2)  # before step 3's prompts

    # the resumed run draws them again and trains on them
    again, events2, _ = async_run(tmp_path / "resumed", steps=4)
    again.progress.loader.load_state_dict(saved.loader)
    again.progress.step = 2
    again.servers.roles.rollouts[0].version = 2  # resync(2) at set-up
    again.train()
    assert trained(events2) == list(range(8, 16))


def test_a_rewind_empties_the_buffer_and_generates_from_the_checkpoint(tmp_path):
    run, events, _ = async_run(tmp_path, "trainer.async_training.buffer_batches=3", steps=8)
    run.start_async_rollout()
    producer = run.async_rollout
    producer.take(1)
    deadline = time.monotonic() + 5
    while len(producer._buffer) < 4 and time.monotonic() < deadline:  # next batch generated
        time.sleep(0.01)
    assert len(producer._buffer) >= 4
    with run.batch_source.held():
        run.recovery.rewind()  # no checkpoint yet: back to step 0, the loader from the start
    assert not producer.running and len(producer._buffer) == 0
    assert run.progress.step == 0
    run.start_async_rollout()
    assert producer.take(1).batch.prompts.tolist()[0] == [0]  # step 1's prompts again
    producer.close()


def test_remax_generates_its_baseline_for_the_prompts_the_step_took(tmp_path):
    run, events, rows = async_run(tmp_path, "algorithm.adv_estimator=remax", steps=3)
    greedy = []
    generate = run.servers.roles.rollouts[0].generate

    def record_greedy(prompts, sampling):
        if sampling.temperature == 0:
            greedy.append([row[0] for row in prompts.tolist()])
        return generate(prompts, sampling)

    run.servers.roles.rollouts[0].generate = record_greedy
    run.train()
    assert trained(events) == list(range(12))
    assert sorted(p for request in greedy for p in request) == list(range(12))
    assert all("timing_s/gen_max" in r for r in rows)


def test_a_pool_change_waits_for_the_batch_in_progress_then_uses_the_new_pool(tmp_path):
    run, events, rows = async_run(tmp_path, steps=5, gen_seconds=0.05)

    def recording(runner, name):
        generate = runner.generate_async

        def recorded(records, step):
            events.add(name, "start", step)
            out = generate(records, step)
            events.add(name, "end", step)
            return out

        runner.generate_async = recorded
        return runner

    recording(run.step_runner, "old pool")

    class Membership:  # a replica asked to join before step 3: the runner is rebuilt
        def __init__(self):
            self.applied = False

        def has_changes(self):
            return run.progress.step == 2 and not self.applied

        def apply(self, departed, version):
            self.applied = True
            events.add("apply")
            rollout = run.servers.roles.rollouts[0]
            runner = PPOStep(
                run.cfg, run.servers.roles, Tokenizer(), Syncer(rollout), run.progress.kl_ctrl
            )
            run.step_runner = recording(runner, "new pool")

    run.membership = Membership()
    run.train()
    assert trained(events) == list(range(20))
    log = events.log
    change = log.index(("apply",))
    # every generation on the old pool had ended before the change; the later ones (step 5's
    # at least: it needs version 3, synced after the change) went through the new pool
    assert all(i < change for i, e in enumerate(log) if e[0] == "old pool")
    assert all(i > change for i, e in enumerate(log) if e[0] == "new pool")
    assert ("new pool", "end", 5) in log


class AnyPoolSyncer(Syncer):
    """Syncs whatever replicas the pool has left (none, after its only one went down)."""

    def set_rollouts(self, rollouts):
        pass


def test_a_generation_failed_for_want_of_replicas_is_made_again_once_they_rejoin(tmp_path):
    run, events, rows = async_run(tmp_path, steps=4)
    rollout = run.servers.roles.rollouts[0]
    run.step_runner.syncer = AnyPoolSyncer(rollout)
    generate = rollout.generate
    failed = []

    def down_once(prompts, sampling):  # the only replica goes down on step 3's prompts
        if prompts.tolist()[0][0] == 8 and not failed:
            failed.append(True)
            raise RoleCallError("rollout", "127.0.0.1:1", "Generate", Unavailable())
        return generate(prompts, sampling)

    rollout.generate = down_once

    class Membership:  # at the boundary the replica that went down is restarted, rejoins
        def has_changes(self):
            return False

        def apply(self, departed, version):
            assert departed == ["rollout0"] and not run.async_rollout._generating
            events.add("rejoined")
            run.step_runner = PPOStep(
                run.cfg,
                run.servers.roles,
                Tokenizer(),
                AnyPoolSyncer(rollout),
                run.progress.kl_ctrl,
            )

    run.membership = Membership()
    run.train()
    assert failed and ("rejoined",) in events.log
    assert trained(events) == list(range(16))  # no prompt lost, none scored as a failure
    # the failed request never reached the stand-in's log; its batch was made once it rejoined
    regenerated = [i for i, e in enumerate(events.log) if e[:2] == ("gen start", 8)]
    assert len(regenerated) == 1 and regenerated[0] > events.log.index(("rejoined",))
    assert all(r["reward/failed_samples"] == 0 for r in rows)
