"""``actor_rollout_ref.rollout.name`` picks the engine: each name reaches its builder, the CPU
gets the native engine, and a name that cannot serve here says why before loading anything."""

from __future__ import annotations

import pytest

from meshrl.config import ConfigError, build_config
from meshrl.testing.tiny_model import make_tiny_model_dir
from services.rollout import registry
from services.rollout.native.engine import NativeEngine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("m"), hidden=32, intermediate=64))


def _cfg(model, *overrides):
    return build_config({}, [f"actor_rollout_ref.model.path={model}", *overrides])


def test_every_name_of_the_schema_has_a_builder():
    from meshrl.config.sections import RolloutConfig

    names = RolloutConfig.model_fields["name"].annotation.__args__
    assert set(names) == set(registry.ENGINES)


@pytest.mark.parametrize("name", ["auto", "native"])
def test_the_cpu_gets_the_native_engine(model, name):
    engine = registry.build_engine(_cfg(model, f"actor_rollout_ref.rollout.name={name}"))
    assert type(engine) is NativeEngine
    assert engine.max_model_len == 512 + 512  # data.max_prompt_length + max_response_length


def test_fast_off_a_gpu_is_refused_naming_the_device(model):
    with pytest.raises(ValueError, match=r"rollout.name=fast needs trainer.device=cuda"):
        registry.build_engine(_cfg(model, "actor_rollout_ref.rollout.name=fast"))


def test_a_name_outside_the_registry_is_a_config_error(model):
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.name"):
        _cfg(model, "actor_rollout_ref.rollout.name=sglang")


def test_a_missing_model_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="is not a model folder"):
        registry.build_engine(_cfg(tmp_path / "nothing"))
