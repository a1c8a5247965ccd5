"""The trace-gap finder on a made-up chrome trace: two kernels with a 400 us gap, during
which the host sat in an item() sync inside a named range."""

from benchmarks.system.trace_gaps import gaps


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


def test_idle_time_is_summed_by_the_named_ranges_the_host_was_in():
    trace = {
        "traceEvents": [
            _x("meshrl/micro_loss", "user_annotation", 0, 1000),
            _x("FSDP::pre_forward", "user_annotation", 100, 200),  # nested: "outer > inner"
            _x("meshrl/backward", "user_annotation", 1000, 1000),
            _x("aten::mm", "cpu_op", 0, 10),
            _x("a", "kernel", 0, 100, tid=7),
            _x("b", "kernel", 400, 100, tid=7),  # 300 us idle from 100: in pre_forward
            _x("c", "kernel", 1200, 100, tid=7),  # 700 us from 500: micro_loss
            _x("d", "kernel", 1500, 100, tid=7),  # 200 us from 1300: backward
            _x("e", "kernel", 2500, 100, tid=7),  # 900 us from 1600: backward
            _x("f", "kernel", 2700, 10, tid=7),  # 100 us from 2600: outside both
        ]
    }
    report = gaps(trace, top=5, min_us=100)
    assert report["idle_ms_by_region"] == {
        "meshrl/backward": 1.1,
        "meshrl/micro_loss": 0.7,
        "meshrl/micro_loss > FSDP::pre_forward": 0.3,
        "(none)": 0.1,
    }
    assert report["host_ms_by_region"] == {
        "meshrl/micro_loss": 1.0,
        "meshrl/backward": 1.0,
        "FSDP::pre_forward": 0.2,
    }
