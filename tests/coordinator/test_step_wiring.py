"""The step's wiring: every argument each phase of PPOStep passes to a role server, checked
against stand-in role clients that record their calls, phase by phase and through
``PPOStep.run`` over each of the three batch sources.

The batch is small enough to check by hand. Two prompts, n = 2:

    record 0: prompt [11, 12], ds0 / gt0 / chat0 / {"i": 0}
    record 1: prompt [13],     ds1 / gt1 / chat1 / {"i": 1}

The replica answers prompt p with sample j = [p + 100 (j+1)] * (j+1), so the rows are
[111], [211, 211], [113], [213, 213]; the reward scores a response 1 when it starts with
"1" (sample 0), else 0: scores (1, 0, 1, 0). Row k's numbers, per token:

    rollout log-probs  -0.1 (k+1)        actor (old) log-probs   -(k+1)
    reference server   -(k+1) - 0.25     LoRA actor's base model -(k+1) - 0.5
    critic values       0.1 (k+1)

so that a phase passing one for another, or the rows in another order, fails a test.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import threading
from types import SimpleNamespace

import grpc
import pytest
import torch

from meshrl.config import build_config
from meshrl.ragged import Ragged
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.generation.async_rollout import AsyncRollout
from services.coordinator.generation.generated import GeneratedBatch
from services.coordinator.generation.rollout_ahead import RolloutAhead
from services.coordinator.generation.rollout_memory import RolloutMemory
from services.coordinator.roles.roles import Roles
from services.coordinator.step import ppo_step as ppo_step_module
from services.coordinator.step.batch_sources import (
    FullyAsyncBatches,
    OneStepOffBatches,
    SynchronousBatches,
)
from services.coordinator.step.ppo_step import PPOStep, WeightSyncFailed
from services.coordinator.step.stages import Inferred, ScoredBatch, Scores, Trajectory
from services.coordinator.step.timing import PhaseTimer
from services.reward.types import ScoreItem, ScoreOutcome
from services.rollout.types import GenerationResult, SamplingParams
from services.trainer.client import TrainerClient

SEED = 7
PROMPTS = [[11, 12], [11, 12], [13], [13]]
RESPONSES = [[111], [211, 211], [113], [213, 213]]
ROLLOUT_LOGPROBS = [[-0.1], [-0.2, -0.2], [-0.3], [-0.4, -0.4]]
OLD = [[-1.0], [-2.0, -2.0], [-3.0], [-4.0, -4.0]]
REF = [[-1.25], [-2.25, -2.25], [-3.25], [-4.25, -4.25]]
BASE = [[-1.5], [-2.5, -2.5], [-3.5], [-4.5, -4.5]]
VALUES = [[0.1], [0.2, 0.2], [0.3], [0.4, 0.4]]
GRPO_A = 0.70710  # (1 - 0.5) / std(1, 0), the unbiased std sqrt(0.5)


def plain(x):
    """Ragged, tensors and floats as nested lists of numbers rounded to 4 places."""
    if isinstance(x, Ragged):
        x = x.tolist()
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, list | tuple):
        return [plain(v) for v in x]
    return x


def rows_of(values_of_row, lengths=(1, 2, 1, 2)) -> Ragged:
    return Ragged.from_lists(
        [[values_of_row(k)] * n for k, n in enumerate(lengths)], dtype=torch.float32
    )


class Record:
    def __init__(self, i: int, prompt_ids: list[int]):
        self.prompt_ids = prompt_ids
        self.data_source, self.ground_truth = f"ds{i}", f"gt{i}"
        self.extra_info, self.chat = {"i": i}, f"chat{i}"


def records() -> list[Record]:
    return [Record(0, [11, 12]), Record(1, [13])]


class Calls:
    """Every call of every stand-in, in order: (role, method, arguments by name)."""

    def __init__(self):
        self.log: list[tuple[str, str, dict]] = []
        self.lock = threading.Lock()

    def add(self, role: str, method: str, arguments: dict) -> None:
        with self.lock:
            self.log.append((role, method, arguments))

    def of(self, role: str, method: str) -> list[dict]:
        return [a for r, m, a in self.log if (r, m) == (role, method)]

    def names(self) -> list[tuple[str, str]]:
        return [(r, m) for r, m, _ in self.log]


class Replica:
    def __init__(self, calls: Calls, name: str = "rollout", version: int = 0):
        self.calls, self.name, self.version = calls, name, version

    def generate(self, prompts: Ragged, sampling: SamplingParams) -> GenerationResult:
        self.calls.add(self.name, "generate", {"prompts": prompts.tolist(), "sampling": sampling})
        rows = [
            [p[0] + 100 * (j + 1)] * (j + 1) for p in prompts.tolist() for j in range(sampling.n)
        ]
        return GenerationResult(
            responses=Ragged.from_lists(rows),
            logprobs=Ragged.from_lists(
                [[-0.1 * (k + 1)] * len(r) for k, r in enumerate(rows)], dtype=torch.float32
            ),
            finish_reasons=["length"] * len(rows),
            weight_version=self.version,
        )

    def set_memory_state(self, release: bool) -> int:
        self.calls.add(self.name, "set_memory_state", {"release": release})
        return 0


class Reward:
    def __init__(self, calls: Calls, fail_rows: tuple[int, ...] = ()):
        self.calls, self.fail_rows = calls, fail_rows

    def score(self, items: list[ScoreItem]) -> list[ScoreOutcome]:
        self.calls.add("reward", "score", {"items": list(items)})
        out = []
        for k, item in enumerate(items):
            if k in self.fail_rows:
                out.append(ScoreOutcome(0.0, False, "boom", {}))
                continue
            score = 1.0 if item.response.startswith("1") else 0.0
            out.append(ScoreOutcome(score, True, "", {"acc": score}))
        return out


def _bound(method, args, kwargs) -> dict:
    """The call's arguments by the real client's parameter names, defaults filled in."""
    bound = inspect.signature(method).bind(None, *args, **kwargs)
    bound.apply_defaults()
    return {k: plain(v) for k, v in bound.arguments.items() if k != "self"}


class Trainer:
    """The actor, reference or critic: TrainerClient's methods, recorded."""

    def __init__(self, calls: Calls, role: str):
        self.calls, self.role = calls, role

    def compute_log_probs(self, *args, **kwargs):
        a = _bound(TrainerClient.compute_log_probs, args, kwargs)
        self.calls.add(self.role, "compute_log_probs", a)
        if self.role == "ref":
            shift = 0.25
        else:
            shift = 0.5 if a["base_model"] else 0.0
        return rows_of(lambda k: -(k + 1) - shift, [len(r) for r in a["responses"]]), None

    def compute_values(self, *args, **kwargs):
        a = _bound(TrainerClient.compute_values, args, kwargs)
        self.calls.add(self.role, "compute_values", a)
        return rows_of(lambda k: 0.1 * (k + 1), [len(r) for r in a["responses"]])

    def update_policy(self, *args, **kwargs):
        self.calls.add(
            self.role, "update_policy", _bound(TrainerClient.update_policy, args, kwargs)
        )
        return {"actor/pg_loss": 1.5}

    def update_value(self, *args, **kwargs):
        self.calls.add(self.role, "update_value", _bound(TrainerClient.update_value, args, kwargs))
        return {"critic/vf_loss": 2.5}


