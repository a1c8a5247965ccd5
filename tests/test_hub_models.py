"""Hub ids as model paths, resolved from a hub cache filled by hand with HF_HUB_OFFLINE
on: nothing is downloaded. A whole run from a hub id is in tests/e2e/test_hub_model_run.py."""

from __future__ import annotations

import pytest
from huggingface_hub import constants

from meshrl.config import ConfigError, build_config
from meshrl.hub_models import is_hub_id, local_model_folder, with_local_models
from meshrl.testing.char_tokenizer import save_char_tokenizer
from meshrl.testing.hub_cache import put_in_hub_cache


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """HF_HUB_CACHE=tmp_path/hub, HF_HUB_OFFLINE=1, as huggingface_hub read them at import."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_what_reads_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("openai-community/gpt2")
    for local in ("models/mine", "/abs/no-model", "./x", "../x", "~/x", "", "a/b/c", "a b/c",
                  "gpt2", "never_read"):  # fmt: skip
        assert not is_hub_id(local), local  # a folder here, written as a path, or no repo id


def test_a_cached_hub_model_resolves_offline_to_its_snapshot_once(offline_cache, tmp_path):
    save_char_tokenizer(tmp_path / "tiny")  # a folder to cache: what is in it matters not
    snapshot = put_in_hub_cache(offline_cache, "tiny-org/tiny-llama", tmp_path / "tiny")
    cfg = build_config(
        {},
        [
            "actor_rollout_ref.model.path=tiny-org/tiny-llama",
            "critic.model.path=tiny-org/tiny-llama",
            "reward.reward_model.path=tiny-org/not-loaded",  # enable=false: not fetched
        ],
    )
    heard: list[str] = []
    local = with_local_models(cfg, say=heard.append)
    assert local.actor_rollout_ref.model.path == str(snapshot)
    assert local.critic.model.path == str(snapshot)
    assert local.reward.reward_model.path == "tiny-org/not-loaded"
    assert heard == [  # the same id fetched once
        "actor_rollout_ref.model.path=tiny-org/tiny-llama: fetching the Hugging Face hub "
        "model (or finding it in its cache)"
    ]
    assert cfg.actor_rollout_ref.model.path == "tiny-org/tiny-llama"  # the caller's as given
    assert with_local_models(local) is local  # nothing left to fetch


def test_a_hub_id_missing_from_the_cache_offline_is_one_line_naming_it(offline_cache):
    with pytest.raises(ConfigError) as refused:
        local_model_folder("actor_rollout_ref.model.path", "Qwen/Qwen2.5-0.5B-Instruct")
    assert str(refused.value) == (
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct: not a folder on this "
        "machine, and the Hugging Face hub model Qwen/Qwen2.5-0.5B-Instruct is not in the hub "
        f"cache ({offline_cache}) while HF_HUB_OFFLINE=1 forbids downloading it: download it "
        "where there is a network (hf download Qwen/Qwen2.5-0.5B-Instruct), unset "
        "HF_HUB_OFFLINE, or name a local folder"
    )
