"""One step off policy through the real PPOStep.run and PPORun loop, with the role servers
replaced by stand-ins that record when they are called: the next batch is generated while
the step trains, a weight sync never lands during a generation, the KV cache is kept while
a batch is generated ahead, a retried step reuses its prompts, a stop starts no batch
ahead, and a rewind forgets the prompts drawn ahead."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from meshrl.api.v1 import common_pb2
from meshrl.data.loader import PromptLoader
from meshrl.ragged import Ragged
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.generation.rollout_memory import RolloutMemory
from services.coordinator.roles.roles import Roles
from services.coordinator.step.ppo_step import PPOStep
from services.reward.types import ScoreOutcome
from tests.coordinator.test_run_bookkeeping import Unavailable, make_run


class Events:
    """What the stand-ins did, in order, from every thread."""

    def __init__(self):
        self.log: list[tuple] = []
        self.lock = threading.Lock()

    def add(self, *event) -> None:
        with self.lock:
            self.log.append(event)

    def index(self, *event) -> int:
        return self.log.index(event)


class Rollout:
    """Each response is (first prompt id, sample index); it records its generations and
    memory calls, and how many generations run at once."""

    def __init__(self, events: Events, seconds: float):
        self.events, self.seconds = events, seconds
        self.version, self.running = 0, 0

    def generate(self, prompts, sampling):
        first = prompts.tolist()[0][0]
        self.running += 1
        self.events.add("gen start", first, self.version)
        time.sleep(self.seconds)
        self.events.add("gen end", first)
        self.running -= 1
        rows = [[row[0], j] for row in prompts.tolist() for j in range(sampling.n)]
        return SimpleNamespace(
            responses=Ragged.from_lists(rows),
            logprobs=Ragged.from_lists([[0.0, 0.0]] * len(rows), dtype=torch.float32),
            finish_reasons=["length"] * len(rows),
            weight_version=self.version,
            token_versions=None,
        )

    def set_memory_state(self, release):
        self.events.add("release" if release else "resume")
        return 0


class Syncer:
    def __init__(self, rollout: Rollout):
        self.rollout = rollout

    def set_rollouts(self, rollouts):
        assert rollouts == [self.rollout]  # the pool's one replica stayed

    def sync(self, version):
        assert self.rollout.running == 0, "a weight sync during a generation"
        self.rollout.version = version
        self.rollout.events.add("sync", version)
        return {}

    def close(self):
        pass


class Actor:
    def __init__(self, events: Events, fail_at: int | None = None):
        self.events, self.fail_at = events, fail_at

    def compute_log_probs(self, prompts, responses, temperature, base_model=False):
        lengths = responses.lengths.tolist()
        return Ragged.from_lists([[0.0] * n for n in lengths], dtype=torch.float32), None

    def update_policy(self, prompts, responses, old, advantages, step, **kw):
        if self.fail_at == step:
            self.fail_at = None
            raise RoleCallError("actor", "127.0.0.1:2", "UpdatePolicy", Unavailable())
        time.sleep(0.05)  # the generation ahead runs meanwhile
        self.events.add("update", step, prompts.tolist()[0][0])
        return {"actor/pg_loss": 0.0}

    def initialize(self, config_yaml, run_dir):
        return common_pb2.ServerInfo(service="trainer", role="actor")

    def save_checkpoint(self, path, with_optimizer=True):
        from pathlib import Path

        Path(path).mkdir(parents=True)


class Reward:
    def score(self, items):
        return [ScoreOutcome(float(i % 2), True, "", {}) for i, _ in enumerate(items)]


class Tokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


class Record:
    def __init__(self, i: int):
        self.prompt_ids, self.data_source, self.ground_truth = [i], "x", "0"
        self.extra_info, self.chat = {}, None


def mesh_run(tmp_path, *overrides, steps=4, seconds=0.02, fail_at=None):
    """A PPORun one step off policy over the stand-ins (GRPO, n=2, 4 prompts a step from
    0, 1, 2, ... in order); the KV-cache hand-over on, as on a shared GPU."""
    cfg = ["trainer.one_step_off_policy=true", "actor_rollout_ref.rollout.n=2", *overrides]
    run = make_run(tmp_path, cfg)
    run.progress.loader = PromptLoader([Record(i) for i in range(1000)], 4, shuffle=False)
    run.total_steps = steps
    events = Events()
    rollout, actor = Rollout(events, seconds), Actor(events, fail_at)
    run.servers.roles = Roles(rollouts=[rollout], actor=actor, reward=Reward())
    run.tokenizer = Tokenizer()

    def step_runner() -> PPOStep:
        runner = PPOStep(
            run.cfg, run.servers.roles, Tokenizer(), Syncer(rollout), run.progress.kl_ctrl
        )
        runner.memory = RolloutMemory([rollout], enabled=True)
        return runner

    run.step_runner = step_runner()
    rows = []
    run.on_step = lambda step, metrics: rows.append(metrics)
    return run, events, rows, step_runner


def test_the_next_batch_is_generated_while_the_step_trains(tmp_path):
    run, events, rows, _ = mesh_run(tmp_path, seconds=0.1)
    run.train()
    log = events.log
    # step k trains on prompts 4(k-1).. in order, none skipped or repeated
    assert [e[1:] for e in log if e[0] == "update"] == [(1, 0), (2, 4), (3, 8), (4, 12)]
    # batch 2 is generated with version 0 while step 1 updates, and so on
    assert [e[1:] for e in log if e[0] == "gen start"] == [(0, 0), (4, 0), (8, 1), (12, 2)]
    for prompt, step in ((4, 1), (8, 2), (12, 3)):
        assert events.index("gen start", prompt, step - 1) < events.index(
            "update", step, prompt - 4
        )
        assert events.index("gen end", prompt) < events.index("sync", step)  # then weights
    # the KV cache is kept while a batch is generated ahead: released only after the last
    assert [e for e in log if e[0] in ("release",)] == [("release",)]
    assert log.index(("release",)) > events.index("gen end", 12)
    assert [r["rollout/weight_lag"] for r in rows] == [0, 1, 1, 1]
    assert all(r["timing_s/gen"] >= 0.1 for r in rows)  # each batch's own generation time
    assert all("timing_s/gen_wait" in r for r in rows[1:])


def test_a_retried_step_trains_on_its_own_prompts_with_the_resynced_weights(tmp_path):
    run, events, rows, step_runner = mesh_run(tmp_path, "launcher.max_restarts=1", fail_at=2)
    run.recovery.restarter = object()

    def recover(err, updated=False):  # a restarted actor, nothing lost: retry in place
        run.step_runner = step_runner()
        run.step_runner.syncer.sync(run.progress.step - 1)
        return False

    run.recovery.recover = recover
    run.train()
    assert [e[1:] for e in events.log if e[0] == "update"] == [(1, 0), (2, 4), (3, 8), (4, 12)]
    # step 2's retry generates its own batch (the one made ahead went with the failed try),
    # and the batch of step 3 drawn during the failed try is generated again, not redrawn
    assert [e[1] for e in events.log if e[0] == "gen start"] == [0, 4, 8, 4, 8, 12]
    assert [r["rollout/weight_lag"] for r in rows] == [0, 0, 1, 1]


def test_a_stop_during_a_steps_generation_starts_no_batch_ahead(tmp_path):
    """Before, the next batch was started all the same, and the stop's sync, checkpoint and
    exit waited for a generation that was then thrown away."""
    run, events, rows, _ = mesh_run(tmp_path, steps=10)
    generate = run.servers.roles.rollouts[0].generate

    def stop_while_generating(prompts, sampling):
        if prompts.tolist()[0][0] == 0:  # step 1's own batch
            run.stop()
        return generate(prompts, sampling)

    run.servers.roles.rollouts[0].generate = stop_while_generating
    run.train()
    assert [e[1:] for e in events.log if e[0] == "update"] == [(1, 0)]  # the step ends
    assert [e[1] for e in events.log if e[0] == "gen start"] == [0]  # none for step 2
    assert ("release",) in events.log  # nothing ahead: the KV cache went to the trainers
    # the stop's checkpoint resumes at step 2's prompts
    [saved] = [
        run.checkpoints.manager.load_state(f)
        for f in run.checkpoints.manager.root.glob("global_step_*")
    ]
    assert (saved.step, saved.loader["batch_in_epoch"]) == (1, 1)


def test_a_rewind_forgets_the_prompts_drawn_ahead(tmp_path):
    run, _, _, _ = mesh_run(tmp_path)
    run.progress.step = 1
    run.progress.loader.next_batch()
    run.ahead.start(2, run.next_step_prompts(), lambda records, step: records)
    run.ahead.settle()
    assert run.ahead.prompts_for(2) is not None
    run.recovery.rewind()  # no checkpoint yet: back to step 0, the loader from the start
    assert run.ahead.prompts_for(2) is None and run.progress.step == 0
    assert run.progress.loader.next_batch()[1][0].prompt_ids == [0]
