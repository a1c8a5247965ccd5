"""PPORun's bookkeeping across resumes, rewinds, validation failures and stops, with the role
servers replaced by stand-ins: no process starts here."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest

from meshrl.api.v1 import common_pb2
from meshrl.config import build_config
from meshrl.data.loader import PromptLoader
from meshrl.gpus import count_gpus
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.generation.rollout_pool import RolloutPool
from services.coordinator.recovery.checkpointing import CheckpointManager, CoordinatorState
from services.coordinator.run.run import Endpoints, PPORun

ENDPOINTS = Endpoints(rollout=["127.0.0.1:1"], actor="127.0.0.1:2", reward="127.0.0.1:3")
GRPO = ["algorithm.adv_estimator=grpo", "trainer.logger=[]", "trainer.plot=false"]


class FakeActor:
    def __init__(self):
        self.loaded: list[str] = []

    def load_checkpoint(self, path: str) -> None:
        self.loaded.append(path)

    def initialize(self, config_yaml: str, run_dir: str) -> common_pb2.ServerInfo:
        self.loaded.append("initialized from the model")
        return common_pb2.ServerInfo(service="trainer", role="actor")

    def save_checkpoint(self, path: str, with_optimizer: bool = True) -> None:
        Path(path).mkdir(parents=True)


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


def make_run(run_dir, overrides=(), sinks=(), restarter=None) -> PPORun:
    """A PPORun past setup(): fake actor, a loader over 1000 integers, no critic."""
    run = PPORun(
        build_config({}, [*GRPO, *overrides]), ENDPOINTS, run_dir, list(sinks), None, restarter
    )
    run.servers.roles.actor = FakeActor()
    run.progress.loader = PromptLoader(list(range(1000)), 4, shuffle=False)
    run.total_steps = 25
    return run


def write_checkpoint(run_dir, step: int):
    """What save_checkpoint leaves, without servers: coordinator state and an actor folder."""
    loader = {"epoch": 0, "batch_in_epoch": step, "seed": 1}
    state = CoordinatorState.capture(step, loader, {"type": "fixed", "value": 0.001}, step)
    return CheckpointManager(run_dir).save(step, state, "", lambda tmp: (tmp / "actor").mkdir())


def test_rewind_after_resuming_from_another_folder_goes_back_there(tmp_path):
    # Resumed from step 50 of an earlier run's folder; the actor dies at step 53, before this
    # run saved a checkpoint of its own: the run must go back to step 50, not to step 0.
    earlier = write_checkpoint(tmp_path / "earlier", 50)
    run = make_run(tmp_path / "now", [f"trainer.resume_mode={earlier}"])
    run.checkpoints.resume()
    run.progress.step = 53
    run.recovery.rewind()
    assert run.progress.step == 50
    assert run.progress.loader.state_dict()["batch_in_epoch"] == 50
    assert run.servers.roles.actor.loaded == [str(earlier / "actor")] * 2


def test_rewind_prefers_the_checkpoint_the_run_saved(tmp_path):
    earlier = write_checkpoint(tmp_path / "earlier", 50)
    run = make_run(tmp_path / "now", [f"trainer.resume_mode={earlier}"])
    run.checkpoints.resume()
    run.progress.step = 60
    newer = run.checkpoints.save()
    run.progress.step = 63
    run.recovery.rewind()
    assert run.progress.step == 60
    assert run.servers.roles.actor.loaded[-1] == str(newer / "actor")


def test_resuming_an_older_step_sets_the_later_history_aside(tmp_path):
    # The folder holds steps 10 and 20; the user resumes from 10. Step 20 is another
    # history: a crash must not rewind to it, `auto` must not resume from it, and pruning
    # (max_ckpt_to_keep=1) must not delete this run's own step-15 save in its favour.
    step10, step20 = write_checkpoint(tmp_path, 10), write_checkpoint(tmp_path, 20)
    run = make_run(tmp_path, [f"trainer.resume_mode={step10}", "trainer.max_ckpt_to_keep=1"])
    run.checkpoints.resume()
    assert not step20.exists()
    (aside,) = run.checkpoints.manager.root.glob("abandoned-*")
    assert (aside / "global_step_20" / "actor").is_dir()  # moved, not deleted
    run.progress.step = 13
    run.recovery.rewind()
    assert run.progress.step == 10
    run.progress.step = 15
    own = run.checkpoints.save()
    assert own.is_dir() and run.checkpoints.manager.latest_valid() == own
    run.progress.step = 17
    run.recovery.rewind()
    assert run.progress.step == 15


def test_starting_over_in_a_used_folder_never_rewinds_into_its_old_checkpoints(tmp_path):
    write_checkpoint(tmp_path, 40)
    run = make_run(tmp_path, ["trainer.resume_mode=disable"])
    run.checkpoints.resume()
    assert run.checkpoints.manager.latest_valid() is None
    run.progress.step = 3
    run.recovery.rewind()
    assert run.progress.step == 0
    assert run.servers.roles.actor.loaded == ["initialized from the model"]


VALIDATION = object()
"""A run's validation, called through ``PPORun.validate``, which the tests replace."""