class Syncer:
    def __init__(self, calls: Calls, replica: Replica, error=None):
        self.calls, self.replica, self.error = calls, replica, error

    def set_rollouts(self, rollouts):
        self.calls.add("syncer", "set_rollouts", {"rollouts": list(rollouts)})

    def sync(self, version):
        self.calls.add("syncer", "sync", {"version": version})
        if self.error is not None:
            raise self.error
        self.replica.version = version
        return {"sync/mb": 3.0}


class KLController:
    def __init__(self, value: float = 0.0):
        self.value = value
        self.updates: list[tuple[float, int]] = []

    def update(self, current_kl, n_steps):
        self.updates.append((current_kl, n_steps))


class Tokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        assert skip_special_tokens
        return [" ".join(map(str, r)) for r in rows]


BASE_OVERRIDES = [
    "actor_rollout_ref.rollout.n=2",
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "critic.ppo_mini_batch_size=2",
    "actor_rollout_ref.rollout.temperature=0.7",
    "actor_rollout_ref.rollout.top_p=0.9",
    "actor_rollout_ref.rollout.top_k=5",
    "data.max_response_length=2",
    "data.max_prompt_length=2",
    f"trainer.seed={SEED}",
]


@dataclasses.dataclass
class Mesh:
    step: PPOStep
    calls: Calls
    replica: Replica
    syncer: Syncer
    kl_ctrl: KLController


def mesh(
    *overrides: str,
    critic: bool = False,
    ref: bool = False,
    generations=None,
    fail_rows=(),
    version: int = 0,
    sync_error=None,
) -> Mesh:
    cfg = build_config({}, [*BASE_OVERRIDES, *overrides])
    calls = Calls()
    replica = Replica(calls, version=version)
    roles = Roles(
        rollouts=[replica],
        actor=Trainer(calls, "actor"),
        reward=Reward(calls, fail_rows),
        critic=Trainer(calls, "critic") if critic else None,
        ref=Trainer(calls, "ref") if ref else None,
    )
    syncer = Syncer(calls, replica, sync_error)
    kl_ctrl = KLController()
    step = PPOStep(cfg, roles, Tokenizer(), syncer, kl_ctrl, generations=generations)
    step.memory = RolloutMemory([replica], enabled=True)  # the KV cache handed over
    return Mesh(step, calls, replica, syncer, kl_ctrl)


@pytest.fixture
def closing():
    opened: list[PPOStep] = []
    yield opened.append
    for step in opened:
        step.close()


def sampling(step: int, **changes) -> SamplingParams:
    """The SamplingParams the BASE_OVERRIDES give at ``step``."""
    fields = dict(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        max_tokens=2,
        n=2,
        seed=SEED * 1_000_003 + step,
        logprobs=True,
    )
    return SamplingParams(**{**fields, **changes})


def items(responses=("111", "211 211", "113", "213 213"), chats=("chat0", "chat1")):
    return [
        ScoreItem(f"ds{g}", text, f"gt{g}", chats[g], {"i": g})
        for text, g in zip(responses, (0, 0, 1, 1), strict=True)
    ]


def generated_batch(step: PPOStep, number: int = 3) -> GeneratedBatch:
    return step.generate(records(), number)


# --- generate ---------------------------------------------------------------------------------
def test_generate_sends_the_prompts_and_every_sampling_setting(closing):
    m = mesh("actor_rollout_ref.rollout.calculate_log_probs=true", version=2)
    closing(m.step)
    batch = m.step.generate(records(), 3)
    [call] = m.calls.of("rollout", "generate")
    assert call == {"prompts": [[11, 12], [13]], "sampling": sampling(3)}
    assert plain(batch.prompts) == PROMPTS and plain(batch.responses) == RESPONSES
    assert plain(batch.rollout_logprobs) == ROLLOUT_LOGPROBS
    assert batch.group_ids.tolist() == [0, 0, 1, 1] and batch.weight_version == 2
    assert batch.data_sources == ["ds0", "ds0", "ds1", "ds1"]
    assert batch.ground_truths == ["gt0", "gt0", "gt1", "gt1"]
    assert batch.chats == ["chat0", "chat0", "chat1", "chat1"]
    assert batch.extra_infos == [{"i": 0}, {"i": 0}, {"i": 1}, {"i": 1}]
    # the second generation batch of a step (dynamic sampling) has a seed of its own
    m.step.generate(records(), 3, 1)
    stride = ppo_step_module.GEN_BATCH_SEED_STRIDE
    assert m.calls.of("rollout", "generate")[1]["sampling"] == sampling(
        3, seed=SEED * 1_000_003 + 3 + stride
    )


def test_sampling_asks_log_probs_and_a_seed_only_when_the_run_wants_them(closing):
    m = mesh(
        "actor_rollout_ref.rollout.calculate_log_probs=false",
        "actor_rollout_ref.rollout.seed_per_prompt=false",
    )
    closing(m.step)
    assert m.step.sampling_params(4) == sampling(4, seed=None, logprobs=False)
    # the drift metric alone: log-probs on steps 1, k+1, ... (k = probs_diff_freq)
    drift = mesh("actor_rollout_ref.rollout.probs_diff_freq=2")
    closing(drift.step)
    assert [drift.step.sampling_params(s).logprobs for s in (1, 2, 3)] == [True, False, True]


def test_an_async_batch_may_mix_weight_versions(closing):
    # two replicas serving versions 0 and 1, a prompt a request each: only the fully async
    # producer's batches may mix them, and the batch is of the newest
    m = mesh(
        "actor_rollout_ref.rollout.prompts_per_request=1", "actor_rollout_ref.rollout.replicas=2"
    )
    closing(m.step)
    other = Replica(m.calls, "rollout", version=1)
    m.step.rollout_pool.add("rollout1", other)
    with pytest.raises(RuntimeError, match="different weight versions"):
        m.step.generate(records(), 3)
    batch = m.step.generate_async(records(), 3)
    assert batch.weight_version == 1
    assert sorted(c["prompts"] for c in m.calls.of("rollout", "generate")[-2:]) == [
        [[11, 12]],
        [[13]],
    ]


# --- score, old log-probs, reference, values --------------------------------------------------
def test_score_sends_each_samples_source_response_truth_chat_and_extra_info(closing):
    m = mesh(fail_rows=(1,))
    closing(m.step)
    scores = m.step.score(generated_batch(m.step))
    [call] = m.calls.of("reward", "score")
    assert call["items"] == items()
    assert scores.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scores.reward_scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scores.scores.dtype == torch.float32
    assert scores.extra == [{"acc": 1.0}, {}, {"acc": 1.0}, {"acc": 0.0}]
    assert scores.failures == ["", "boom", "", ""] and scores.failed == 1


def test_a_row_without_its_chat_sends_its_decoded_prompt(closing):
    m = mesh()
    closing(m.step)
    recs = records()
    recs[1].chat = ""
    m.step.score(m.step.generate(recs, 1))
    [call] = m.calls.of("reward", "score")
    assert call["items"] == items(chats=("chat0", "13"))


