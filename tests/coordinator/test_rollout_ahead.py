"""One step off policy (trainer.one_step_off_policy): the next step's batch generated in the
background while a step trains, and the run's bookkeeping of the prompts drawn for it
(which step trains on them, what a checkpoint saves, what a failure or a rewind does)."""

from __future__ import annotations

import threading

import pytest

from meshrl.config import ConfigError, build_config
from meshrl.data.loader import PromptLoader
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.generation.rollout_ahead import RolloutAhead
from services.coordinator.generation.rollout_pool import RolloutPool
from services.coordinator.recovery.checkpointing import CheckpointManager
from services.coordinator.run.run_data import plan_warnings
from tests.coordinator.test_run_bookkeeping import Unavailable, make_run


def drawing(loader: PromptLoader):
    calls = []

    def draw():
        before = loader.state_dict()
        epoch, records = loader.next_batch()
        calls.append(records)
        return epoch, records, before

    return draw, calls


def test_the_batch_is_generated_in_the_background_and_taken_by_its_step():
    ahead, loader = RolloutAhead(), PromptLoader(list(range(100)), 4, shuffle=False)
    draw, _ = drawing(loader)
    release, threads = threading.Event(), []

    def generate(records, step):
        threads.append(threading.current_thread().name)
        assert release.wait(10)  # held until the caller has moved on: start() did not wait
        return ("batch of", step, records)

    ahead.start(2, draw, generate)
    assert ahead.prompts_for(2) == (0, [0, 1, 2, 3]) and ahead.prompts_for(3) is None
    assert ahead.take(3) is None  # another step's batch is not handed out
    release.set()
    assert ahead.settle() >= 0
    got = ahead.take(2)
    assert got.batch == ("batch of", 2, [0, 1, 2, 3]) and got.seconds > 0
    assert threads == ["rollout-ahead-2"]
    assert ahead.take(2) is None  # taken once
    ahead.close()


def test_a_failed_generation_raises_once_in_the_step_that_needs_it():
    ahead, loader = RolloutAhead(), PromptLoader(list(range(100)), 4, shuffle=False)
    draw, calls = drawing(loader)
    error = RoleCallError("rollout0", "127.0.0.1:1", "Generate", Unavailable())

    def fails(records, step):
        raise error

    ahead.start(2, draw, fails)
    ahead.settle()  # keeps the error for take
    with pytest.raises(RoleCallError, match="Generate"):
        ahead.take(2)
    assert ahead.take(2) is None  # the retried step generates its batch itself
    # a retried step starting its next batch again draws no new prompts
    ahead.start(3, draw, lambda records, step: records)
    ahead.start(3, draw, lambda records, step: records)
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ahead.take(3).batch == [4, 5, 6, 7]
    ahead.close()


def test_a_checkpoint_saves_the_loader_from_before_the_prompts_drawn_ahead():
    ahead, loader = RolloutAhead(), PromptLoader(list(range(100)), 4, shuffle=False)
    draw, _ = drawing(loader)
    assert ahead.loader_state({"current": 1}, 1) == {"current": 1}
    loader.next_batch()  # step 1's prompts
    ahead.start(2, draw, lambda records, step: records)
    assert loader.state_dict()["batch_in_epoch"] == 2
    assert ahead.loader_state(loader.state_dict(), 1)["batch_in_epoch"] == 1
    # once step 2 has run, its prompts are behind the loader's position like any others
    assert ahead.loader_state(loader.state_dict(), 2)["batch_in_epoch"] == 2
    ahead.forget()  # a rewind: those prompts belong to an abandoned history
    assert ahead.prompts_for(2) is None
    assert ahead.loader_state({"current": 1}, 1) == {"current": 1}
    ahead.close()


def ahead_run(tmp_path, overrides=()):
    run = make_run(tmp_path, ["trainer.one_step_off_policy=true", *overrides])
    run.total_steps = 4
    assert run.ahead is not None  # made by PPORun for trainer.one_step_off_policy
    return run


class StepsThatDrawAhead:
    """A step runner that does what PPOStep.run does with the prompts: trains on its own,
    starts the next step's generation when its source draws the next prompts."""

    def __init__(self, run):
        self.run_ = run
        self.rollout_pool = RolloutPool({}, configured_replicas=1)  # no replica goes down
        self.trained: list[tuple[int, list]] = []
        self.drew_next: list[bool] = []

    def run(self, records, step, source):
        ahead = source.ahead
        assert ahead is self.run_.ahead  # the run's one-step-off source
        ahead.take(step)
        self.trained.append((step, records))
        draw_next = source.next_prompts()
        self.drew_next.append(draw_next is not None)
        if draw_next is not None:
            ahead.start(step + 1, draw_next, lambda r, s: r)
        ahead.settle()
        return {"critic/score/mean": 0.5}


