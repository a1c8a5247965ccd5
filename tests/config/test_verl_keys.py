"""The table of verl keys (meshrl/config/verl_keys.py) stays true to the schema: each of its
keys is unknown here (a hint never shadows a real key), and every meshrl key it points to
exists (a hint never sends a user to a key that is not there)."""

import re

import pytest
from pydantic import BaseModel

from meshrl.config import ConfigError, RunConfig, build_config
from meshrl.config.verl_keys import VERL_KEYS

TOP_SECTIONS = tuple(RunConfig.model_fields)


def schema_has(dotted: str) -> bool:
    section: type[BaseModel] = RunConfig
    *parents, name = dotted.split(".")
    for part in parents:
        field = section.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type):
            return False
        section = field.annotation
    return name in section.model_fields


def first_unknown_prefix(dotted: str) -> str:
    parts = dotted.split(".")
    for end in range(1, len(parts) + 1):
        if not schema_has(".".join(parts[:end])):
            return ".".join(parts[:end])
    raise AssertionError(f"{dotted} is a schema key")


@pytest.mark.parametrize(
    "key", sorted(k for k, e in VERL_KEYS.items() if not (e.any_value or e.moves_to))
)
def test_each_verl_key_is_refused_with_its_hint(key):
    assert not schema_has(key)
    value = 2 if 1 in VERL_KEYS[key].same_here else 1  # 1 there asks for what we do
    with pytest.raises(ConfigError) as err:
        build_config({}, [f"{key}={value}"])
    assert f"  {key}: {VERL_KEYS[key].hint()}" in str(err.value)


@pytest.mark.parametrize("key", sorted(VERL_KEYS))
def test_the_section_that_pydantic_reports_has_an_entry(key):
    # An error names the first unknown part of a key; the lines for its settings come from
    # the entries below it, so it needs an entry itself (unknown_keys.unknown_key_lines).
    assert first_unknown_prefix(key) in VERL_KEYS


@pytest.mark.parametrize("key", sorted(VERL_KEYS))
def test_every_meshrl_key_a_hint_names_exists(key):
    entry = VERL_KEYS[key]
    named = [entry.use.split("=")[0]] if entry.use else []
    # dotted names in the explanation that start with a section of ours are keys of ours
    named += [
        name
        for name in re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+", entry.why)
        if name.split(".")[0] in TOP_SECTIONS
    ]
    for name in named:
        assert schema_has(name), f"{key}'s hint names {name}, which is not a config key"


@pytest.mark.parametrize("key", sorted(k for k, entry in VERL_KEYS.items() if entry.any_value))
def test_a_knob_of_verls_machinery_is_accepted_with_any_value_and_dropped(key):
    assert not schema_has(key)
    for value in (0, 8, "x", True):
        assert build_config({}, [f"{key}={value}"]) == build_config({}, [])


def test_verls_sleep_mode_is_free_cache_engine_under_its_other_name():
    sleep, free = "actor_rollout_ref.rollout.enable_sleep_mode", "actor_rollout_ref.rollout"
    assert not build_config({}, [f"{sleep}=false"]).actor_rollout_ref.rollout.free_cache_engine
    # verl's Qwen3-0.6B example gives both, agreeing: accepted
    both = [f"+{sleep}=False", f"{free}.free_cache_engine=False"]
    assert not build_config({}, both).actor_rollout_ref.rollout.free_cache_engine
    with pytest.raises(ConfigError, match=f"{sleep}: unknown config key"):  # disagreeing
        build_config({}, [f"{sleep}=true", f"{free}.free_cache_engine=false"])


def test_verls_defaults_that_ask_for_nothing_here_are_accepted():
    accepted = [
        "trainer.default_hdfs_dir=null",  # verl's default: no HDFS copy
        "actor_rollout_ref.actor.fsdp_config.grad_offload=False",  # verl's older examples
        "critic.model.fsdp_config.grad_offload=False",
        "data.return_raw_chat=True",  # a rollout server renders the messages the same way
        "+actor_rollout_ref.model.lora.merge=True",  # rollout gets merged weights
        "actor_rollout_ref.rollout.multi_turn.enable=False",
        "actor_rollout_ref.rollout.do_sample=True",
    ]
    assert build_config({}, accepted) == build_config({}, [])


def test_verls_tool_and_interaction_configs_point_at_the_environment():
    for key in ("tool_config_path", "interaction_config_path"):
        with pytest.raises(
            ConfigError,
            match=f"multi_turn.{key}: unknown config key \\(verl's\\): set "
            "actor_rollout_ref.rollout.multi_turn.environment instead",
        ):
            build_config({}, [f"actor_rollout_ref.rollout.multi_turn.{key}=tools.yaml"])
