"""Fixtures for tests that run the mesh: a tiny model folder, a small arithmetic set, and a
set of role servers that runs can take turns on."""

from __future__ import annotations

import pytest

from meshrl.config import build_config
from meshrl.demo.arithmetic import write_arithmetic_parquet
from meshrl.launcher.local import LocalLauncher
from meshrl.testing.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("model") / "tiny", seed=0, hidden=32, intermediate=64
    )


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory):
    return write_arithmetic_parquet(tmp_path_factory.mktemp("data"), n_train=64, n_val=8)


@pytest.fixture(scope="session")
def shared_mesh(tiny_model, tmp_path_factory):
    """Role servers for every role a run may need (a critic and a reference too), started
    once; the `launcher` config section that points a run at them (`launcher.kind:
    external`). Each run initializes them again with its own config, as runs started
    against `docker compose up`'s servers do. For runs that end well only: a test that
    kills or breaks a server starts its own."""
    cfg = build_config(
        {},
        [
            f"actor_rollout_ref.model.path={tiny_model}",
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=true",
        ],
    )
    with LocalLauncher(cfg, tmp_path_factory.mktemp("shared_mesh")) as launcher:
        e = launcher.start()
        addresses = dict(rollout=e.rollout, actor=[e.actor], critic=[e.critic], ref=[e.ref])
        yield {"kind": "external", "addresses": {**addresses, "reward": [e.reward]}}
