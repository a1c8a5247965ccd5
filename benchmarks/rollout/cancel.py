"""A generation whose caller leaves, on the GPU: how soon the fast engine stops, and that
it is left as it was.

The rollout server sets a Generate's ``cancelled`` event when its RPC ends without an
answer (docs/rollout.md); the fast path reads it once a round of ``check_every`` decode
steps. This times, at batch 256 with 256 prompt and 256 new tokens, the delay from the
event being set to ``generate`` raising, and checks that a seeded generation after the
cancelled ones gives the tokens it gave before them.

    PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.rollout.cancel --out $OUT
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.rollout.engine import qwen05_engine, random_prompts
from services.rollout.engine import GenerationCancelled
from services.rollout.types import SamplingParams


def _generate_s(engine, prompts, params) -> tuple[float, list[list[int]]]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - start, out.responses.tolist()


def cancel_after(engine, prompts, params, delay_s: float) -> dict:
    """Sets the event `delay_s` into a generate call; how long until the call raised."""
    cancelled = threading.Event()
    set_at: list[float] = []

    def leave() -> None:
        set_at.append(time.perf_counter())
        cancelled.set()

    timer = threading.Timer(delay_s, leave)
    torch.cuda.synchronize()
    start = time.perf_counter()
    timer.start()
    try:
        engine.generate(prompts, params, cancelled)
    except GenerationCancelled as e:
        raised = time.perf_counter()
        torch.cuda.synchronize()  # the rounds already queued still run on the GPU
        drained = time.perf_counter()
        return {
            "set_after_s": set_at[0] - start,
            "raised_after_set_ms": (raised - set_at[0]) * 1e3,
            "gpu_idle_after_set_ms": (drained - set_at[0]) * 1e3,
            "message": str(e),
        }
    finally:
        timer.cancel()
    return {"set_after_s": delay_s, "finished_before_the_event": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as workdir:
        engine = qwen05_engine(workdir)
        prompts = random_prompts(7, 256, 256, 256, engine.vocab_size)
        params = SamplingParams(temperature=1.0, max_tokens=256, seed=11)
        _generate_s(engine, prompts, params)  # warm-up: graphs and compiles
        seconds, before = _generate_s(engine, prompts, params)
        _, again = _generate_s(engine, prompts, params)
        result["whole_call_s"] = seconds
        result["seeded_calls_repeat"] = before == again
        result["cancels"] = [
            cancel_after(engine, prompts, params, delay) for delay in (0.05, 0.15, 0.3, 0.3)
        ]
        _, after = _generate_s(engine, prompts, params)
        result["after_cancels_same_tokens"] = after == before
        result["after_cancels_rows_equal"] = sum(a == b for a, b in zip(after, before, strict=True))
    print(json.dumps(result, indent=1))
    (out / "rollout_cancel.json").write_text(json.dumps(result, indent=1))
    if result["seeded_calls_repeat"] and not result["after_cancels_same_tokens"]:
        raise SystemExit("a generation after the cancelled ones gave other tokens")


if __name__ == "__main__":
    main()
