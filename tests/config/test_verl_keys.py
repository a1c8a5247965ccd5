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


@pytest.mark.parametrize("key", sorted(VERL_KEYS))
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
