"""The versions a bug report needs: meshrl's own and those of the libraries a run depends on
most (torch computes, grpcio carries every call between the roles).

Read from the installed packages' metadata, so that asking costs no import of torch.
"""

from __future__ import annotations

import functools
import importlib.metadata


@functools.cache
def package_version(name: str = "meshrl") -> str:
    """The installed version of ``name``; "unknown" when it is not installed (meshrl run
    from a bare checkout, without ``pip install -e .``)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def versions_line() -> str:
    """``meshrl 0.1.0 (torch 2.6.0, grpcio 1.84.0, python 3.11.9)``: one line for
    `meshrl --version`."""
    import platform

    libraries = ", ".join(f"{lib} {package_version(lib)}" for lib in ("torch", "grpcio"))
    return f"meshrl {package_version()} ({libraries}, python {platform.python_version()})"
