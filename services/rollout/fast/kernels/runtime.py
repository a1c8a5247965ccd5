"""What every kernel module shares: triton imported if it can be (the CPU CI may not have
it), whether the kernels can run on a device, and small launch helpers.

Kernels are plain functions in their modules, wrapped by ``triton.jit`` on first use, so
the modules import without triton and the interpreter (``TRITON_INTERPRET=1``, which runs
kernels on CPU tensors for the tests) is chosen by the environment at the first launch
rather than at import.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU CI may not have triton: the modules still import
    triton = None
    tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run on tensors of ``device``: triton imports and the device is
    CUDA, or the Triton interpreter is on (``TRITON_INTERPRET=1``; it runs CPU tensors)."""
    if triton is None:
        return False
    return interpreting() or torch.device(device).type == "cuda"


def jit(fn, **options):
    """``triton.jit(fn)``; raises when triton is not installed."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    return triton.jit(fn, **options)


def is_interpreted(jitted) -> bool:
    return type(jitted).__name__ == "InterpretedFunction"


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H200's, so the interpreter picks what the GPU would


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def supports_head_dim(d: int) -> bool:
    """The attention and rope kernels tile a head as ``tl.arange(0, d)``: a power of two,
    and ``tl.dot`` needs at least 16 (Phi-3's 96, say, takes the torch path)."""
    return d >= 16 and d & (d - 1) == 0


def check_head_dim(d: int) -> None:
    assert supports_head_dim(d), f"head_dim must be a power of two >= 16, got {d}"
