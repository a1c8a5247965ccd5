"""`make test-gpu` runs the tests marked `gpu` (benchmarks/gpu_tests.py): a test that skips
for want of CUDA and is not marked would never run anywhere."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_that_needs_cuda_is_marked_gpu():
    unmarked = [
        str(path.relative_to(TESTS))
        for path in TESTS.rglob("test_*.py")
        if "cuda.is_available()" in (text := path.read_text())
        and "skipif" in text
        and "mark.gpu" not in text
    ]
    assert unmarked == []
