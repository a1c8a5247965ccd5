"""The trace-gap finder on a made-up chrome trace: two kernels with a 400 us gap, during
which the host sat in an item() sync inside a named range."""

from benchmarks.trace_gaps import gaps


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_gap_is_found_with_what_the_host_was_doing():
    trace = {
        "traceEvents": [
            _x("meshrl/micro_loss", "user_annotation", 0, 1000),
            _x("aten::item", "cpu_op", 150, 500),
            _x("cudaLaunchKernel", "cuda_runtime", 10, 5, correlation=1),
            _x("cudaLaunchKernel", "cuda_runtime", 660, 5, correlation=2),
            _x("gemm", "kernel", 20, 180, tid=7, correlation=1),
            _x("softmax", "kernel", 600, 50, tid=7, correlation=2),
        ]
    }
    report = gaps(trace, top=5, min_us=100)
    assert report["busy_ms"] == (180 + 50) / 1e3
    assert report["idle_ms"] == 400 / 1e3
    [gap] = report["largest"]
    assert gap["gap_us"] == 400
    assert (gap["kernel_before"], gap["kernel_after"]) == ("gemm", "softmax")
    assert gap["host_when_idle"] == ["meshrl/micro_loss", "aten::item"]
    assert gap["host_at_launch"] == ["meshrl/micro_loss"]
