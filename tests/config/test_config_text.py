"""A config's YAML text: its errors name where it came from, locally and when submitted to
a coordinator service."""

from __future__ import annotations

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.config.loader import config_tree
from meshrl_app.remote import submit
from services.coordinator.run.run_manager import parse_run_config


def test_a_mapping_is_read_and_empty_text_is_an_empty_config():
    assert config_tree("trainer:\n  total_training_steps: 3\n", "x") == {
        "trainer": {"total_training_steps": 3}
    }
    assert config_tree("", "x") == {} and config_tree("# only a comment\n", "x") == {}


def test_bad_yaml_and_a_list_at_the_top_name_the_source():
    with pytest.raises(ConfigError, match=r"^config file run.yaml is not valid YAML: "):
        config_tree("trainer: [1, 2\n", "config file run.yaml")
    with pytest.raises(ConfigError, match=r"^the submitted config must hold a mapping"):
        parse_run_config("- a\n- b\n", [])


def test_a_config_submitted_to_a_coordinator_with_bad_yaml_names_the_file(tmp_path):
    """Before, the coordinator parsed it and said `config is not valid YAML: ... in
    "<unicode string>"`; a local run names the file. Now both do, before any connection
    (no coordinator listens at this address)."""
    bad = tmp_path / "inv.yaml"
    bad.write_text("trainer:\n  total_training_steps: [3\n")
    with pytest.raises(ConfigError) as local:
        load_config(bad)
    with pytest.raises(ConfigError) as submitted:
        submit("127.0.0.1:1", str(bad), [])
    assert str(submitted.value) == str(local.value)
    assert str(local.value).startswith(f"config file {bad} is not valid YAML: ")


def test_yaml_marks_name_the_source_not_a_unicode_string():
    with pytest.raises(ConfigError) as bad:
        config_tree("trainer:\n  total_training_steps: [3\n", "config file run.yaml")
    assert '"<unicode string>"' not in str(bad.value)
    assert 'in "config file run.yaml", line 2' in str(bad.value)


def test_a_key_given_twice_is_refused_naming_both_lines():
    """Plain YAML keeps the last: a batch size edited lower down silently undid the one
    above (and the error that followed named the wrong value)."""
    text = "data:\n  train_batch_size: 8\n  max_prompt_length: 16\n  train_batch_size: 9\n"
    with pytest.raises(ConfigError) as twice:
        config_tree(text, "config file run.yaml")
    assert str(twice.value).startswith(
        "config file run.yaml is not valid YAML: key 'train_batch_size' is given twice "
        "(lines 2 and 4)"
    )
    # the same key in two sections is two keys; an anchor merged in is no repetition
    assert config_tree("a: {x: 1}\nb: {x: 2}\n", "x") == {"a": {"x": 1}, "b": {"x": 2}}
    assert config_tree("a: &d {x: 1}\nb: {<<: *d, y: 2}\n", "x")["b"] == {"x": 1, "y": 2}


def test_keys_given_twice_on_one_line_or_in_an_override_are_refused_too():
    with pytest.raises(ConfigError, match=r"key 'x' is given twice \(line 1\)"):
        config_tree("a: {x: 1, x: 2}\n", "x")
    from meshrl.config import build_config

    with pytest.raises(ConfigError, match=r"optim: cannot parse value .* 'lr' is given twice"):
        build_config({}, ["actor_rollout_ref.actor.optim={lr: 1, lr: 2}"])


def test_an_anchor_merged_in_deeper_than_where_it_is_used_is_no_repetition():
    """The first check ran as mappings were built, after YAML had merged `<<: *anchor`
    keys into the anchored mapping in place: a key over a merged one read as given twice."""
    text = (
        "actor_rollout_ref:\n  actor:\n    optim: &actor_optim\n"
        "      <<: {lr: 1.0e-6, weight_decay: 0.0}\n      lr: 5.0e-7\n"
        "critic:\n  optim:\n    <<: *actor_optim\n    lr: 1.0e-5\n"
    )
    tree = config_tree(text, "x")
    assert tree["actor_rollout_ref"]["actor"]["optim"] == {"lr": 5.0e-7, "weight_decay": 0.0}
    assert tree["critic"]["optim"] == {"lr": 1.0e-5, "weight_decay": 0.0}
