"""Fixtures of the coordinator-service tests: a tiny model and a small arithmetic data set."""

from __future__ import annotations

import pytest

from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl_app.demo.arithmetic import write_arithmetic_parquet


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("model") / "tiny", seed=0, hidden=32, intermediate=64
    )


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory):
    return write_arithmetic_parquet(tmp_path_factory.mktemp("data"), n_train=64, n_val=8)
