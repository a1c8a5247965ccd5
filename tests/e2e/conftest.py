"""Fixtures for tests that run the mesh: a tiny model folder, a small arithmetic set, and a
set of role servers that runs can take turns on."""

from __future__ import annotations

import warnings

import pytest

from meshrl.config import build_config
from meshrl.launcher.local import LocalLauncher
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl_app.demo.arithmetic import write_arithmetic_parquet
from tests.e2e.shared_mesh import launcher_section, revive


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("model") / "tiny", seed=0, hidden=32, intermediate=64
    )


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory):
    return write_arithmetic_parquet(tmp_path_factory.mktemp("data"), n_train=64, n_val=8)


_SHARED: list[tuple[LocalLauncher, dict]] = []
"""The shared mesh once started: (its launcher, the section handed to the tests)."""


@pytest.fixture(scope="session")
def shared_launcher(tiny_model, tmp_path_factory):
    """Role servers for every role a run may need (a critic and a reference too), started
    once, and the `launcher` config section that points a run at them."""
    cfg = build_config(
        {},
        [
            f"actor_rollout_ref.model.path={tiny_model}",
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=true",
        ],
    )
    with LocalLauncher(cfg, tmp_path_factory.mktemp("shared_mesh")) as launcher:
        launcher.start()
        _SHARED.append((launcher, launcher_section(launcher)))
        yield _SHARED[-1]
        _SHARED.clear()


@pytest.fixture(scope="session")
def shared_mesh(shared_launcher):
    """The `launcher` section (`launcher.kind: external`) of the shared role servers. Each
    run initializes them again with its own config, as runs started against `docker
    compose up`'s servers do. For runs that end well only: a test that kills or breaks a
    server starts its own (should one die anyway, :func:`_revive_shared_mesh` starts it
    again before the next test, so one failure does not fail every later run)."""
    return shared_launcher[1]


@pytest.fixture(autouse=True)
def _revive_shared_mesh(request):
    """Before each test: the shared mesh's dead servers started again. After it: a warning
    that names the test that left one dead."""
    for launcher, section in _SHARED:
        revive(launcher, section)
    yield
    for launcher, _ in _SHARED:
        if dead := launcher.dead_roles():
            warnings.warn(
                f"{request.node.nodeid} left shared role servers dead: {', '.join(dead)}",
                stacklevel=1,
            )
