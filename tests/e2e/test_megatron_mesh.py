"""strategy=megatron through the real mesh on the CPU: 3 PPO steps with the actor,
critic and reference on the Megatron-Core backend and a checkpoint at step 3, a 4th step
resumed from it, the actor exported to a Hugging Face folder (meshrl export), and one step
whose rollout engine starts from that folder. The same function runs on the GPU at the
0.5B shape in `make test-gpu` (benchmarks/gpu_tests.py)."""

import pytest

pytest.importorskip("megatron.core")


@pytest.mark.slow
def test_megatron_roles_train_resume_and_export_through_the_mesh(tmp_path):
    from benchmarks.gpu_tests import megatron_lifecycle

    report = megatron_lifecycle(tmp_path, device="cpu", tiny=True)
    assert report["steps"] == 3 and report["checkpoint"]
    assert report["resumed_steps"] == [4]  # resumed at step 4, not from the start
    assert report["export_run_steps"] == 1
    assert report["ok"]