def test_score_and_infer_send_the_batch_to_each_server_at_the_rollout_temperature(closing):
    m = mesh("actor_rollout_ref.actor.use_kl_loss=true", critic=True, ref=True)
    closing(m.step)
    batch = generated_batch(m.step)
    timer = PhaseTimer()
    scored, inferred = m.step.score_and_infer(batch, None, timer)
    sequences = {"prompts": PROMPTS, "responses": RESPONSES}
    assert m.calls.of("actor", "compute_log_probs") == [
        {**sequences, "temperature": 0.7, "with_entropy": False, "base_model": False}
    ]
    assert m.calls.of("ref", "compute_log_probs") == [
        {**sequences, "temperature": 0.7, "with_entropy": False, "base_model": False}
    ]
    assert m.calls.of("critic", "compute_values") == [sequences]
    assert [c["items"] for c in m.calls.of("reward", "score")] == [items()]
    assert scored.generated is batch and scored.scores.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert plain(inferred.old_logprobs) == OLD
    assert plain(inferred.ref_logprobs) == REF
    assert plain(inferred.values) == VALUES
    assert set(timer.seconds) == {"reward", "old_log_prob", "ref", "values"}


def test_scores_from_the_source_are_not_asked_again_and_absent_roles_are_not_called(closing):
    m = mesh()
    closing(m.step)
    batch = generated_batch(m.step)
    given = Scores(scores=torch.tensor([0.5] * 4), reward_scores=torch.tensor([0.5] * 4))
    timer = PhaseTimer()
    scored, inferred = m.step.score_and_infer(batch, given, timer)
    assert scored.scores is given
    assert m.calls.names() == [("rollout", "generate"), ("actor", "compute_log_probs")]
    assert inferred.ref_logprobs is None and inferred.values is None
    assert set(timer.seconds) == {"old_log_prob"}


def test_a_lora_actor_gives_the_reference_log_probs_from_its_base_model(closing):
    m = mesh("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.model.lora_rank=8")
    closing(m.step)
    _, inferred = m.step.score_and_infer(generated_batch(m.step), None, PhaseTimer())
    calls = sorted(m.calls.of("actor", "compute_log_probs"), key=lambda c: c["base_model"])
    sequences = {"prompts": PROMPTS, "responses": RESPONSES, "temperature": 0.7}
    assert calls == [
        {**sequences, "with_entropy": False, "base_model": False},
        {**sequences, "with_entropy": False, "base_model": True},
    ]
    assert plain(inferred.old_logprobs) == OLD and plain(inferred.ref_logprobs) == BASE


def test_greedy_rollout_computes_log_probs_at_temperature_one(closing):
    m = mesh("actor_rollout_ref.rollout.temperature=0")
    closing(m.step)
    m.step.old_log_probs(generated_batch(m.step))
    assert m.calls.of("actor", "compute_log_probs")[0]["temperature"] == 1.0


def test_every_phase_ends_before_the_first_error_is_raised(closing):
    m = mesh(critic=True)
    closing(m.step)
    batch = generated_batch(m.step)
    gate = threading.Event()

    def failing_score(items):
        raise RuntimeError("reward down")

    def slow_values(prompts, responses):
        assert gate.wait(10)
        m.calls.add("critic", "compute_values", {})
        return rows_of(lambda k: 0.0)

    m.step.roles.reward.score = failing_score
    m.step.roles.critic.compute_values = slow_values
    threading.Timer(0.1, gate.set).start()
    with pytest.raises(RuntimeError, match="reward down"):
        m.step.score_and_infer(batch, None, PhaseTimer())
    assert ("critic", "compute_values") in m.calls.names()


# --- the greedy baseline (ReMax) ----------------------------------------------------------------
def test_remax_asks_greedy_responses_to_the_same_prompts_and_scores_them(closing):
    m = mesh("algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.calculate_log_probs=true")
    closing(m.step)
    batch = generated_batch(m.step)
    timer = PhaseTimer()
    baseline = m.step.greedy_baseline(records(), batch, 3, timer)
    greedy = m.calls.of("rollout", "generate")[1]
    assert greedy == {
        "prompts": [[11, 12], [13]],
        "sampling": sampling(3, temperature=0.0, n=1, logprobs=False),
    }
    # the greedy answers [111] and [113], each beside both samples of its prompt
    [scored] = m.calls.of("reward", "score")
    assert scored["items"] == items(responses=("111", "111", "113", "113"))
    assert baseline is not None and baseline.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert set(timer.seconds) == {"gen_max"}


def test_estimators_without_a_greedy_baseline_ask_for_none(closing):
    m = mesh("algorithm.adv_estimator=grpo")
    closing(m.step)
    timer = PhaseTimer()
    assert m.step.greedy_baseline(records(), generated_batch(m.step), 3, timer) is None
    assert len(m.calls.of("rollout", "generate")) == 1 and not timer.seconds


# --- updates ------------------------------------------------------------------------------------
def _inferred(ref=True, values=True) -> Inferred:
    return Inferred(
        old_logprobs=rows_of(lambda k: -(k + 1.0)),
        ref_logprobs=rows_of(lambda k: -(k + 1) - 0.25) if ref else None,
        values=rows_of(lambda k: 0.1 * (k + 1)) if values else None,
    )


ADVANTAGES = [[0.5], [-0.5, -0.5], [1.5], [-1.5, -1.5]]
RETURNS = [[1.0], [0.0, 0.0], [2.0], [3.0, 3.0]]


def _trajectory() -> Trajectory:
    return Trajectory(
        Ragged.from_lists(ADVANTAGES, dtype=torch.float32),
        Ragged.from_lists(RETURNS, dtype=torch.float32),
    )


def _multi_turn(batch: GeneratedBatch) -> GeneratedBatch:
    mask = Ragged.from_lists([[1], [1, 0], [1], [0, 1]], dtype=torch.uint8)
    return dataclasses.replace(batch, loss_mask=mask)


LOSS_MASK = [[1], [1, 0], [1], [0, 1]]


def test_update_actor_sends_every_tensor_and_the_step(closing):
    m = mesh(
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    )
    closing(m.step)
    batch = _multi_turn(generated_batch(m.step))
    assert m.step.update_actor(batch, _inferred(), _trajectory(), 3) == {"actor/pg_loss": 1.5}
    [call] = m.calls.of("actor", "update_policy")
    assert call == {
        "prompts": PROMPTS,
        "responses": RESPONSES,
        "old_logprobs": OLD,
        "advantages": ADVANTAGES,
        "global_step": 3,
        "ref_logprobs": REF,
        "rollout_logprobs": ROLLOUT_LOGPROBS,
        "loss_mask": LOSS_MASK,
    }


def test_update_actor_leaves_out_what_the_loss_does_not_use(closing):
    # KL in the reward, not in the loss: the reference log-probs stay on the coordinator;
    # no rollout log-probs asked on this step: none sent (the engine's NaN)
    m = mesh(
        "algorithm.use_kl_in_reward=true",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.calculate_log_probs=false",
    )
    closing(m.step)
    m.step.update_actor(generated_batch(m.step), _inferred(), _trajectory(), 4)
    [call] = m.calls.of("actor", "update_policy")
    assert call["ref_logprobs"] is None and call["rollout_logprobs"] is None
    assert call["loss_mask"] is None and call["global_step"] == 4


