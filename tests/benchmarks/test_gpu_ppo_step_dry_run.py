"""The whole-step GPU benchmark's own dry run on CPU (`--tiny --device cpu`), so the script
that produced docs/benchmarks.md's PPO-step table keeps working between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_reports_every_phase(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.ppo.step", "--tiny", "--device", "cpu",
           "--variants", "colocated", "--batch", "8", "--mini", "8", "--micro", "4",
           "--prompt-len", "24", "--response-len", "8", "--steps", "2",
           "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work")]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "ppo_step_colocated.json").read_text())
    assert "error" not in result, result.get("error")
    assert [s["step"] for s in result["steps"]] == [1, 2]
    timing = result["median_after_first"]
    for phase in ("gen", "reward", "old_log_prob", "ref", "values", "update_critic",
                  "update_actor", "sync_weights", "step"):  # fmt: skip
        assert timing[f"timing_s/{phase}"] > 0, phase
    parts = sum(timing[f"timing_s/{p}"] for p in ("gen", "adv", "sync_weights"))
    assert parts < timing["timing_s/step"]  # the phases are parts of the step
    assert result["steps"][0]["prompt_length/mean"] == 24  # the prompts are the asked length
