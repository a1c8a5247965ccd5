"""Every example config runs end to end on the demo task for a few steps, through the mesh.

The runs take turns on one set of role servers (`shared_mesh`, through the external
launcher, as runs started against `docker compose up`'s servers do): each run initializes
them again with its own config. Starting five servers costs about 40 s of CPU (each trainer server imports torch,
torch.distributed and transformers), most of an example's run on the 2-core machine. The
LoRA example starts its own, to show that it needs no reference server.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from meshrl.config import build_config
from meshrl_app.run_local import run_local
from services.coordinator.metrics.sinks import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# metric that shows the example's distinctive piece ran
EXPECTED = {
    "ppo_kl_in_reward_adaptive.yaml": ["critic/vf_loss", "actor/reward_kl_penalty_coeff"],
    "ppo_kl_loss.yaml": ["critic/vf_loss", "actor/kl_loss"],
    "grpo_n4.yaml": ["actor/kl_loss"],
    "rloo.yaml": ["actor/reward_kl_penalty"],
    "reinforce_plus_plus.yaml": ["actor/reward_kl_penalty"],
    # ReMax: the REINFORCE++ example with the greedy-rollout baseline instead
    "reinforce_plus_plus.yaml+remax": ["timing_s/gen_max"],
    "gspo.yaml": ["actor/pg_clipfrac"],
    "gmpo.yaml": ["actor/pg_clipfrac_lower"],
    "grpo_lora.yaml": ["actor/kl_loss", "training/rollout_probs_diff_max"],
    # the untrained model writes no tool call: one turn an episode, through the env server
    "gsm8k_tool.yaml": ["multi_turn/turns/mean", "multi_turn/env_errors"],
    "dapo.yaml": [
        "train/num_gen_batches",
        "train/kept_prompts_ratio",
        "reward/overlong_reward/mean",
    ],
}

# The tiny untrained model answers (almost) nothing right, so every group would be all wrong
# and dynamic sampling would find nothing to keep: DAPO's run scores by a stand-in rule whose
# groups differ for odd answers and never for even ones.
VARIED_FOR_ODD_ANSWERS = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2 == 0:
        return {"score": 1.0, "acc": 1.0}
    acc = float(len(solution_str) % 2)
    return {"score": acc, "acc": acc}
"""


OWN_SERVERS = {"grpo_lora.yaml", "gsm8k_tool.yaml"}
"""Examples run with the local launcher (their own servers, in their run folder's logs/):
LoRA's has no reference server, the tool example an env server."""


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name, tiny_model, arithmetic_data, tmp_path, request):
    file, _, variant = name.partition("+")
    tree = yaml.safe_load((EXAMPLES / file).read_text())
    if variant:
        tree["algorithm"]["adv_estimator"] = variant
    if file not in OWN_SERVERS:
        tree["launcher"] = request.getfixturevalue("shared_mesh")
    extra = []
    if file == "dapo.yaml":
        reward = tmp_path / "varied.py"
        reward.write_text(VARIED_FOR_ODD_ANSWERS)
        extra = [
            f"reward.custom_function={reward}",
            "algorithm.filter_groups.max_num_gen_batches=20",
            "data.gen_batch_size=12",
        ]
    if file == "grpo_lora.yaml":
        # The untrained model scores 0 everywhere: zero advantages. An entropy bonus makes
        # every update move the adapters, so that step 2 samples with changed weights.
        extra = ["actor_rollout_ref.actor.entropy_coeff=0.05"]
    cfg = build_config(
        tree,
        [
            f"data.train_files=[{arithmetic_data['train']}]",
            "data.train_batch_size=8",
            "data.max_response_length=10",
            f"actor_rollout_ref.model.path={tiny_model}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "critic.ppo_mini_batch_size=4",
            "trainer.total_training_steps=2",
            "trainer.test_freq=-1",
            "trainer.plot=false",
            f"trainer.default_local_dir={tmp_path}",
            *extra,
        ],
    )
    run_local(cfg)
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "critic/score/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ["actor/pg_loss", "critic/advantages/mean", *EXPECTED[name]]:
        assert key in rows[-1], f"{name}: {key} missing"
    assert rows[-1]["perf/total_num_tokens"] > 0
    assert math.isfinite(rows[-1]["actor/pg_loss"])
    if file == "dapo.yaml":  # the even answers' groups (all right) were dropped every step
        assert all(0 < r["train/kept_prompts_ratio"] < 1 for r in rows)
    if file == "grpo_lora.yaml":
        # Step 1's updates moved the adapted policy (the second mini-batch saw the first's
        # step), and rollout sampled step 2 with those weights merged: its log-probs are
        # the actor's, as for a full fine-tune (float32 on CPU).
        assert rows[0]["actor/ppo_kl"] != 0
        assert rows[-1]["training/rollout_probs_diff_max"] < 1e-4
        # The reference is the actor's base model, adapters off: no reference server, and
        # the KL to it grows once the adapters moved.
        assert not (tmp_path / "logs" / "ref.log").exists()
        assert (tmp_path / "logs" / "actor.log").exists()
        assert rows[-1]["actor/kl_loss"] > 0
    if "critic/vf_loss" not in EXPECTED[name]:
        assert "critic/vf_loss" not in rows[-1], "no critic for critic-free estimators"
