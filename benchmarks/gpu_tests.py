"""`make test-gpu`: what only a GPU can check, in one call on the GPU machine.

    python3 -m benchmarks.gpu_tests --out $OUT        (make test-gpu)

1. pytest over every test marked ``gpu`` (tests/architecture/test_gpu_marks.py keeps every
   test that skips for want of CUDA marked so);
2. 3-step PPO runs through the real mesh on a small Qwen2 (hidden 256, head size 64): each
   engine (native, fast, vLLM when it imports), synchronous and fully async, and partial
   rollouts with the fast engine;
3. with megatron-core importable, the Megatron backend's life cycle:
   :func:`megatron_lifecycle`.

Prints one summary line last and writes ``<out>/test_gpu.json`` (each test's outcome, each
run's steps, metrics of its last step and GPU memory per phase). Exit 1 when anything failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]

# (name, overrides): every run is 3 PPO steps of 16 prompts, 64 + 32 tokens.
ASYNC = ["trainer.async_training.enable=true", "trainer.async_training.max_staleness=1"]
PARTIAL = [
    *ASYNC,
    "actor_rollout_ref.rollout.partial_rollout=true",
    "actor_rollout_ref.rollout.partial_rollout_kv=keep",
]
RUNS: list[tuple[str, str, list[str]]] = [
    ("native_sync", "native", []),
    ("native_async", "native", ASYNC),
    ("fast_sync", "fast", []),
    ("fast_async", "fast", ASYNC),
    ("fast_async_partial", "fast", PARTIAL),
    ("vllm_sync", "vllm", []),
    ("vllm_async", "vllm", ASYNC),
]


def gpu_test_files() -> list[str]:
    """The test files with a test marked gpu: only they are collected (the GPU machine
    lacks packages other tests import, such as testcontainers)."""
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in p.read_text()
    )


def run_pytest(out: Path, timeout_s: int, files: list[str] | None = None) -> dict:
    """pytest -m gpu over ``files`` (None: every file with a gpu test); each test's outcome
    from its JUnit XML."""
    xml = out / "test_gpu_junit.xml"
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
        "-o", "addopts=", f"--junitxml={xml}", *(files or gpu_test_files()),
    ]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    tests: dict[str, str] = {}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed"
                    tests[name + " (why)"] = (child.get("message") or "")[:500]
                elif child.tag == "skipped":
                    outcome = "skipped"
            tests[name] = outcome
    outcomes = [v for k, v in tests.items() if not k.endswith("(why)")]
    return {
        "seconds": round(time.monotonic() - start, 1),
        "exit_code": done.returncode,
        "passed": outcomes.count("passed"),
        "failed": outcomes.count("failed"),
        "skipped": outcomes.count("skipped"),
        "tests": tests,
        "tail": done.stdout[-3000:],
    }


def mesh_run(name: str, engine: str, overrides: list[str], workdir: Path) -> dict:
    """One 3-step run through the mesh with ``engine``; its last step's key metrics."""
    from benchmarks.ppo import step as ppo_step

    model = workdir / "model"
    if not (model / "config.json").exists():
        from meshrl.testing.tiny_model import make_tiny_qwen2_dir

        make_tiny_qwen2_dir(
            model, vocab_size=151936, max_positions=4096, hidden=256, intermediate=512
        )
    args = SimpleNamespace(
        batch=16, steps=3, prompt_len=64, response_len=32, mini=8, micro=4,
        gpu_memory_utilization=0.3, device="cuda", verl_defaults=False,
        override=[f"actor_rollout_ref.rollout.name={engine}", *overrides],
    )  # fmt: skip
    ppo_step.VARIANTS[name] = []
    start = time.monotonic()
    result = ppo_step.run_variant(name, workdir, str(model), args)
    steps = result["steps"]
    last = steps[-1] if steps else {}
    kept = ("timing_s/step", "training/rollout_probs_diff", "critic/score/mean")
    return {
        "seconds": round(time.monotonic() - start, 1),
        "steps": len(steps),
        "ok": len(steps) == 3,
        "last_step": {k: last[k] for k in kept if k in last},
        "gpu_memory_per_phase": result.get("gpu_memory_per_phase", {}),
    }