def test_update_critic_sends_the_values_returns_and_the_step(closing):
    m = mesh(critic=True)
    closing(m.step)
    batch = _multi_turn(generated_batch(m.step))
    assert m.step.update_critic(batch, _inferred(), _trajectory(), 3) == {"critic/vf_loss": 2.5}
    [call] = m.calls.of("critic", "update_value")
    assert call == {
        "prompts": PROMPTS,
        "responses": RESPONSES,
        "old_values": VALUES,
        "returns": RETURNS,
        "global_step": 3,
        "loss_mask": LOSS_MASK,
    }


def test_the_actor_waits_out_critic_warmup_and_the_critic_does_not(closing):
    m = mesh("critic.critic_warmup=2", critic=True)
    closing(m.step)
    batch = generated_batch(m.step)
    timer = PhaseTimer()
    metrics = m.step.updates(batch, _inferred(), _trajectory(), 2, timer)
    assert metrics == {"critic/vf_loss": 2.5}  # step 2 of a 2-step warm-up: the critic only
    assert not m.calls.of("actor", "update_policy") and set(timer.seconds) == {"update_critic"}
    metrics = m.step.updates(batch, _inferred(), _trajectory(), 3, timer)
    assert metrics == {"critic/vf_loss": 2.5, "actor/pg_loss": 1.5}
    assert [c["global_step"] for c in m.calls.of("actor", "update_policy")] == [3]
    assert [c["global_step"] for c in m.calls.of("critic", "update_value")] == [2, 3]
    assert set(timer.seconds) == {"update_critic", "update_actor"}
    no_critic = mesh()
    closing(no_critic.step)
    assert no_critic.step.updates(batch, _inferred(values=False), _trajectory(), 1, timer) == {
        "actor/pg_loss": 1.5
    }


@pytest.mark.parametrize("share", [True, False])
def test_updates_on_one_gpu_run_one_after_the_other(closing, monkeypatch, share):
    m = mesh(critic=True)
    closing(m.step)
    monkeypatch.setattr(
        ppo_step_module, "updates_share_gpu", lambda cfg: share if cfg is m.step.cfg else None
    )
    actor_started = threading.Event()
    overlapped = []

    def update_value(*args, **kwargs):
        overlapped.append(actor_started.wait(0.3 if share else 10))
        return {"critic/vf_loss": 2.5}

    def update_policy(*args, **kwargs):
        actor_started.set()
        return {"actor/pg_loss": 1.5}

    m.step.roles.critic.update_value = update_value
    m.step.roles.actor.update_policy = update_policy
    m.step.updates(generated_batch(m.step), _inferred(), _trajectory(), 1, PhaseTimer())
    assert overlapped == [not share]


def test_an_update_error_is_raised_after_both_updates_ran(closing):
    m = mesh(critic=True)
    closing(m.step)

    def update_value(*args, **kwargs):
        raise RuntimeError("critic down")

    m.step.roles.critic.update_value = update_value
    with pytest.raises(RuntimeError, match="critic down"):
        m.step.updates(generated_batch(m.step), _inferred(), _trajectory(), 1, PhaseTimer())


# --- the step through each batch source ---------------------------------------------------------
TIMING = "timing_s/"


def timing_keys(metrics: dict) -> set[str]:
    return {k.removeprefix(TIMING) for k in metrics if k.startswith(TIMING)}


def test_a_synchronous_step_end_to_end_with_a_critic_and_a_reference(closing):
    # GAE with gamma = lam = 1, no whitening: the return is the score on every token, the
    # advantage the score less the value: (0.9), (-0.2, -0.2), (0.7), (-0.4, -0.4)
    m = mesh(
        "algorithm.adv_estimator=gae",
        "algorithm.whiten_advantages=false",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        critic=True,
        ref=True,
        version=1,
    )
    closing(m.step)
    source = SynchronousBatches(m.step.cfg.algorithm.filter_groups, 2)
    metrics = m.step.run(records(), 3, source)
    returns = [[1.0], [0.0, 0.0], [1.0], [0.0, 0.0]]
    advantages = [[0.9], [-0.2, -0.2], [0.7], [-0.4, -0.4]]
    assert m.calls.of("critic", "update_value") == [
        {
            "prompts": PROMPTS,
            "responses": RESPONSES,
            "old_values": VALUES,
            "returns": returns,
            "global_step": 3,
            "loss_mask": None,
        }
    ]
    assert m.calls.of("actor", "update_policy") == [
        {
            "prompts": PROMPTS,
            "responses": RESPONSES,
            "old_logprobs": OLD,
            "advantages": advantages,
            "global_step": 3,
            "ref_logprobs": REF,
            "rollout_logprobs": ROLLOUT_LOGPROBS,
            "loss_mask": None,
        }
    ]
    assert m.calls.of("rollout", "generate") == [
        {"prompts": [[11, 12], [13]], "sampling": sampling(3)}
    ]
    # the KV cache taken back before generating and given back before the trainers' phases
    names = m.calls.names()
    assert names[:2] == [("rollout", "set_memory_state"), ("rollout", "generate")]
    assert [c["release"] for c in m.calls.of("rollout", "set_memory_state")] == [False, True]
    assert names.index(("rollout", "set_memory_state"), 1) < names.index(
        ("actor", "compute_log_probs")
    )
    assert names[-2:] == [("syncer", "set_rollouts"), ("syncer", "sync")]
    assert m.calls.of("syncer", "set_rollouts") == [{"rollouts": [m.replica]}]
    assert m.calls.of("syncer", "sync") == [{"version": 3}]
    assert metrics["actor/pg_loss"] == 1.5 and metrics["critic/vf_loss"] == 2.5
    assert metrics["sync/mb"] == 3.0
    assert metrics["critic/vf_explained_var"] == pytest.approx(
        1
        - torch.tensor([0.9, -0.2, -0.2, 0.7, -0.4, -0.4]).var().item()
        / (torch.tensor([1.0, 0, 0, 1, 0, 0]).var().item() + 1e-5),
        rel=1e-4,
    )
    assert metrics["critic/values/mean"] == pytest.approx(1.6 / 6)
    assert timing_keys(metrics) == {
        "step", "gen", "reward", "old_log_prob", "ref", "values", "adv",
        "update_critic", "update_actor", "sync_weights",
    }  # fmt: skip