def _stub_steps(run: PPORun) -> None:
    run.run_step = lambda records: {"critic/score/mean": 0.5}


def test_a_dead_server_during_validation_is_recovered_not_fatal(tmp_path):
    run = make_run(tmp_path, ["trainer.test_freq=1"], restarter=object())
    _stub_steps(run)
    run.total_steps, run.validation = 2, VALIDATION
    validations = []

    def validate():
        validations.append(run.progress.step)
        if len(validations) == 1:
            raise RoleCallError("rollout", "127.0.0.1:1", "Generate", Unavailable())
        return {"val-core/x/acc/mean@1": 1.0}

    recovered = []
    run.validate = validate
    run.recovery.recover = lambda err, updated=False: recovered.append(updated) or False
    last = run.train()
    assert validations == [1, 1, 2]  # step 1's validation ran again after the restart
    assert recovered == [True]  # rollout gets step 1's weights back: its updates are done
    assert last["val-core/x/acc/mean@1"] == 1.0


def test_validation_failure_without_a_restarter_still_fails_the_run(tmp_path):
    run = make_run(tmp_path, ["trainer.test_freq=1"])
    _stub_steps(run)
    run.total_steps, run.validation = 2, VALIDATION
    run.validate = lambda: (_ for _ in ()).throw(
        RoleCallError("rollout", "127.0.0.1:1", "Generate", Unavailable())
    )
    with pytest.raises(RoleCallError):
        run.train()


@pytest.mark.parametrize(
    ("stop_at", "saved_steps"),
    [(2, [2]), (3, [2, 3])],  # on a save step: once, not twice; between: where it stopped
    ids=["on_a_save_step_saves_once", "between_save_steps_saves_where_it_stopped"],
)
def test_a_stop_saves_each_step_once(tmp_path, stop_at, saved_steps):
    run = make_run(tmp_path, ["trainer.save_freq=2"])
    saved = []
    run.checkpoints.save = lambda: saved.append(run.progress.step)

    def step(records):
        if run.progress.step == stop_at:
            run.stop()  # Ctrl-C during this step
        return {"critic/score/mean": 0.5}

    run.run_step = step
    run.train()
    assert saved == saved_steps


def test_a_crash_that_recurs_after_each_rewind_ends_the_run(tmp_path):
    # The actor dies in every step 2: each time the run goes back to step 0 and reaches step
    # 2 again. The restart budget (launcher.max_restarts=2) must hold across those rewinds.
    run = make_run(tmp_path, ["launcher.max_restarts=2"], restarter=object())
    run.total_steps = 5
    attempts = []

    def step(records, number, draw_records=None, **one_step_off):
        attempts.append(number)
        if len(attempts) > 20:
            raise AssertionError("restarted without end")
        if number == 2:
            raise RoleCallError("actor", "127.0.0.1:2", "UpdatePolicy", Unavailable())
        return {"critic/score/mean": 0.5}

    def rewind_to_start(err, updated=False):
        run.progress.step = 0
        run.progress.loader.load_state_dict({"epoch": 0, "batch_in_epoch": 0, "seed": 1})
        return True

    pool = RolloutPool({}, configured_replicas=1)  # between steps: no replica went down
    run.step_runner = type("Runner", (), {"run": staticmethod(step), "rollout_pool": pool})()
    run.recovery.recover = rewind_to_start
    with pytest.raises(RoleCallError, match="UpdatePolicy"):
        run.train()
    assert attempts == [1, 2, 1, 2, 1, 2]  # the first try and 2 restarts