def test_each_step_trains_on_the_prompts_drawn_for_it_and_none_is_skipped(tmp_path):
    run = ahead_run(tmp_path, ["trainer.save_freq=2"])
    run.step_runner = StepsThatDrawAhead(run)
    run.train()
    trained = run.step_runner.trained
    assert trained == [
        (1, [0, 1, 2, 3]),
        (2, [4, 5, 6, 7]),
        (3, [8, 9, 10, 11]),
        (4, [12, 13, 14, 15]),
    ]
    assert run.step_runner.drew_next == [True, True, True, False]  # none after the last step
    # the checkpoint of step 2 resumes at step 3's prompts, though they were drawn already
    saved = [
        CheckpointManager(run.run_dir).load_state(f)
        for f in sorted(run.checkpoints.manager.root.glob("global_step_*"))
    ]
    assert [(s.step, s.loader["batch_in_epoch"]) for s in saved] == [(2, 2), (4, 4)]


def test_the_checkpoint_of_a_run_one_step_off_policy_resumes_at_the_next_steps_prompts(
    tmp_path,
):
    run = ahead_run(tmp_path)
    run.progress.step = 1
    run.progress.loader.next_batch()  # step 1's
    run.ahead.start(2, run.next_step_prompts(), lambda r, s: r)
    run.ahead.settle()
    folder = run.checkpoints.save()
    resumed = ahead_run(tmp_path / "again")
    resumed.checkpoints.load(folder)
    assert resumed.progress.loader.next_batch()[1] == [4, 5, 6, 7]  # step 2's, drawn again
    run.ahead.close()
    resumed.ahead.close()


def test_no_prompts_are_drawn_ahead_of_the_last_step_or_after_a_stop(tmp_path):
    run = ahead_run(tmp_path)
    run.progress.step = 3
    assert run.next_step_prompts() is not None
    run.progress.step = 4  # the last
    assert run.next_step_prompts() is None
    run.progress.step = 2
    run.stop()
    assert run.next_step_prompts() is None
    run.ahead.close()


def test_a_failed_step_drops_its_batch_ahead_and_a_rewind_forgets_its_prompts(tmp_path):
    run = make_run(tmp_path, ["trainer.one_step_off_policy=true"], restarter=object())
    run.total_steps = 3
    generated: list[tuple[int, list]] = []
    attempts: list[int] = []

    def step(records, number, source):
        attempts.append(number)
        ahead, draw_next = source.ahead, source.next_prompts()
        ahead.take(number)
        if draw_next is not None:
            ahead.start(number + 1, draw_next, lambda r, s: generated.append((s, r)) or r)
        if attempts == [1, 2]:  # step 2's first try dies after starting step 3's batch
            raise RoleCallError("actor", "127.0.0.1:2", "UpdatePolicy", Unavailable())
        ahead.settle()
        return {"critic/score/mean": 0.5}

    rewinds = []

    def rewind_to_start(err, updated=False):
        rewinds.append(run.progress.step)
        run.ahead.forget()  # as rewind() does
        run.progress.step = 0
        run.progress.loader.load_state_dict({"epoch": 0, "batch_in_epoch": 0, "seed": 1})
        return True

    pool = RolloutPool({}, configured_replicas=1)  # between steps: no replica went down
    run.step_runner = type("Runner", (), {"run": staticmethod(step), "rollout_pool": pool})()
    run.recovery.recover = rewind_to_start
    run.train()
    assert attempts == [1, 2, 1, 2, 3] and rewinds == [2]
    # after the rewind the loader serves from the start again: step 3's prompts of the
    # abandoned history are drawn anew, and every step after it got its own
    assert [s for s, _ in generated] == [2, 3, 2, 3]
    assert generated[1][1] == generated[3][1] == [8, 9, 10, 11]
    run.ahead.close()


def test_dynamic_sampling_is_refused_one_step_off_policy_naming_both_keys():
    with pytest.raises(ConfigError) as refused:
        build_config(
            {}, ["trainer.one_step_off_policy=true", "algorithm.filter_groups.enable=true"]
        )
    assert "trainer.one_step_off_policy=true does not go with" in str(refused.value)
    assert "algorithm.filter_groups.enable=true" in str(refused.value)


def test_one_step_off_policy_on_the_trainers_gpu_is_warned_and_on_its_own_is_not():
    shared = build_config({}, ["trainer.one_step_off_policy=true", "trainer.device=cuda"])
    [warning] = [w for w in plan_warnings(shared) if "one_step_off_policy" in w]
    assert "launcher.role_gpus" in warning and "free_cache_engine does not apply" in warning
    split = {"launcher": {"role_gpus": {"rollout": "1", "actor": "0", "critic": "0", "ref": "0"}}}
    own = build_config(split, ["trainer.one_step_off_policy=true", "trainer.device=cuda"])
    assert not [w for w in plan_warnings(own) if "one_step_off_policy" in w]
    # Ray: a pool of rollout's own is its own GPUs; the trainers' pool shared is warned
    on = ["trainer.one_step_off_policy=true", "trainer.device=cuda", "launcher.kind=ray"]
    pools = {
        "launcher": {
            "resource_pool": {"gen": {"gpus_per_node": 1}, "global": {"gpus_per_node": 1}},
            "role_pool": {"rollout": "gen"},
        }
    }
    assert not [w for w in plan_warnings(build_config(pools, on)) if "off_policy" in w]
    assert [w for w in plan_warnings(build_config({}, on)) if "off_policy" in w]
    # servers started elsewhere: where they compute is not in the config, so no guess
    external = build_config({}, [*on[:2], "launcher.kind=external"])
    assert not [w for w in plan_warnings(external) if "off_policy" in w]