def test_a_synchronous_steps_metrics(closing):
    # GRPO, no critic, no reference; generated with version 1, so the actor (trained from
    # step 2's weights) is one step ahead of the batch
    m = mesh(
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.calculate_log_probs=false",
        version=1,
    )
    closing(m.step)
    source = SynchronousBatches(m.step.cfg.algorithm.filter_groups, 2)
    metrics = m.step.run(records(), 3, source)
    [update] = m.calls.of("actor", "update_policy")
    a = GRPO_A
    assert update["advantages"] == plain([[a], [-a, -a], [a], [-a, -a]])
    assert update["ref_logprobs"] is None and update["rollout_logprobs"] is None
    assert not m.calls.of("critic", "update_value")
    assert timing_keys(metrics) == {
        "step",
        "gen",
        "reward",
        "old_log_prob",
        "adv",
        "update_actor",
        "sync_weights",
    }
    timings = {k: v for k, v in metrics.items() if k.startswith(TIMING)}
    assert all(v >= 0 for v in timings.values())
    assert metrics["timing_s/step"] >= metrics["timing_s/gen"] + metrics["timing_s/update_actor"]
    assert metrics["perf/time_per_step"] == metrics["timing_s/step"]
    assert metrics["perf/throughput"] == pytest.approx(12 / metrics["timing_s/step"])
    assert metrics["rollout/replica/0/tokens_per_s"] > 0
    rest = {
        k: v
        for k, v in metrics.items()
        if not k.startswith(TIMING)
        and k not in ("perf/time_per_step", "perf/throughput", "rollout/replica/0/tokens_per_s")
    }
    assert rest == pytest.approx(
        {
            "critic/advantages/mean": -a / 3,
            "critic/advantages/max": a,
            "critic/advantages/min": -a,
            "critic/returns/mean": -a / 3,
            "critic/returns/max": a,
            "critic/returns/min": -a,
            "critic/rewards/mean": 0.5,
            "critic/rewards/max": 1.0,
            "critic/rewards/min": 0.0,
            "actor/pg_loss": 1.5,
            "sync/mb": 3.0,
            "rollout/replicas": 1.0,
            "rollout/resent_requests": 0.0,
            "rollout/replica/0/requests": 1.0,
            "critic/score/mean": 0.5,
            "critic/score/max": 1.0,
            "critic/score/min": 0.0,
            "response_length/mean": 1.5,
            "response_length/max": 2.0,
            "response_length/min": 1.0,
            "response_length/clip_ratio": 0.5,  # 2 tokens: at data.max_response_length
            "prompt_length/mean": 1.5,
            "prompt_length/max": 2.0,
            "prompt_length/min": 1.0,
            "prompt_length/clip_ratio": 0.5,
            "perf/total_num_tokens": 12.0,
            "rollout/weight_version": 1.0,
            "rollout/weight_lag": 1.0,
            "reward/failed_samples": 0.0,
        },
        abs=1e-4,
    )


def test_a_step_with_kl_in_the_reward_updates_the_controller(closing):
    m = mesh("algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=true", ref=True)
    closing(m.step)
    m.kl_ctrl.value = 0.5
    metrics = m.step.run(records(), 1, SynchronousBatches(m.step.cfg.algorithm.filter_groups, 2))
    # k1 = old - ref = 0.25 a token, averaged per sequence then over the batch
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.25)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert m.kl_ctrl.updates == [(pytest.approx(0.25), 4)]


def test_a_step_with_dynamic_sampling_scores_in_the_source_only(closing):
    m = mesh("algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true")
    closing(m.step)
    source = SynchronousBatches(m.step.cfg.algorithm.filter_groups, 2, lambda i: records())
    metrics = m.step.run(records(), 2, source)
    assert len(m.calls.of("reward", "score")) == 1  # both groups vary: one batch, scored once
    assert metrics["train/num_gen_batches"] == 1.0 and metrics["train/kept_prompts_ratio"] == 1.0
    assert m.calls.of("rollout", "generate")[0]["sampling"] == sampling(2)
    [update] = m.calls.of("actor", "update_policy")
    assert update["prompts"] == PROMPTS and update["global_step"] == 2
    assert {"gen", "reward", "old_log_prob", "adv", "update_actor", "sync_weights"} <= timing_keys(
        metrics
    )


def test_a_step_writes_its_generations_with_the_overlong_penalty_apart(closing, tmp_path):
    m = mesh(
        "algorithm.adv_estimator=grpo",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=1",
        "reward.overlong_buffer.penalty_factor=1.0",
        generations=tmp_path,
        fail_rows=(2,),
    )
    closing(m.step)
    metrics = m.step.run(records(), 3, SynchronousBatches(m.step.cfg.algorithm.filter_groups, 2))
    lines = [json.loads(x) for x in (tmp_path / "3.jsonl").read_text().splitlines()]
    assert lines == [
        {"input": "11 12", "output": "111", "gts": "gt0", "score": 1.0, "step": 3,
         "acc": 1.0, "overlong_reward": 0.0},
        {"input": "11 12", "output": "211 211", "gts": "gt0", "score": -1.0, "step": 3,
         "acc": 0.0, "overlong_reward": -1.0},
        {"input": "13", "output": "113", "gts": "gt1", "score": 0.0, "step": 3,
         "overlong_reward": 0.0, "reward_failure": "boom"},
        {"input": "13", "output": "213 213", "gts": "gt1", "score": -1.0, "step": 3,
         "acc": 0.0, "overlong_reward": -1.0},
    ]  # fmt: skip
    assert metrics["reward/overlong_reward/mean"] == -0.5
    assert metrics["reward/overlong/mean"] == 0.5
    assert metrics["reward/failed_samples"] == 1.0
    assert "dump_rollout_generations" in timing_keys(metrics)


def test_a_remax_step_subtracts_the_greedy_score(closing):
    m = mesh("algorithm.adv_estimator=remax")
    closing(m.step)
    metrics = m.step.run(records(), 1, SynchronousBatches(m.step.cfg.algorithm.filter_groups, 2))
    [update] = m.calls.of("actor", "update_policy")
    # greedy answers score 1: advantages score - 1 on every token
    assert update["advantages"] == [[0.0], [-1.0, -1.0], [0.0], [-1.0, -1.0]]
    assert "gen_max" in timing_keys(metrics)


def test_a_step_whose_trainers_skipped_optimizer_steps_says_so(closing, caplog):
    m = mesh("algorithm.adv_estimator=grpo", critic=True)
    closing(m.step)
    m.step.roles.actor.update_policy = lambda *a, **kw: {"actor/nonfinite_grad_steps": 2.0}
    m.step.roles.critic.update_value = lambda *a, **kw: {"critic/nonfinite_grad_steps": 1.0}
    with caplog.at_level("WARNING", logger=ppo_step_module.log.name):
        m.step.run(records(), 3, SynchronousBatches(m.step.cfg.algorithm.filter_groups, 2))
    assert caplog.messages == [
        "step 3: the actor skipped 2 optimizer step(s): the gradient norm was not finite "
        "(NaN/inf loss); its weights did not change in them",
        "step 3: the critic skipped 1 optimizer step(s): the gradient norm was not finite "
        "(NaN/inf loss); its weights did not change in them",
    ]