@pytest.mark.parametrize("checkpoint", ["none", "own", "elsewhere"])
def test_a_run_out_of_restarts_says_so_and_where_it_resumes_from(tmp_path, caplog, checkpoint):
    """Before, a run with launcher.max_restarts=0 whose actor died ended on the call's
    error alone: `actor at ... failed during UpdatePolicy: UNAVAILABLE: Socket closed`."""
    run = make_run(tmp_path / "run", ["launcher.max_restarts=0"], restarter=object())
    if checkpoint == "own":
        run.checkpoints.last_saved = write_checkpoint(tmp_path / "run", 2)
    if checkpoint == "elsewhere":  # resumed by resume_mode=<path> from another run's folder
        run.checkpoints.resumed_from = write_checkpoint(tmp_path / "earlier", 2)
    err = RoleCallError("actor", "127.0.0.1:2", "UpdatePolicy", Unavailable())
    with caplog.at_level("ERROR"), pytest.raises(RoleCallError):
        run.recovery.count_failure(3, err, "step 3 failed")
    said = caplog.text
    assert "launcher.max_restarts=0 recoveries of this step are spent, so the run ends" in said
    if checkpoint == "own":
        assert (
            f"its last checkpoint, {run.checkpoints.last_saved}, resumes it: run it again with "
            in said
        )
        assert "trainer.resume_mode=auto" in said
    elif checkpoint == "elsewhere":  # auto would find nothing in this run's folder
        assert f"run it again with trainer.resume_mode={run.checkpoints.resumed_from}" in said
    else:
        assert "it has no checkpoint yet (trainer.save_freq)" in said


def test_a_resume_path_that_does_not_verify_is_a_config_error_naming_the_key(tmp_path):
    from meshrl.config import ConfigError

    partial = write_checkpoint(tmp_path / "earlier", 5)
    (partial / "MANIFEST.json").unlink()
    run = make_run(tmp_path / "now", [f"trainer.resume_mode={partial}"])
    with pytest.raises(ConfigError, match=r"trainer.resume_mode: .*no MANIFEST.json"):
        run.checkpoints.resume()


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("no_such", "no such folder$"),
        ("a_file", "not a folder$"),
        ("run", "a run folder, not one checkpoint; name one of its checkpoints/global_step_<k>"),
    ],
)
def test_a_resume_path_that_is_no_checkpoint_says_what_it_is(tmp_path, name, says):
    """Before, each said 'no MANIFEST.json (partial checkpoint)', a folder that does not
    exist included."""
    from meshrl.config import ConfigError

    path = tmp_path / name
    if name == "a_file":
        path.write_text("")
    if name == "run":  # a run folder rather than one of its checkpoints
        write_checkpoint(path, 5)
    run = make_run(tmp_path / "now", [f"trainer.resume_mode={path}"])
    with pytest.raises(ConfigError, match=f"trainer.resume_mode: {path}: {says}"):
        run.checkpoints.resume()


@pytest.mark.parametrize("mode", ["auto", "path"])
def test_a_run_resumed_at_its_last_step_has_nothing_to_train_and_says_so(tmp_path, mode):
    """Before, it started every role server, loaded the models, warned, and ended."""
    from services.coordinator.run.run_data import AlreadyTrained, resumed_step

    last = write_checkpoint(tmp_path, 4)
    resume = "auto" if mode == "auto" else str(last)
    cfg = build_config({}, [*GRPO, f"trainer.resume_mode={resume}"])
    assert resumed_step(cfg, tmp_path, 10) == 4
    assert resumed_step(cfg, tmp_path, 4) == 4
    with pytest.raises(AlreadyTrained) as done:
        _load(cfg, tmp_path, total_steps=4)
    assert str(done.value).startswith(
        "nothing to train: the run's checkpoint is at step 4, and the run has 4 steps "
        "(trainer.total_training_steps, or total_epochs): raise them to train on, or "
        "evaluate the checkpoint with trainer.val_only=true"
    )


def test_a_corrupt_last_checkpoint_is_skipped_not_taken_for_a_finished_run(tmp_path, caplog):
    """Its checksums are read when it would end the run: the run resumes from the one
    before and trains the last step again, as a resume in the servers' time skips it."""
    from services.coordinator.run.run_data import resumed_step

    write_checkpoint(tmp_path, 2)
    last = write_checkpoint(tmp_path, 4)
    (last / "coordinator.json").write_text((last / "coordinator.json").read_text() + " ")
    cfg = build_config({}, [*GRPO, "trainer.resume_mode=auto"])
    with caplog.at_level("WARNING"):
        assert resumed_step(cfg, tmp_path, 4) == 2
    assert "skipping checkpoint" in caplog.text
    assert resumed_step(build_config({}, GRPO + ["trainer.resume_mode=disable"]), tmp_path, 4) == 0


def _load(cfg, run_dir, total_steps):
    """load_run_data's checks after the prompts are read, without a tokenizer or files."""
    from services.coordinator.run import run_data

    class Loader:
        steps_per_epoch = total_steps

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_data, "load_tokenizer", lambda model: None)
        patch.setattr(run_data, "make_dataset", lambda *args: None)
        patch.setattr(run_data, "make_loader", lambda *args: Loader())
        return run_data.load_run_data(cfg, run_dir)


