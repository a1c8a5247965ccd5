"""A whole PPO run through the mesh with mutual TLS and the shared token on every gRPC server
and client, configured only in the run config's `security` section: the launcher hands it to
the role servers, the coordinator uses it for its own clients."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshrl.config import build_config
from meshrl.rpc.security import ENV_VARS
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl_app.demo.arithmetic import write_arithmetic_parquet
from meshrl_app.run_local import run_local
from services.coordinator.metrics.sinks import read_jsonl

pytest.importorskip("cryptography")
from meshrl.testing.certs import make_certs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_ppo_run_with_mutual_tls_and_token(tmp_path, monkeypatch):
    for var in ENV_VARS.values():  # run_local sets them for itself: undone after the test
        monkeypatch.setenv(var, "")
    certs = make_certs(tmp_path / "pki")
    token = tmp_path / "pki" / "token"
    token.write_text(os.urandom(16).hex())
    model = make_tiny_model_dir(tmp_path / "model", seed=0, hidden=32, intermediate=64)
    data = write_arithmetic_parquet(tmp_path / "data", n_train=16, n_val=4)
    run_dir = tmp_path / "run"
    cfg = build_config(
        {},
        [
            f"data.train_files=[{data['train']}]",
            f"data.val_files=[{data['test']}]",
            "data.train_batch_size=8",
            "data.max_prompt_length=16",
            "data.max_response_length=8",
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.n=2",
            "algorithm.adv_estimator=grpo",
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            "trainer.save_freq=2",
            "trainer.plot=false",
            f"trainer.default_local_dir={run_dir}",
            f"security.tls_cert={certs.server_cert}",
            f"security.tls_key={certs.server_key}",
            f"security.tls_ca={certs.ca}",
            "security.require_client_cert=true",
            f"security.client_cert={certs.client_cert}",
            f"security.client_key={certs.client_key}",
            f"security.auth_token_file={token}",
        ],
    )
    run_local(cfg)
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert any(k.startswith("val-core/") for k in steps[-1])
    assert (run_dir / "checkpoints" / "global_step_2" / "MANIFEST.json").is_file()
    logs = {p.stem: p.read_text() for p in Path(run_dir / "logs").glob("*.log")}
    assert set(logs) == {"rollout0", "actor", "reward"}
    for name, text in logs.items():  # each server said how it listens
        assert "(mutual TLS, token required)" in text, name