def test_a_failed_weight_sync_keeps_the_steps_metrics(closing):
    class Unavailable(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "connection refused"

    error = RoleCallError("rollout", "127.0.0.1:1", "SyncWeights", Unavailable())
    m = mesh("algorithm.adv_estimator=grpo", sync_error=error)
    closing(m.step)
    with pytest.raises(WeightSyncFailed) as caught:
        m.step.run(records(), 2, SynchronousBatches(m.step.cfg.algorithm.filter_groups, 2))
    assert caught.value.error is error
    assert caught.value.metrics["actor/pg_loss"] == 1.5
    assert "sync_weights" in timing_keys(caught.value.metrics)


def test_one_step_off_the_step_trains_on_the_batch_made_during_the_step_before(closing):
    m = mesh("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.calculate_log_probs=true")
    closing(m.step)
    ahead = RolloutAhead()
    later = [Record(0, [21, 22]), Record(1, [23])]
    draws = [lambda: (0, later, {}), None]
    source = OneStepOffBatches(ahead, lambda: draws.pop(0))
    first = m.step.run(records(), 1, source)
    # step 1 generated its own batch, then step 2's with step 1's weights (version 0)
    assert [(c["prompts"], c["sampling"]) for c in m.calls.of("rollout", "generate")] == [
        ([[11, 12], [13]], sampling(1)),
        ([[21, 22], [23]], sampling(2)),
    ]
    assert [c["release"] for c in m.calls.of("rollout", "set_memory_state")] == [False]
    names = m.calls.names()
    assert names.index(("rollout", "generate"), 1) < names.index(("syncer", "sync"))
    second = m.step.run(later, 2, source)
    [_, update] = m.calls.of("actor", "update_policy")
    assert update["prompts"] == [[21, 22], [21, 22], [23], [23]]
    assert update["responses"] == [[121], [221, 221], [123], [223, 223]]
    assert update["global_step"] == 2
    assert len(m.calls.of("rollout", "generate")) == 2  # nothing generated in step 2
    # no next step: the KV cache goes to the trainers
    assert [c["release"] for c in m.calls.of("rollout", "set_memory_state")] == [False, False, True]
    assert m.calls.of("syncer", "sync") == [{"version": 1}, {"version": 2}]
    assert first["rollout/weight_lag"] == 0.0 and second["rollout/weight_lag"] == 1.0
    assert timing_keys(first) == {
        "step",
        "gen",
        "gen_wait",
        "reward",
        "old_log_prob",
        "adv",
        "update_actor",
        "sync_weights",
    }
    assert timing_keys(second) == timing_keys(first)
    assert second["timing_s/gen"] > 0  # the generation ahead's own time


def test_fully_async_the_step_takes_the_producers_batch_and_its_records(closing):
    m = mesh(
        "algorithm.adv_estimator=grpo",
        "trainer.async_training.enable=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    )
    closing(m.step)
    cfg = m.step.cfg
    producer = AsyncRollout(cfg.trainer.async_training, 2)
    drawn = iter([(4, records(), {})])
    producer.start(0, 1, lambda: next(drawn), m.step.generate_async)
    try:
        source = FullyAsyncBatches(producer, partial_rollout=False, start=lambda: None)
        metrics = m.step.run([], 1, source)
    finally:
        producer.close()
    [gen] = m.calls.of("rollout", "generate")
    assert gen == {"prompts": [[11, 12], [13]], "sampling": sampling(1)}
    [update] = m.calls.of("actor", "update_policy")
    assert update["prompts"] == PROMPTS and update["global_step"] == 1
    assert update["rollout_logprobs"] == ROLLOUT_LOGPROBS
    assert m.calls.of("syncer", "sync") == [{"version": 1}]
    assert producer.version == 1  # told of the sync
    assert not m.calls.of("rollout", "set_memory_state")[1:]  # the cache stays awake
    assert metrics["training/epoch"] == 4.0
    assert metrics["async/dropped_samples"] == 0.0
    assert timing_keys(metrics) == {
        "step", "gen", "gen_drain", "trainer_idle", "rollout_idle", "reward", "old_log_prob",
        "adv", "update_actor", "sync_weights",
    }  # fmt: skip


def test_fully_async_with_partial_rollouts_syncs_without_draining(closing):
    m = mesh("algorithm.adv_estimator=grpo", "trainer.async_training.enable=true")
    closing(m.step)
    producer = SimpleNamespace(synced=[], weights_synced=lambda v: producer.synced.append(v))
    source = FullyAsyncBatches(producer, partial_rollout=True, start=lambda: None)
    m.step.rollout_pool.gate.try_enter()  # a request in flight: a drain would wait for it
    timer = PhaseTimer()
    synced = []
    syncing = threading.Thread(target=lambda: synced.append(source.sync_weights(5, m.step, timer)))
    syncing.start()
    syncing.join(5)
    m.step.rollout_pool.gate.leave()  # a drain, had there been one, ends here
    syncing.join()
    assert synced == [{"sync/mb": 3.0}] and "gen_drain" not in timer.seconds
    assert m.calls.of("syncer", "sync") == [{"version": 5}] and producer.synced == [5]
    assert set(timer.seconds) == {"sync_weights"}
    drained = FullyAsyncBatches(producer, partial_rollout=False, start=lambda: None)
    drained.sync_weights(6, m.step, timer)
    assert producer.synced == [5, 6] and set(timer.seconds) == {"sync_weights", "gen_drain"}


def test_each_source_gives_the_step_its_prompts_records(closing):
    # the records are what the greedy baseline (ReMax) generates from
    m = mesh()
    closing(m.step)
    batch = generated_batch(m.step)
    recs = records()
    ahead = SimpleNamespace(take=lambda step: SimpleNamespace(batch=batch, seconds=0.25))
    taken = OneStepOffBatches(ahead, lambda: None).take(2, recs, m.step, PhaseTimer())
    assert taken.generated is batch and taken.records is recs and taken.scores is None
    nothing_ahead = SimpleNamespace(take=lambda step: None)
    taken = OneStepOffBatches(nothing_ahead, lambda: None).take(2, recs, m.step, PhaseTimer())
    assert taken.records is recs and plain(taken.generated.prompts) == PROMPTS
    produced = SimpleNamespace(
        batch=batch, records=recs, metrics={"a": 1.0}, gen_seconds=0.5, epoch=3
    )
    producer = SimpleNamespace(take=lambda step: produced)
    timer = PhaseTimer()
    taken = FullyAsyncBatches(producer, False, lambda: None).take(2, [], m.step, timer)
    assert taken.generated is batch and taken.records is recs and taken.scores is None
    assert taken.metrics == {"a": 1.0, "training/epoch": 3.0} and timer.seconds == {"gen": 0.5}


def test_the_sources_start_next_and_settle(closing):
    m = mesh()
    closing(m.step)
    fg = m.step.cfg.algorithm.filter_groups
    assert SynchronousBatches(fg, 2).start_next(1, m.step) is False
    assert FullyAsyncBatches(SimpleNamespace(), False, lambda: None).start_next(1, m.step) is True
    ahead = RolloutAhead(stopping=lambda: True)
    assert (
        OneStepOffBatches(ahead, lambda: lambda: (0, records(), {})).start_next(1, m.step) is False
    )
    assert OneStepOffBatches(RolloutAhead(), lambda: None).start_next(1, m.step) is False
    timer = PhaseTimer()
    OneStepOffBatches(RolloutAhead(), lambda: None).settle(timer)
    assert set(timer.seconds) == {"gen_wait"}
    with pytest.raises(ValueError, match="^dynamic sampling needs draw_records$"):
        SynchronousBatches(fg.model_copy(update={"enable": True}), 2)


# --- the stages: a batch's groups selected and batches concatenated, every field -------------
def _full_batch(first: int, groups: int, version: int, token_versions: bool) -> GeneratedBatch:
    """``groups`` prompts of 2 samples, every optional field filled; numbers from ``first``."""
    n = 2 * groups
    ids = [first + k for k in range(n)]
    return GeneratedBatch(
        prompts=Ragged.from_lists([[i] for i in ids]),
        responses=Ragged.from_lists([[i, i] for i in ids]),
        rollout_logprobs=Ragged.from_lists([[-i, -i] for i in ids], dtype=torch.float32),
        finish_reasons=["stop" if i % 2 else "length" for i in ids],
        group_ids=torch.arange(n) // 2,
        data_sources=[f"ds{i}" for i in ids],
        ground_truths=[f"gt{i}" for i in ids],
        extra_infos=[{"i": i} for i in ids],
        weight_version=version,
        token_versions=Ragged.from_lists([[i, i + 1] for i in ids]) if token_versions else None,
        chats=[f"chat{i}" for i in ids],
        loss_mask=Ragged.from_lists([[1, i % 2] for i in ids], dtype=torch.uint8),
        turn_rewards=Ragged.from_lists([[0.0, i / 10] for i in ids], dtype=torch.float32),
        rollout_metrics={"multi_turn/turns": float(first)},
    )


def _fields(batch: GeneratedBatch) -> dict:
    return {
        f.name: plain(getattr(batch, f.name)) if f.name != "group_ids" else batch.group_ids.tolist()
        for f in dataclasses.fields(batch)
    }


def test_select_groups_keeps_every_field_of_the_chosen_rows():
    batch = _full_batch(0, 3, 4, token_versions=True)
    picked = batch.select_groups([2, 0])
    assert picked.group_ids.dtype == torch.int64
    assert _fields(picked) == {
        "prompts": [[4], [5], [0], [1]],
        "responses": [[4, 4], [5, 5], [0, 0], [1, 1]],
        "rollout_logprobs": [[-4, -4], [-5, -5], [0, 0], [-1, -1]],
        "finish_reasons": ["length", "stop", "length", "stop"],
        "group_ids": [0, 0, 1, 1],
        "data_sources": ["ds4", "ds5", "ds0", "ds1"],
        "ground_truths": ["gt4", "gt5", "gt0", "gt1"],
        "extra_infos": [{"i": 4}, {"i": 5}, {"i": 0}, {"i": 1}],
        "weight_version": 4,
        "token_versions": [[4, 5], [5, 6], [0, 1], [1, 2]],
        "chats": ["chat4", "chat5", "chat0", "chat1"],
        "loss_mask": [[1, 0], [1, 1], [1, 0], [1, 1]],
        "turn_rewards": [[0.0, 0.4], [0.0, 0.5], [0.0, 0.0], [0.0, 0.1]],
        "rollout_metrics": {"multi_turn/turns": 0.0},
    }
    bare = dataclasses.replace(
        batch, chats=[], token_versions=None, loss_mask=None, turn_rewards=None
    )
    picked = bare.select_groups([1])
    assert (picked.chats, picked.token_versions, picked.loss_mask, picked.turn_rewards) == (
        [],
        None,
        None,
        None,
    )


def test_concat_numbers_the_groups_on_and_keeps_every_field():
    a = _full_batch(0, 1, 2, token_versions=False)
    empty = a.select_groups([])
    b = dataclasses.replace(_full_batch(10, 2, 3, token_versions=True), chats=[])
    assert len(empty) == 0 and empty.group_ids.dtype == torch.int64  # not torch's float default
    both = GeneratedBatch.concat([a, empty, b])
    assert both.group_ids.dtype == torch.int64
    assert _fields(both) == {
        "prompts": [[0], [1], [10], [11], [12], [13]],
        "responses": [[0, 0], [1, 1], [10, 10], [11, 11], [12, 12], [13, 13]],
        "rollout_logprobs": [[0, 0], [-1, -1], [-10, -10], [-11, -11], [-12, -12], [-13, -13]],
        "finish_reasons": ["length", "stop", "length", "stop", "length", "stop"],
        "group_ids": [0, 0, 1, 1, 2, 2],
        "data_sources": ["ds0", "ds1", "ds10", "ds11", "ds12", "ds13"],
        "ground_truths": ["gt0", "gt1", "gt10", "gt11", "gt12", "gt13"],
        "extra_infos": [{"i": 0}, {"i": 1}, {"i": 10}, {"i": 11}, {"i": 12}, {"i": 13}],
        "weight_version": 3,
        # a part without token versions: each token of its weight version
        "token_versions": [[2, 2], [2, 2], [10, 11], [11, 12], [12, 13], [13, 14]],
        "chats": ["chat0", "chat1", "", "", "", ""],  # a part without chats: ""
        "loss_mask": [[1, 0], [1, 1], [1, 0], [1, 1], [1, 0], [1, 1]],
        "turn_rewards": [[0.0, 0.0], [0.0, 0.1], [0.0, 1.0], [0.0, 1.1], [0.0, 1.2], [0.0, 1.3]],
        "rollout_metrics": {"multi_turn/turns": 10.0},
    }
    plain_parts = [dataclasses.replace(a, token_versions=None, loss_mask=None), a]
    joined = GeneratedBatch.concat(plain_parts)
    assert joined.token_versions is None and joined.loss_mask is None


def _scores(values, extra=True, failures=True, failed=0) -> Scores:
    return Scores(
        scores=torch.tensor(values),
        reward_scores=torch.tensor(values) + 1,
        extra=[{"v": v} for v in values] if extra else [],
        failures=[f"f{v}" for v in values] if failures else [],
        failed=failed,
    )


def test_scores_select_and_concat_keep_every_field():
    s = _scores([0.0, 1.0, 2.0], failed=2)
    picked = s.select([2, 0])
    assert picked.scores.tolist() == [2.0, 0.0] and picked.reward_scores.tolist() == [3.0, 1.0]
    assert picked.extra == [{"v": 2.0}, {"v": 0.0}] and picked.failures == ["f2.0", "f0.0"]
    assert picked.failed == 2  # what the phase met, kept whole
    bare = _scores([0.0, 1.0], extra=False, failures=False).select([1])
    assert bare.extra == [] and bare.failures == []
    both = Scores.concat([s, _scores([5.0], failed=1)])
    assert both.scores.tolist() == [0.0, 1.0, 2.0, 5.0]
    assert both.reward_scores.tolist() == [1.0, 2.0, 3.0, 6.0]
    assert both.extra == [{"v": 0.0}, {"v": 1.0}, {"v": 2.0}, {"v": 5.0}]
    assert both.failures == ["f0.0", "f1.0", "f2.0", "f5.0"] and both.failed == 3


def test_a_scored_batch_selects_and_concatenates_its_scores_row_for_row():
    batch = _full_batch(0, 2, 1, token_versions=False)
    scored = ScoredBatch(batch, _scores([0.0, 1.0, 2.0, 3.0], failed=1))
    assert len(scored) == 4
    picked = scored.select_groups([1])
    assert plain(picked.generated.prompts) == [[2], [3]]
    assert picked.scores.scores.tolist() == [2.0, 3.0] and picked.scores.failed == 1
    both = ScoredBatch.concat([picked, scored.select_groups([0])])
    assert both.generated.group_ids.tolist() == [0, 0, 1, 1]
    assert plain(both.generated.prompts) == [[2], [3], [0], [1]]
    assert both.scores.scores.tolist() == [2.0, 3.0, 0.0, 1.0] and both.scores.failed == 2


def test_the_environments_turn_rewards_reach_the_advantages(closing):
    # REINFORCE-style return-to-go over a multi-turn response: an env reward 0.5 on the
    # first turn's last token adds to the return of the tokens up to it
    m = mesh("algorithm.adv_estimator=reinforce_plus_plus", "algorithm.whiten_advantages=false")
    closing(m.step)
    batch = dataclasses.replace(
        generated_batch(m.step),
        turn_rewards=Ragged.from_lists([[0.0], [0.5, 0.0], [0.0], [0.0, 0.0]], dtype=torch.float32),
    )
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    scored = ScoredBatch(batch, Scores(scores=scores, reward_scores=scores))
    out = m.step.advantages(scored, _inferred(ref=False, values=False), None, PhaseTimer())
    assert plain(out.returns) == [[1.0], [0.5, 0.0], [1.0], [0.0, 0.0]]


# --- what the step is built with ----------------------------------------------------------------
def test_requests_carry_the_configured_prompts_each(closing):
    m = mesh("actor_rollout_ref.rollout.prompts_per_request=1")
    closing(m.step)
    m.step.generate(records(), 3)
    assert [c["prompts"] for c in m.calls.of("rollout", "generate")] == [[[11, 12]], [[13]]]


def test_the_kv_cache_hand_over_asks_the_pools_live_replicas():
    from meshrl.config.placement import hands_gpu_memory_over

    cfg = build_config({}, BASE_OVERRIDES)
    calls = Calls()
    roles = Roles(rollouts=[Replica(calls)], actor=Trainer(calls, "actor"), reward=Reward(calls))
    step = PPOStep(cfg, roles, Tokenizer(), None, KLController())
    try:
        assert step.memory.rollouts is step.rollout_pool
        assert step.memory.enabled == hands_gpu_memory_over(cfg)
    finally:
        step.close()


def test_a_multi_turn_rollout_generates_with_the_pool_and_the_environment(closing, monkeypatch):
    made = []

    class MultiTurn:
        def generate(self, recs, sampling_params):
            made.append((recs, sampling_params))
            return "the batch"

    def multi_turn_rollout(cfg, env, generate, tokenizer):
        made.append((cfg, env, generate, tokenizer))
        return MultiTurn()

    monkeypatch.setattr(ppo_step_module, "multi_turn_rollout", multi_turn_rollout)
    m = mesh()
    closing(m.step)
    made.clear()
    m.step.roles.env = object()  # the environment server's client
    m.step = PPOStep(m.step.cfg, m.step.roles, Tokenizer(), m.syncer, m.kl_ctrl)
    closing(m.step)
    [(cfg, env, generate, tokenizer)] = made
    assert cfg is m.step.cfg.actor_rollout_ref.rollout.multi_turn
    assert env is m.step.roles.env and tokenizer is m.step.tokenizer
    assert generate == m.step.rollout_pool.generate
    recs = records()
    assert m.step.generate(recs, 3) == "the batch"
    assert made[1] == (recs, sampling(3))
    assert not m.calls.of("rollout", "generate")


def test_close_cancels_the_queued_phases_and_does_not_wait_for_the_running_ones():
    m = mesh()
    release = threading.Event()
    running = [m.step.pool.submit(release.wait, 10) for _ in range(8)]
    queued = m.step.pool.submit(lambda: None)
    m.step.close()
    assert queued.cancelled() and not any(f.done() for f in running)
    release.set()


# --- the reward phase's judgements ----------------------------------------------------------------
def test_a_batch_without_ground_truths_stops_the_run(closing):
    from services.coordinator.step.scoring import NoGroundTruth

    m = mesh()
    closing(m.step)
    recs = records()
    for r in recs:
        r.ground_truth = " "
    with pytest.raises(NoGroundTruth) as caught:
        m.step.score(m.step.generate(recs, 1))
    assert str(caught.value) == (
        "reward: every one of the 4 samples of this batch has an empty ground truth, so the "
        "rule scorers would score each 0; the run stops here rather than train on zeros "
        "(data.unscorable_rows refuses or leaves out such rows at the start)"
    )
    assert not m.calls.of("reward", "score")


def test_a_batch_the_reward_service_scored_none_of_stops_the_run(closing, caplog):
    from services.coordinator.step.scoring import RewardFailedEverySample

    m = mesh(fail_rows=(0, 1, 2, 3))
    closing(m.step)
    with pytest.raises(RewardFailedEverySample) as caught:
        m.step.score(generated_batch(m.step))
    assert str(caught.value) == (
        "reward: 4 of 4 samples could not be scored and count as 0 (first: a 'ds0' sample: "
        "boom). No sample of this batch has a reward, so the run stops here rather than train "
        "on zeros: fix the reward function (reward.custom_function) or the reward service, "
        "then resume"
    )
    some = mesh(fail_rows=(3,))
    closing(some.step)
    with caplog.at_level("WARNING", logger=ppo_step_module.log.name):
        some.step.score(generated_batch(some.step))
    assert caplog.messages == [
        "reward: 1 of 4 samples could not be scored and count as 0 (first: a 'ds1' sample: boom)"
    ]


# --- the run's side of a source: prompts, recovery, close ----------------------------------
class _Loader:
    def __init__(self):
        self.drawn = 0

    def next_batch(self):
        self.drawn += 1
        return 7, [f"loader{self.drawn}"]


class _Recorder:
    """Every call made on it, by name and arguments; ``held()`` a context that records too."""

    def __init__(self, **answers):
        self.calls: list[tuple] = []
        self.answers = answers

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, *args))
            return self.answers.get(name)

        return call

    def held(self):
        recorder = self

        class Held:
            def __enter__(self):
                recorder.calls.append(("held",))

            def __exit__(self, *exc):
                recorder.calls.append(("released",))

        return Held()


