"""Two runs' ``metrics.jsonl`` compared step for step: every key and every value, but those
measured by the clock (``timing_s/*``, ``perf/time_per_step``, ``perf/throughput``,
``perf/mfu/*``, tokens/s, the weight sync's seconds and rate), which no two runs share. A
change that must not change behaviour (a refactor) gives no difference.

    python -m benchmarks.architecture.same_run BEFORE/metrics.jsonl AFTER/metrics.jsonl [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

WALL_CLOCK = (
    "timing_s/",
    "perf/time_per_step",
    "perf/throughput",
    "perf/mfu/",
    "weight_sync/seconds",
    "weight_sync/gbps",
)
PER_SECOND = "tokens_per_s"


def _steps(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    return [
        {
            k: v
            for k, v in json.loads(line).items()
            if not k.startswith(WALL_CLOCK) and not k.endswith(PER_SECOND)
        }
        for line in lines
        if line.strip()
    ]


def differences(before: Path, after: Path) -> list[str]:
    """One line per step or value that differs; none when the runs are the same."""
    a, b = _steps(before), _steps(after)
    found = [f"{len(a)} lines before, {len(b)} after"] if len(a) != len(b) else []
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        step = x.get("step", i)
        for key in sorted(set(x) | set(y)):
            if key not in x or key not in y:
                found.append(f"step {step}: {key} only {'after' if key in y else 'before'}")
            elif x[key] != y[key] and not (
                isinstance(x[key], float) and math.isnan(x[key]) and math.isnan(y[key])
            ):
                found.append(f"step {step}: {key} {x[key]!r} before, {y[key]!r} after")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--out", type=Path, help="folder for architecture_same_run.json")
    args = parser.parse_args()
    found = differences(args.before, args.after)
    steps = len(_steps(args.before))
    values = sum(len(s) for s in _steps(args.before))
    for line in found[:50]:
        print(line)
    print(f"{steps} lines, {values} values compared: {len(found)} differences")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"lines": steps, "values": values, "differences": found}
        (args.out / "architecture_same_run.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