def test_a_run_that_keeps_no_checkpoint_says_so_at_its_start(tmp_path):
    from services.coordinator.run.run_data import plan_warnings

    keeps_none = build_config({}, [*GRPO])  # save_freq -1, as verl's default
    (warning,) = plan_warnings(keeps_none)
    assert warning.startswith("trainer.save_freq=-1: this run saves no checkpoint of its steps")
    assert plan_warnings(build_config({}, [*GRPO, "trainer.save_freq=5"])) == []


def test_a_run_asked_to_validate_without_validation_files_says_so():
    from services.coordinator.run.run_data import plan_warnings

    cfg = build_config({}, [*GRPO, "trainer.save_freq=5", "trainer.test_freq=2"])
    assert plan_warnings(cfg) == [
        "trainer.test_freq=2, but data.val_files is empty: this run validates nothing"
    ]


def test_a_kl_ctrl_that_applies_to_nothing_says_so():
    from services.coordinator.run.run_data import plan_warnings

    base = [*GRPO, "trainer.save_freq=5", "algorithm.kl_ctrl.kl_coef=0.05"]
    (warning,) = plan_warnings(
        build_config({}, [*base, "actor_rollout_ref.actor.use_kl_loss=true"])
    )
    assert warning.startswith("algorithm.kl_ctrl.kl_coef=0.05 has no effect")
    assert "actor.kl_loss_coef=0.001" in warning  # the value the run does weigh its KL by
    (warning,) = plan_warnings(build_config({}, [*base, "algorithm.kl_ctrl.type=adaptive"]))
    assert "type=adaptive, algorithm.kl_ctrl.kl_coef=0.05 has no effect" in warning
    assert "no KL term at all" in warning
    # in use, or left at its defaults: nothing to say
    assert plan_warnings(build_config({}, [*base, "algorithm.use_kl_in_reward=true"])) == []
    assert plan_warnings(build_config({}, [*GRPO, "trainer.save_freq=5"])) == []


def test_a_reward_model_path_without_enable_says_it_is_not_loaded(tmp_path):
    """verl's reward_model.model.path without reward_model.enable=true loads no model too;
    before, nothing said so and the run trained on the rules' scores alone."""
    from services.coordinator.run.run_data import plan_warnings

    base = [*GRPO, "trainer.save_freq=5", f"reward.reward_model.path={tmp_path}"]
    (warning,) = plan_warnings(build_config({}, base))
    assert warning.startswith(f"reward.reward_model.path={tmp_path}, but ")
    assert "set reward.reward_model.enable=true" in warning
    assert plan_warnings(build_config({}, [*base, "reward.reward_model.enable=true"])) == []


def test_histories_set_aside_within_one_second_go_to_folders_of_their_own(tmp_path):
    manager = CheckpointManager(tmp_path)
    write_checkpoint(tmp_path, 20)
    first = manager.set_aside_after(10)
    write_checkpoint(tmp_path, 20)  # the same step again, abandoned again at once
    second = manager.set_aside_after(10)
    assert first != second
    assert (first / "global_step_20").is_dir() and (second / "global_step_20").is_dir()
    assert manager.set_aside_after(10) is None  # nothing left past step 10


class InvalidArgument(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self):
        return "LoadCheckpoint: .../actor does not fit this role's model: Size mismatch"


def test_resuming_from_a_checkpoint_of_another_model_is_a_bad_request_saying_how_out(tmp_path):
    # Before: exit 1 (a failed run), with no word of how to start afresh
    from meshrl.config import ConfigError

    write_checkpoint(tmp_path, 7)
    run = make_run(tmp_path)  # resume_mode=auto finds step 7

    def load_checkpoint(path):
        raise RoleCallError("actor", "127.0.0.1:2", "LoadCheckpoint", InvalidArgument())

    run.servers.roles.actor.load_checkpoint = load_checkpoint
    with pytest.raises(ConfigError) as e:
        run.checkpoints.resume()
    assert "trainer.resume_mode=auto: actor at 127.0.0.1:2 failed during LoadCheckpoint" in str(e)
    assert "does not fit this role's model" in str(e.value)
    assert "use another trainer.default_local_dir or set trainer.resume_mode=disable" in str(
        e.value
    )
    named = make_run(tmp_path, [f"trainer.resume_mode={tmp_path / 'checkpoints/global_step_7'}"])
    named.servers.roles.actor.load_checkpoint = load_checkpoint
    with pytest.raises(ConfigError, match="name another checkpoint in trainer.resume_mode or set"):
        named.checkpoints.resume()


