"""Bad input a run meets at its start or in its steps, reported by the coordinator with the
key or the cause named: a missing model path, a folder without a tokenizer, a data_source no
scorer knows, samples the reward service could not score."""

from __future__ import annotations

import logging
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from meshrl.config import ConfigError, build_config
from meshrl.data.dataset import PromptDataset
from meshrl.data.errors import DataError
from meshrl.ragged import Ragged
from meshrl.testing.char_tokenizer import build_char_tokenizer, save_char_tokenizer
from services.coordinator.generation.generated import GeneratedBatch
from services.coordinator.roles.roles import Roles
from services.coordinator.run.preflight import check_data_sources, load_tokenizer
from services.coordinator.run.run import Endpoints, PPORun
from services.coordinator.step.ppo_step import PPOStep
from services.coordinator.step.scoring import RewardFailedEverySample, reward_failure_summary
from services.coordinator.step.stages import Scores
from services.reward.scorers.registry import known_data_sources
from services.reward.types import ScoreOutcome

pytestmark = pytest.mark.timeout(60)

NOWHERE = Endpoints(rollout=["127.0.0.1:9"], actor="127.0.0.1:9", reward="127.0.0.1:9")


def test_missing_model_path_fails_the_run_at_setup(tmp_path):
    cfg = build_config(
        {},
        [
            f"actor_rollout_ref.model.path={tmp_path / 'no-model'}",
            "trainer.logger=[]",
            "trainer.plot=false",
        ],
    )
    run = PPORun(cfg, NOWHERE, tmp_path / "run")  # channels open lazily: nothing is called
    try:
        with pytest.raises(ConfigError) as e:
            run.setup()
    finally:
        run.close()
    assert str(e.value) == (
        f"actor_rollout_ref.model.path={str(tmp_path / 'no-model')!r} is not a folder on this "
        "machine (the coordinator loads the tokenizer from it; a Hugging Face hub id, "
        "org/name, would be downloaded)"
    )


def test_empty_model_path_and_folder_without_tokenizer(tmp_path):
    cfg = build_config({})
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.model.path is empty: set it to a "):
        load_tokenizer(cfg.actor_rollout_ref.model)
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = build_config({}, [f"actor_rollout_ref.model.tokenizer_path={empty}"])
    with pytest.raises(
        ConfigError, match=r"tokenizer_path='.*empty': no tokenizer could be loaded"
    ):
        load_tokenizer(cfg.actor_rollout_ref.model)
    save_char_tokenizer(tmp_path / "tok")
    cfg = build_config({}, [f"actor_rollout_ref.model.tokenizer_path={tmp_path / 'tok'}"])
    assert load_tokenizer(cfg.actor_rollout_ref.model).pad_token == "<pad>"


def _rows(sources):
    return [
        {
            "data_source": s,
            "prompt": [{"role": "user", "content": "Q: 1+2="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "3"},
            "extra_info": {"index": i},
        }
        for i, s in enumerate(sources)
    ]


def test_unknown_data_source_fails_at_start_naming_it(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(["openai/gsm8k", "my/own", "my/own"])), path)
    ds = PromptDataset([str(path)], build_char_tokenizer())
    sources = {"data.train_files": [r.data_source for r in ds.records]}
    with pytest.raises(DataError) as e:
        check_data_sources(sources, known_data_sources())
    assert str(e.value) == (
        "data.train_files: data_source 'my/own' (2 rows) has no reward scorer; the reward server "
        f"scores {', '.join(known_data_sources())}. Set reward.custom_function to score it "
        "yourself, or enable reward.reward_model"
    )
    check_data_sources(sources, [*known_data_sources(), "*"])  # a custom function scores all


class _FailingReward:
    def __init__(self, all_fail: bool = False):
        self.all_fail = all_fail

    def score(self, items):
        first = ScoreOutcome(1.0, True, "", {"acc": 1.0})
        if self.all_fail:
            first = ScoreOutcome(0.0, False, "TypeError: compute_score() takes 2 arguments", {})
        return [
            first,
            ScoreOutcome(0.0, False, "timeout after 10.0s", {}),
            ScoreOutcome(0.0, False, "returned str, expected a number", {}),
        ]


