"""Megatron's tensor parallelism on the CPU (torchrun, gloo): an actor, reference and critic
split over 2 ranks (tp 2) against the same roles on 1 rank, on the same weights and batch
(tiny Llama with grouped-query attention, tiny Qwen2 with q/k/v biases and tied
embeddings; hidden 64, 4 heads over 2 KV heads, 2 layers): the same log-probs, entropies,
values, losses, gradient norms (clipped: the norm is the whole model's), updated weights
(gathered under Hugging Face names), and a checkpoint that resumes at tp 2 and loads at
tp 1. tp_worker.py is one rank of each run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_megatron_backend import _randomised
from tp_worker import _advantages
from trainer_helpers import REPO, make_batch, trainer_config
from transformers import AutoModelForCausalLM, LlamaConfig

from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_model_dir, make_tiny_qwen2_dir
from services.trainer.actor import ActorRole

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORKER = Path(__file__).with_name("tp_worker.py")
METRICS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac")


def _run(model_dir: Path, out: Path, nproc: int, tp: int) -> dict:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [sys.executable, *launcher, str(WORKER), str(model_dir), str(out), str(tp)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=500)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return torch.load(out, weights_only=False)


def _model_dir(kind: str, path: Path) -> Path:
    if kind == "qwen2_bias_tied":  # 4 query heads over 2 KV heads, q/k/v biases, tied
        return _randomised(make_tiny_qwen2_dir(path, hidden=64, layers=2))
    make_tiny_model_dir(path, hidden=64, layers=2, heads=4)
    config = LlamaConfig.from_pretrained(path)
    config.num_key_value_heads = 2  # grouped-query attention
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return _randomised(path)


@pytest.fixture(scope="module")
def run_of(tmp_path_factory):
    """(model kind, ranks, tp) -> (model folder, that run's results), each run once."""
    folders: dict[str, Path] = {}
    results: dict[tuple[str, int, int], dict] = {}

    def run(kind: str, nproc: int, tp: int) -> tuple[Path, dict]:
        if kind not in folders:
            folders[kind] = _model_dir(kind, tmp_path_factory.mktemp(kind) / "model")
        if (kind, nproc, tp) not in results:
            out = folders[kind].parent / f"ranks{nproc}_tp{tp}.pt"
            results[kind, nproc, tp] = _run(folders[kind], out, nproc, tp)
        return folders[kind], results[kind, nproc, tp]

    return run


@pytest.fixture(scope="module", params=["llama_gqa", "qwen2_bias_tied"])
def runs(request, run_of):
    """(model folder, the tp 1 run on 1 rank, the tp 2 run on 2 ranks)."""
    model_dir, one = run_of(request.param, 1, 1)
    _, two = run_of(request.param, 2, 2)
    return model_dir, one, two


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_tensor_parallel_scores_as_one_rank(runs):
    _, one, two = runs
    assert (one["data_ranks"], two["data_ranks"]) == (1, 1)  # tp 2: one share of the batch
    for key in ("logprobs", "entropy", "ref", "values"):
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=2e-6, msg=key)
    assert one["num_parameters"] == two["num_parameters"]  # the whole model, not a shard


def test_tensor_parallel_updates_as_one_rank(runs):
    _, one, two = runs
    for key in METRICS:
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
    # the norm is over the whole model (the shards' squares summed over the group), and
    # above actor.grad_clip=0.5: the clipping scaled both alike
    assert one["metrics"]["actor/grad_norm"] > 0.5
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert two["critic_metrics"][key] == pytest.approx(one["critic_metrics"][key], rel=1e-5)
    torch.testing.assert_close(two["after"], one["after"], rtol=0, atol=1e-5)
    torch.testing.assert_close(two["values"], one["values"], rtol=0, atol=1e-5)


def test_gathered_weights_are_the_one_rank_tensors_under_hf_names(runs):
    _, one, two = runs
    assert two["shapes"] == one["shapes"]
    assert [n for n, _ in two["shapes"]] == list(two["weights"])  # full_params' order
    assert all(tuple(two["weights"][n].shape) == s for n, s in two["shapes"])
    assert _max_diff(two["weights"], one["weights"]) < 1e-5  # after one update each
    assert _max_diff(two["next_after"], one["next_after"]) < 1e-5  # and after a second


def test_a_tensor_parallel_checkpoint_resumes_and_loads_on_one_rank(runs, world):
    model_dir, one, two = runs
    # at tp 2: the same weights, and the same next update (the moments came back)
    assert _max_diff(two["restored_weights"], two["weights"]) == 0.0
    assert two["restored_metrics"]["actor/grad_norm"] == two["next_metrics"]["actor/grad_norm"]
    assert _max_diff(two["restored_after"], two["next_after"]) == 0.0
    # the whole tensors are saved: tp 1 reads the tp 2 checkpoint, moments included
    cfg = trainer_config(model_dir, ["actor_rollout_ref.actor.strategy=megatron",
                                     "actor_rollout_ref.actor.grad_clip=0.5"])  # fmt: skip
    actor = ActorRole.build(cfg, world)
    actor.load(two["checkpoint"], with_optimizer=True)
    assert actor.update_count == 1
    assert _max_diff(dict(actor.iter_full_params()), two["weights"]) == 0.0
    batch = make_batch(8, seed=1)
    lp = Ragged(two["logprobs"], actor.compute_log_probs(batch)[0].offsets)  # the run's old ones
    again = actor.update_policy(batch, lp, _advantages(lp, 1), None, None, 2)
    for key in METRICS:
        assert again[key] == pytest.approx(two["next_metrics"][key], rel=1e-5, abs=1e-7), key
    after = {n: t.clone() for n, t in actor.iter_full_params()}
    assert _max_diff(after, two["next_after"]) < 1e-5


def test_two_tensor_parallel_groups_split_the_batch_as_one_rank(run_of):
    """4 ranks: tp 2 x dp 2. Each group scores and trains on half the batch; the gradients
    are averaged over the data-parallel ranks only (each shard with its own)."""
    _, one = run_of("qwen2_bias_tied", 1, 1)
    _, four = run_of("qwen2_bias_tied", 4, 2)
    assert four["data_ranks"] == 2
    for key in ("logprobs", "entropy", "ref", "values", "after"):
        torch.testing.assert_close(four[key], one[key], rtol=0, atol=2e-6, msg=key)
    for key in METRICS:
        assert four["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
    assert _max_diff(four["weights"], one["weights"]) < 1e-5
    assert _max_diff(four["restored_after"], four["next_after"]) == 0.0