def test_the_synchronous_source_draws_from_the_loader_and_holds_nothing():
    source, loader = SynchronousBatches(build_config({}).algorithm.filter_groups, 4), _Loader()
    assert source.prompts(3, loader) == (7, ["loader1"]) and loader.drawn == 1
    with source.held():
        pass
    source.before_recovery()
    source.after_recovery(synced=2)
    source.close()  # nothing runs in the background: nothing to end or retry


def test_one_step_off_takes_the_prompts_drawn_ahead_and_drops_its_batch_before_a_recovery():
    ahead = _Recorder(prompts_for=(2, ["ahead"]))
    source, loader = OneStepOffBatches(ahead, lambda: None), _Loader()  # type: ignore[arg-type]
    assert source.prompts(5, loader) == (2, ["ahead"]) and loader.drawn == 0
    ahead.answers["prompts_for"] = None  # none drawn for that step: the loader's next
    assert source.prompts(6, loader) == (7, ["loader1"])
    source.before_recovery()
    source.after_recovery(synced=6)
    source.close()
    assert ahead.calls == [("prompts_for", 5), ("prompts_for", 6), ("drop",), ("close",)]


def test_fully_async_starts_its_producer_holds_it_and_retries_after_a_recovery():
    producer, started = _Recorder(), []
    source = FullyAsyncBatches(producer, False, lambda: started.append(True))  # type: ignore[arg-type]
    loader = _Loader()
    assert source.prompts(4, loader) == (0, []) and started == [True] and loader.drawn == 0
    with source.held():
        producer.calls.append(("inside",))
    source.after_recovery()  # a failed step: its batch is made again
    source.after_recovery(synced=4)  # a failed sync the recovery completed: version 4 served
    source.close()
    assert producer.calls == [
        ("held",), ("inside",), ("released",),
        ("retry",), ("retry",), ("weights_synced", 4), ("close",),
    ]  # fmt: skip