def _three_sample_batch() -> GeneratedBatch:
    rows = Ragged.from_lists([[5, 6], [7], [8, 9]])
    return GeneratedBatch(
        prompts=rows,
        responses=rows,
        rollout_logprobs=rows.with_values(torch.zeros(5)),
        finish_reasons=["stop"] * 3,
        group_ids=torch.arange(3),
        data_sources=["openai/gsm8k", "math", "my/custom"],
        ground_truths=["1", "2", "3"],
        extra_infos=[{}, {}, {}],
        weight_version=0,
    )


def _score(batch: GeneratedBatch, reward: _FailingReward) -> Scores:
    step = PPOStep(
        build_config({}),
        Roles(rollouts=[], actor=None, reward=reward),
        build_char_tokenizer(),
        syncer=None,
        kl_ctrl=None,
    )
    try:
        return step.score(batch)
    finally:
        step.close()


def test_samples_that_could_not_be_scored_are_reported(caplog):
    batch = _three_sample_batch()
    with caplog.at_level(logging.WARNING):
        scores = _score(batch, _FailingReward())
    assert scores.failed == 2 and scores.scores.tolist() == [1.0, 0.0, 0.0]
    assert (
        "reward: 2 of 3 samples could not be scored and count as 0 "
        "(first: a 'math' sample: timeout after 10.0s)"
    ) in caplog.text
    assert reward_failure_summary([ScoreOutcome(1.0, True, "", {})], ["x"]) is None


def test_a_batch_with_no_sample_scored_stops_the_run():
    """Before, such a run trained every step on rewards that were all 0 and exited 0."""
    with pytest.raises(RewardFailedEverySample) as e:
        _score(_three_sample_batch(), _FailingReward(all_fail=True))
    assert str(e.value).startswith(
        "reward: 3 of 3 samples could not be scored and count as 0 (first: a 'openai/gsm8k' "
        "sample: TypeError: compute_score() takes 2 arguments). No sample of this batch has a "
        "reward, so the run stops here"
    )


def test_lengths_past_the_models_context_are_warned_about(tmp_path):
    """Before, a run with 306-token prompts on a 256-position model ran without a word."""
    from services.coordinator.run.preflight import context_length_warning

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 256}')
    model = [f"actor_rollout_ref.model.path={tmp_path}"]
    long = build_config({}, [*model, "data.max_prompt_length=400", "data.max_response_length=8"])
    assert context_length_warning(long) == (
        "data.max_prompt_length + data.max_response_length = 408 tokens, past the model's "
        f"max_position_embeddings (256, {tmp_path / 'config.json'}): the tokens past it run "
        "outside the positions the model was trained on"
    )
    fits = build_config({}, [*model, "data.max_prompt_length=200", "data.max_response_length=56"])
    assert context_length_warning(fits) is None
    elsewhere = build_config({}, ["actor_rollout_ref.model.path=/on/another/machine"])
    assert context_length_warning(elsewhere) is None  # not readable here: not checked
    (tmp_path / "config.json").write_text("[1, 2]")  # JSON, but no model config
    assert context_length_warning(long) is None


def test_a_machine_with_gpus_left_unused_by_the_default_device_is_warned_about():
    """trainer.device defaults to cpu here (verl's default is cuda): before, a run on a GPU
    machine trained on the CPU without a word."""
    from services.coordinator.run.preflight import unused_gpu_warning

    default = build_config({})
    assert unused_gpu_warning(default, 2) == (
        "trainer.device=cpu (the default here; verl's is cuda), but this machine has 2 CUDA "
        "GPU(s): the rollout and trainer roles run on the CPU; set trainer.device=cuda to use "
        "them"
    )
    assert unused_gpu_warning(default, 0) is None
    assert unused_gpu_warning(build_config({}, ["trainer.device=cuda"]), 2) is None


def _unknown_source_run(tmp_path, *overrides):
    from meshrl.testing.tiny_model import make_tiny_model_dir

    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(["openai/gsm8k", "my/own", "my/own"])), data)
    return [
        f"actor_rollout_ref.model.path={make_tiny_model_dir(tmp_path / 'model')}",
        f"data.train_files=[{data}]",
        "data.train_batch_size=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.logger=[]",
        *overrides,
    ]


UNKNOWN_MY_OWN = (
    "data.train_files: data_source 'my/own' (2 rows) has no reward scorer; the reward server "
    f"scores {', '.join(known_data_sources())}. Set reward.custom_function to score it "
    "yourself, or enable reward.reward_model"
)


