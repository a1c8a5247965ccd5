"""A user's reward function from a file: ``reward.custom_function: path/to/file.py:fn``.

The function has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info)``
and returns a number or a dict with a "score" key (other numeric keys become ``extra``). It
replaces the registry for every data_source. The name after ``:`` defaults to
``compute_score``. It is loaded inside the worker processes only.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import cache
from pathlib import Path

DEFAULT_FUNCTION = "compute_score"


def parse_spec(spec: str) -> tuple[Path, str]:
    """``"dir/f.py:fn"`` -> (Path("dir/f.py"), "fn"); ``"dir/f.py"`` -> (..., "compute_score")."""
    path, sep, name = spec.rpartition(":")
    if not sep or not name.isidentifier():
        return Path(spec).expanduser(), DEFAULT_FUNCTION
    return Path(path).expanduser(), name


@cache
def load_custom_function(spec: str) -> Callable:
    """The function `spec` names; ValueError saying what is wrong if it cannot be loaded."""
    path, name = parse_spec(spec)
    if not path.is_file():
        raise ValueError(f"reward.custom_function: file {path} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"meshrl_custom_reward_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"reward.custom_function: cannot import {path} (not a .py file?)")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        names = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise ValueError(
            f"reward.custom_function: {path} has no function {name!r}; "
            f"callables there: {', '.join(names) or 'none'}"
        )
    return fn