def megatron_lifecycle(workdir: Path, device: str = "cuda", tiny: bool = False) -> dict:
    """3 PPO steps through the mesh with actor, critic and reference on strategy=megatron
    (Qwen2.5-0.5B's shape, tensor parallel 1), a checkpoint at step 3; a 4th step resumed
    from it; the actor exported to a Hugging Face folder (meshrl export); one step whose
    rollout engine (and FSDP2 trainers) start from that folder. ``tiny``/``cpu``: a dry run."""
    from benchmarks.ppo import step as ppo_step
    from meshrl_app.export import export_checkpoint

    folder = "model_tiny" if tiny else "model_0.5b"
    model = ppo_step.make_model(workdir / folder, tiny, "0.5b")
    args = SimpleNamespace(
        batch=16, steps=3, prompt_len=64, response_len=32, mini=8, micro=4,
        gpu_memory_utilization=0.3, device=device, verl_defaults=False,
        override=["trainer.save_freq=3"],
    )  # fmt: skip
    ppo_step.VARIANTS["megatron_steps"] = ppo_step.MEGATRON
    first = ppo_step.run_variant("megatron_steps", workdir, model, args)
    checkpoint = workdir / "run_megatron_steps" / "checkpoints" / "global_step_3"
    report: dict = {"steps": len(first["steps"]), "checkpoint": checkpoint.is_dir()}
    report["median_after_first"] = {
        k: v for k, v in first["median_after_first"].items()
        if k in ("timing_s/step", "perf/mfu/actor", "perf/mfu/critic", "timing_s/update_actor")
    }  # fmt: skip
    ppo_step.VARIANTS["megatron_resumed"] = [
        *ppo_step.MEGATRON,
        f"trainer.resume_mode={checkpoint}",
    ]
    args.steps, args.override = 4, []
    resumed = ppo_step.run_variant("megatron_resumed", workdir, model, args)
    report["resumed_steps"] = [
        s.get("training/global_step", s.get("step")) for s in resumed["steps"]
    ]
    exported = workdir / "megatron_exported"
    shutil.rmtree(exported, ignore_errors=True)
    export_checkpoint(checkpoint, "actor", exported)
    ppo_step.VARIANTS["from_megatron_export"] = []
    args.override = ["trainer.total_training_steps=1"]
    from_export = ppo_step.run_variant("from_megatron_export", workdir, str(exported), args)
    report["export_run_steps"] = len(from_export["steps"])
    report["ok"] = (
        report["steps"] == 3 and report["checkpoint"] and len(resumed["steps"]) == 1
        and report["export_run_steps"] == 1
    )  # fmt: skip
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--workdir", default="/tmp/meshrl_test_gpu")
    parser.add_argument("--pytest-timeout-s", type=int, default=330)
    parser.add_argument("--runs", default=",".join(r[0] for r in RUNS))
    parser.add_argument("--tests", nargs="*", help="these test files only (default: every one)")
    args = parser.parse_args()
    out, workdir = Path(args.out), Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    import torch

    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "vllm": _version("vllm"),
    }
    try:
        report["pytest"] = run_pytest(out, args.pytest_timeout_s, args.tests)
    except subprocess.TimeoutExpired:
        report["pytest"] = {"error": f"past {args.pytest_timeout_s} s", "passed": 0, "failed": 1}
    _save(out, report)
    report["runs"] = {}
    wanted = args.runs.split(",")
    for name, engine, overrides in RUNS:
        if name not in wanted:
            continue
        if engine == "vllm" and report["vllm"] is None:
            report["runs"][name] = {"ok": None, "skipped": "vllm is not installed"}
            continue
        try:
            report["runs"][name] = mesh_run(name, engine, overrides, workdir)
        except Exception as e:  # noqa: BLE001 - one run failing still leaves the others
            tail = traceback.format_exc()[-2000:]
            report["runs"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": tail}
        _save(out, report)
    if "megatron" in wanted or args.runs == parser.get_default("runs"):
        if importlib.util.find_spec("megatron") is None:
            report["runs"]["megatron_lifecycle"] = {"ok": None, "skipped": "no megatron-core"}
        else:
            try:
                report["runs"]["megatron_lifecycle"] = megatron_lifecycle(workdir)
            except Exception as e:  # noqa: BLE001
                tail = traceback.format_exc()[-2000:]
                report["runs"]["megatron_lifecycle"] = {"ok": False, "error": str(e), "tb": tail}
        _save(out, report)
    runs = report["runs"].values()
    ran = [r for r in runs if r.get("ok") is not None]
    ok = sum(bool(r["ok"]) for r in ran)
    t = report["pytest"]
    line = (
        f"test-gpu on {report['gpu']}: tests {t['passed']} passed, {t['failed']} failed, "
        f"{t.get('skipped', 0)} skipped; PPO runs {ok} of {len(ran)} ok"
        + (f", {len(report['runs']) - len(ran)} skipped (no vllm)" if len(ran) < len(runs) else "")
    )
    report["summary"] = line
    _save(out, report)
    print(line, flush=True)
    return 0 if t["failed"] == 0 and ok == len(ran) else 1


def _version(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return None
    from importlib.metadata import version

    return version(package)


def _save(out: Path, report: dict) -> None:
    (out / "test_gpu.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
