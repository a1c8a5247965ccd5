"""Where the GPU waits: the idle gaps between kernels in a torch.profiler chrome trace,
each with what the host was doing when the GPU went idle and what launched the kernel that
ended the gap (the enclosing Python frames and ops, innermost last).

    python3 -m benchmarks.system.trace_gaps trace.json [--top 15] [--min-us 100]

A step whose GPU is busy 110 ms of 170 ms is bound by the host; these gaps say by what
(a device sync inside an op, a Python loop, a hook).
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import Counter

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "python_function", "user_annotation"}


def _enclosing(host: list[dict], starts: list[float], t: float, tid, depth: int) -> list[str]:
    """Names of host events on thread ``tid`` that contain time ``t``, outermost first."""
    i = bisect.bisect_right(starts, t)
    found = [
        e
        for e in host[max(0, i - 20000) : i]
        if e["tid"] == tid and e["ts"] <= t <= e["ts"] + e.get("dur", 0)
    ]
    found.sort(key=lambda e: -e.get("dur", 0))
    return [e["name"][:90] for e in found][-depth:]


def _named(host: list[dict], tid) -> list[dict]:
    """The named ranges (``record_function``: "meshrl/backward", "FSDP::pre_forward", ...)
    on thread ``tid``, by start time."""
    return sorted(
        (e for e in host if e["tid"] == tid and e.get("cat") == "user_annotation"),
        key=lambda e: (e["ts"], -e.get("dur", 0)),
    )


def by_region(found: list, named: list[dict], levels: int = 2) -> dict[str, float]:
    """Idle GPU time (ms) summed by the named ranges the host was in when each gap began,
    as "outer > inner" up to ``levels`` deep ("(none)" outside all), largest first: which
    phase of a step starves the GPU."""
    starts = [e["ts"] for e in named]
    idle: Counter = Counter()
    for length, at, _before, _after in found:
        i = bisect.bisect_right(starts, at)
        inside = [e for e in named[max(0, i - 2000) : i] if at <= e["ts"] + e.get("dur", 0)]
        path = " > ".join(e["name"][:50] for e in inside[:levels]) or "(none)"
        idle[path] += length / 1e3
    return {name: round(ms, 3) for name, ms in idle.most_common(25)}


def gaps(trace: dict, top: int = 15, min_us: float = 100.0, depth: int = 8) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    host = sorted((e for e in events if e.get("cat") in HOST_CATS), key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]
    launch = {
        e["args"].get("correlation"): e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e
    }
    if not device:
        return {"error": "no device events in the trace"}
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    busy, found, end, prev = 0.0, [], device[0]["ts"], None
    for e in device:
        if e["ts"] > end and prev is not None:
            found.append((e["ts"] - end, end, prev, e))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        end = max(end, e["ts"] + e["dur"])
        prev = e
    main_tid = Counter(e["tid"] for e in host if e.get("cat") == "cpu_op").most_common(1)
    tid = main_tid[0][0] if main_tid else None
    rows = []
    for length, at, before, after in sorted(found, key=lambda g: -g[0])[:top]:
        if length < min_us:
            break
        runtime = launch.get(after.get("args", {}).get("correlation"))
        rows.append(
            {
                "gap_us": round(length, 1),
                "kernel_before": before["name"][:80],
                "kernel_after": after["name"][:80],
                "host_when_idle": _enclosing(host, starts, at, tid, depth),
                "host_at_launch": (
                    _enclosing(host, starts, runtime["ts"], runtime["tid"], depth)
                    if runtime
                    else []
                ),
            }
        )
    total_gaps = sum(g[0] for g in found)
    named = _named(host, tid)
    host_ms: Counter = Counter()
    for e in named:
        host_ms[e["name"][:50]] += e.get("dur", 0) / 1e3
    return {
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": total_gaps / 1e3,
        "gaps_over_min": sum(1 for g in found if g[0] >= min_us),
        "idle_in_gaps_over_min_ms": sum(g[0] for g in found if g[0] >= min_us) / 1e3,
        "idle_ms_by_region": by_region(found, named),
        "host_ms_by_region": {name: round(ms, 3) for name, ms in host_ms.most_common(25)},
        "largest": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--min-us", type=float, default=100.0)
    args = parser.parse_args()
    with open(args.trace) as f:
        print(json.dumps(gaps(json.load(f), args.top, args.min_us), indent=1))


if __name__ == "__main__":
    main()