def test_an_unknown_data_source_is_refused_by_meshrl_run_before_any_server_starts(tmp_path):
    """Before, found once every role server had started and the reward server listed its
    scorers (21 s into a run on a loaded machine)."""
    import subprocess
    import sys

    config = tmp_path / "run.yaml"
    config.write_text("{}\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshrl_app.cli",
            "run",
            str(config),
            *_unknown_source_run(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == f"meshrl: {UNKNOWN_MY_OWN}"
    assert "Traceback" not in out.stderr
    assert "starting role servers" not in out.stderr, "no role server was started"
    assert not (tmp_path / "run" / "logs").exists()


def test_a_coordinator_service_rejects_an_unknown_data_source_before_its_servers_start(tmp_path):
    from services.coordinator.run.run_manager import ManagedRun
    from services.coordinator.types import RunState

    class Launcher:
        started = False

        def start(self):
            Launcher.started = True

        def stop(self):
            pass

    cfg = build_config({}, _unknown_source_run(tmp_path))
    run = ManagedRun("r1", cfg, tmp_path / "run", Launcher(), make_ppo=None)
    run._main()  # the run's thread, here
    assert run.status.state == RunState.REJECTED
    assert run.status.message.endswith(UNKNOWN_MY_OWN)
    assert not Launcher.started, "no role server started for it"


@pytest.mark.parametrize(
    ("overrides", "known"),
    [
        ([], known_data_sources()),
        (["reward.custom_function=my.py:fn"], ["*"]),
        # a reward model scores rows the rules do not: the reward server says which, at set-up
        (["reward.reward_model.enable=true", "reward.reward_model.path=org/rm"], None),
    ],
)
def test_the_scorers_a_run_will_have_are_known_before_its_servers_start_unless_a_model(
    overrides, known
):
    from services.coordinator.run.preflight import scorers_known_here

    assert scorers_known_here(build_config({}, overrides)) == known


def _gsm8k_without_truths(tmp_path, truthless: dict[int, dict | None], n: int = 4):
    """A GSM8k training file of n rows, rows of `truthless` with that reward_model."""
    rows = _rows(["openai/gsm8k"] * n)
    for i, reward_model in truthless.items():
        rows[i]["reward_model"] = reward_model
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    save_char_tokenizer(tmp_path / "tok")
    return path, [
        f"data.train_files={path}", f"actor_rollout_ref.model.path={tmp_path / 'tok'}",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "critic.ppo_mini_batch_size=2", f"trainer.default_local_dir={tmp_path / 'run'}",
    ]  # fmt: skip


def test_rows_the_rule_scorer_cannot_score_are_refused_before_any_server(tmp_path):
    """Before, GSM8k rows whose reward_model was null trained to the end at reward 0, exit 0,
    without a word: every ground truth was ""."""
    from services.coordinator.run.run_data import load_run_data

    path, overrides = _gsm8k_without_truths(tmp_path, {1: None, 3: None})
    with pytest.raises(DataError) as e:
        load_run_data(build_config({}, overrides))
    assert str(e.value) == (
        f"data.train_files: {path} row 1: column reward_model is null (and 1 more rows like "
        "it): the rule scorer of 'openai/gsm8k' has no ground truth to compare responses with, "
        "so each would score 0. Fix the rows, set reward.custom_function to score them, or "
        "data.unscorable_rows=skip to leave them out"
    )
    path, overrides = _gsm8k_without_truths(tmp_path, {0: {"style": "rule", "answer": "3"}})
    with pytest.raises(DataError, match=r"row 0: reward_model.ground_truth is missing \(null\)"):
        load_run_data(build_config({}, overrides))
    # a custom function may need no ground truth: not refused
    fn = tmp_path / "r.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                  "    return 1.0\n")  # fmt: skip
    load_run_data(build_config({}, [*overrides, f"reward.custom_function={fn}"]))


def test_unscorable_rows_can_be_skipped_and_are_counted(tmp_path, caplog):
    from services.coordinator.run.run_data import load_run_data

    path, overrides = _gsm8k_without_truths(tmp_path, {1: None, 2: None}, n=6)
    with caplog.at_level(logging.WARNING):
        data = load_run_data(build_config({}, [*overrides, "data.unscorable_rows=skip"]))
    assert data.train_set is not None and len(data.train_set) == 4
    assert all(r.ground_truth == "3" for r in data.train_set.records)
    assert (
        f"data.train_files: 2 rows left out (data.unscorable_rows=skip): no ground truth to "
        f"score them with; the first: {path} row 1: column reward_model is null"
    ) in caplog.text
    path, overrides = _gsm8k_without_truths(tmp_path, {i: None for i in range(4)})
    with pytest.raises(DataError, match="none of its 4 rows has a ground truth"):
        load_run_data(build_config({}, [*overrides, "data.unscorable_rows=skip"]))


def test_a_step_whose_every_ground_truth_is_empty_stops_the_run():
    """The step's own check, behind the start's: a zero of every sample is no reward."""
    from services.coordinator.step.scoring import NoGroundTruth

    batch = replace(_three_sample_batch(), ground_truths=["", " ", ""])
    with pytest.raises(NoGroundTruth, match="every one of the 3 samples of this batch has an "):
        _score(batch, _FailingReward())


def test_a_custom_function_that_cannot_load_is_refused_before_any_server(tmp_path):
    """Read, not run, by the run's checks before any role server starts (meshrl run and a
    coordinator service call check_run_config first); before, a missing file or a syntax
    error was found at the reward server's Initialize, after every server had started."""
    from services.coordinator.run.preflight import check_run_config

    def refused(spec: str) -> str:
        with pytest.raises(ConfigError) as e:
            check_run_config(build_config({}, [f"reward.custom_function={spec}"]))
        return str(e.value)

    assert refused(str(tmp_path / "nope.py")) == (
        f"reward.custom_function: file {tmp_path / 'nope.py'} does not exist"
    )
    bad = tmp_path / "bad.py"
    bad.write_text("def compute_score(a, b, c, d):\n    return (1\n")
    assert refused(str(bad)).startswith(f"reward.custom_function: {bad} line 2: ")
    assert refused(str(bad)).endswith("(the file is not valid Python)")
    good = tmp_path / "good.py"
    good.write_text(
        "import math\nSCALE = 2\n\ndef compute_score(a, b, c, d):\n    return 1.0\n"
        "def other(a, b, c, d):\n    return 0.0\n"
    )
    assert refused(f"{good}:nope") == (
        f"reward.custom_function: {good} defines no 'nope' at its top level; names there: "
        f"SCALE, compute_score, math, other (name one as {good}:<function>)"
    )
    check_run_config(build_config({}, [f"reward.custom_function={good}"]))
    check_run_config(build_config({}, [f"reward.custom_function={good}:other"]))
    # a name bound in a way reading cannot tell is left to the reward server's Initialize
    star = tmp_path / "star.py"
    star.write_text("from math import *\n")
    check_run_config(build_config({}, [f"reward.custom_function={star}:anything"]))


def test_a_launcher_host_not_of_this_machine_is_refused_before_any_server():
    """Before: an OSError traceback (Cannot assign requested address) from the port search."""
    from services.coordinator.run.preflight import check_run_config

    with pytest.raises(ConfigError) as e:
        check_run_config(build_config({}, ["launcher.host=192.0.2.1"]))
    assert str(e.value) == (
        "launcher.host=192.0.2.1: the local launcher's role servers cannot listen there: "
        "address 192.0.2.1 is not an address of this machine"
    )
    check_run_config(build_config({}, ["launcher.host=127.0.0.1"]))


def test_a_weights_file_that_does_not_parse_is_named(tmp_path):
    """Before, each server's Initialize failed with `SafetensorError: Error while
    deserializing header: header too large`, naming no file; now the run is refused before
    any server starts, naming the key and the file, and a server loading it names it too."""
    from meshrl.testing.tiny_model import make_tiny_model_dir
    from services.coordinator.run.run_data import load_run_data
    from services.trainer.model_loading import load_policy_model

    model = make_tiny_model_dir(tmp_path / "m", seed=0, hidden=32, intermediate=64)
    weights = model / "model.safetensors"
    weights.write_text("<html>a download that saved an error page</html>")
    path, overrides = _gsm8k_without_truths(tmp_path, {})
    overrides = [*overrides, f"actor_rollout_ref.model.path={model}"]
    with pytest.raises(ConfigError) as e:
        load_run_data(build_config({}, overrides))
    assert str(e.value).startswith(
        f"actor_rollout_ref.model.path: {weights} is not a readable safetensors file ("
    ), str(e.value)
    with pytest.raises(ValueError, match=f"the model's weights cannot be read: {weights} is not"):
        load_policy_model(str(model))