def test_val_only_validates_once_logs_it_and_trains_nothing(tmp_path):
    # Evaluating step 10 of a run that went on to step 20: nothing is set aside, no step runs.
    step10, step20 = write_checkpoint(tmp_path, 10), write_checkpoint(tmp_path, 20)
    logged = []
    sink = type("Sink", (), {"log": lambda self, step, m: logged.append((step, m)), "close": id})
    run = make_run(tmp_path, ["trainer.val_only=true", f"trainer.resume_mode={step10}"], [sink()])
    run.checkpoints.resume()
    assert step20.is_dir()  # an evaluation writes no history: nothing moved
    run.run_step = lambda records: pytest.fail("val_only must not train")
    run.validation = VALIDATION
    run.validate = lambda: {"val-core/x/acc/mean@1": 0.75}
    assert run.train() == {"val-core/x/acc/mean@1": 0.75}
    assert logged == [(10, {"val-core/x/acc/mean@1": 0.75})] and run.finished


def test_val_only_without_validation_files_is_refused_at_start():
    from meshrl.config import ConfigError
    from services.coordinator.run.preflight import check_run_config

    with pytest.raises(ConfigError, match="trainer.val_only=true .* data.val_files is empty"):
        check_run_config(build_config({}, [*GRPO, "trainer.val_only=true"]))


def test_only_an_evaluation_may_leave_out_the_training_files():
    from meshrl.config import ConfigError
    from meshrl.config.rules import check_config

    def check_required_keys_given(cfg):
        check_config(cfg, "required")

    model = "actor_rollout_ref.model.path=m"
    with pytest.raises(ConfigError, match="^data.train_files is empty"):
        check_required_keys_given(build_config({}, [*GRPO, model]))
    check_required_keys_given(build_config({}, [*GRPO, model, "trainer.val_only=true"]))
    with pytest.raises(ConfigError) as both:  # every missing key in one message
        check_required_keys_given(build_config({}, GRPO))
    assert str(both.value).splitlines() == [
        "invalid config:",
        "  data.train_files is empty: name the training parquet files "
        "(data.train_files=train.parquet, or [a.parquet,b.parquet])",
        "  actor_rollout_ref.model.path is empty: set it to a Hugging Face model folder or hub id",
    ]


def test_val_only_validates_again_after_a_recovery_and_not_at_all_when_stopped(tmp_path):
    run = make_run(tmp_path, ["trainer.val_only=true"], restarter=object())
    run.validation = VALIDATION
    calls = []

    def validate():
        calls.append(len(calls))
        if len(calls) == 1:  # the actor dies in the first try: the run goes back
            raise RoleCallError("actor", "127.0.0.1:2", "ComputeLogProbs", Unavailable())
        return {"val-core/x/acc/mean@1": 0.5}

    run.validate = validate
    run.recovery.recover = lambda err, updated=False: True
    assert run.train() == {"val-core/x/acc/mean@1": 0.5} and run.finished
    assert calls == [0, 1]

    stopped = make_run(tmp_path / "b", ["trainer.val_only=true"])
    stopped.validation = VALIDATION
    stopped.validate = lambda: pytest.fail("a stopped run must not validate")
    stopped.stop()
    assert stopped.train() == {} and not stopped.finished  # exit 3, as a stopped run


class ServerOn:
    """A role server's Initialize, answering with the GPUs it computes on."""

    def __init__(self, *gpus: str):
        self.gpus = list(gpus)

    def initialize(self, config_yaml: str, run_dir: str) -> common_pb2.ServerInfo:
        return common_pb2.ServerInfo(gpus=self.gpus)


def test_the_run_counts_each_gpu_once_and_a_restarted_server_by_its_new_gpus(tmp_path, caplog):
    run = make_run(tmp_path / "run")
    # a 2-rank actor, rollout on the actor's first GPU, the reward service on the CPU
    run.servers.roles.actor = ServerOn("GPU-a", "GPU-b")
    run.servers.roles.rollouts = [ServerOn("GPU-a")]
    run.servers.roles.reward = ServerOn()
    with caplog.at_level(logging.INFO):
        run.servers.initialize()
    assert run.servers.gpus == {"rollout0": ["GPU-a"], "actor": ["GPU-a", "GPU-b"], "reward": []}
    assert count_gpus(run.servers.gpus.values()) == 2
    assert "the role servers compute on 2 GPU(s); perf/throughput is per GPU" in caplog.text

    run.servers.roles.actor = ServerOn("GPU-c")  # restarted on one other GPU
    run.servers.initialize(["actor"])
    assert count_gpus(run.servers.gpus.values()) == 2  # GPU-a (rollout) and GPU-c
