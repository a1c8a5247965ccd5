"""Placing role servers on GPUs with ``launcher.role_gpus`` (local launcher).

The machines here have no GPU, so the check is on what the launcher hands each server: a
real server process is started and reports the CUDA_VISIBLE_DEVICES it was given.
"""

from __future__ import annotations

import sys

import pytest

from meshrl.config import ConfigError, build_config
from meshrl.launcher.local import LocalLauncher
from services.coordinator.generation.weight_sync import resolve_transport

SPLIT = [
    "trainer.device=cuda",
    "actor_rollout_ref.actor.use_kl_loss=true",  # so that the run has a ref server
    "launcher.role_gpus={rollout: 1, actor: '0', critic: '0', ref: '0'}",
]


def test_split_placement_sets_each_servers_gpus(tmp_path):
    cfg = build_config({}, SPLIT)
    procs = {p.name: p for p in LocalLauncher(cfg, tmp_path).plan()}
    assert procs["rollout0"].gpus == "1"  # YAML's int 1 read as the text CUDA wants
    assert procs["actor"].gpus == procs["critic"].gpus == procs["ref"].gpus == "0"
    assert procs["reward"].gpus is None  # unnamed: sees every GPU (none needed)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_spawned_server_sees_only_its_gpus(tmp_path, start_method):
    cfg = build_config({}, [*SPLIT, f"launcher.start_method={start_method}"])
    launcher = LocalLauncher(cfg, tmp_path)
    proc = next(p for p in launcher.plan() if p.name == "rollout0")
    # The same spawn path as a role server, running a command that prints its view.
    proc.command = [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"]
    launcher.log_dir.mkdir(parents=True)
    launcher._spawn(proc)
    assert proc.popen.wait(timeout=60) == 0
    assert proc.log_path.read_text().strip() == "1"


@pytest.mark.parametrize(
    ("overrides", "transport"),
    [
        ([], "gloo"),
        (["trainer.device=cuda"], "cuda_ipc"),
        (SPLIT, "nccl"),
        (["trainer.device=cuda", "launcher.role_gpus={rollout: '0', actor: '0'}"], "cuda_ipc"),
        ([*SPLIT, "actor_rollout_ref.rollout.weight_sync.transport=gloo"], "gloo"),
    ],
)
def test_auto_transport_follows_placement(overrides, transport):
    assert resolve_transport(build_config({}, overrides)) == transport


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("launcher.role_gpus={trainer: '0'}", "launcher.role_gpus.trainer"),
        ("launcher.role_gpus={rollout: 'gpu1'}", "launcher.role_gpus.rollout"),
    ],
)
def test_bad_placement_is_named(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        build_config({}, [override])


@pytest.mark.parametrize(
    ("overrides", "shares"),
    [
        ([], False),  # CPU: nothing to free
        (["trainer.device=cuda"], True),  # nobody placed: one GPU for all
        (SPLIT, False),
        (
            ["trainer.device=cuda", "launcher.role_gpus={rollout: '1', critic: '1', actor: '0'}"],
            True,
        ),
    ],
)
def test_rollout_frees_its_cache_only_on_a_shared_gpu(overrides, shares):
    from meshrl.config.placement import rollout_shares_gpu
    from services.coordinator.generation.rollout_memory import RolloutMemory

    cfg = build_config({}, overrides)
    assert rollout_shares_gpu(cfg) is shares
    assert RolloutMemory.for_run(cfg, []).enabled is shares
