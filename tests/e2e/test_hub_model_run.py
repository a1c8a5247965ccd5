"""`meshrl run` with a Hugging Face hub id as the model, offline (HF_HUB_OFFLINE=1) from a
hub cache filled by hand (HF_HUB_CACHE): the id is made the snapshot's folder once, before
any role server starts, and every server loads that folder. Before, refused: "models are
never downloaded"."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from meshrl.testing.hub_cache import put_in_hub_cache
from meshrl.testing.tiny_model import make_tiny_model_dir

pytestmark = pytest.mark.slow


def test_a_run_from_a_hub_id_offline_loads_the_cached_snapshot(tmp_path, arithmetic_data):
    cache = tmp_path / "hub"
    snapshot = put_in_hub_cache(
        cache, "tiny-org/tiny-llama", make_tiny_model_dir(tmp_path / "m", hidden=32)
    )
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "meshrl_app.cli", "run",
        f"data.train_files={arithmetic_data['train']}",
        "actor_rollout_ref.model.path=tiny-org/tiny-llama",
        "critic.model.path=tiny-org/tiny-llama",
        "data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
        "trainer.total_training_steps=1", "trainer.logger=[console]", "trainer.plot=false",
        f"trainer.default_local_dir={run_dir}",
    ]  # fmt: skip
    ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (
        f"actor_rollout_ref.model.path=tiny-org/tiny-llama: the Hugging Face hub model, at "
        f"{snapshot}" in ran.stderr
    )
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["actor_rollout_ref"]["model"]["path"] == str(snapshot)  # what servers got
    assert resolved["critic"]["model"]["path"] == str(snapshot)

    # An id the cache lacks: one line naming it and HF_HUB_OFFLINE, before anything starts
    missing = [*cmd[:5], "actor_rollout_ref.model.path=tiny-org/absent", *cmd[6:]]
    refused = subprocess.run(missing, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1].startswith(
        "meshrl: actor_rollout_ref.model.path=tiny-org/absent: not a folder on this machine, "
        "and the Hugging Face hub model tiny-org/absent is not in the hub cache"
    )
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in refused.stderr
    assert "Traceback" not in refused.stderr
