"""A user's reward function from a file: ``reward.custom_function: path/to/file.py:fn``.

The function has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info)``
and returns a number or a dict with a "score" key (other numeric keys become ``extra``). It
replaces the registry for every data_source. The name after ``:`` defaults to
``compute_score``. It is loaded inside the worker processes only.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType

DEFAULT_FUNCTION = "compute_score"


class CustomFunctionError(ValueError):
    """The spec names no loadable function (no such file, no such name; and, from
    ``ScorerPool.check_custom``, a module that raised, hung or killed its worker while it was
    imported); the message says which. :func:`load_custom_function` itself lets what the
    module raises propagate as it is."""


def parse_spec(spec: str) -> tuple[Path, str]:
    """``"dir/f.py:fn"`` -> (Path("dir/f.py"), "fn"); ``"dir/f.py"`` -> (..., "compute_score")."""
    path, sep, name = spec.rpartition(":")
    if not sep or not name.isidentifier():
        return Path(spec).expanduser(), DEFAULT_FUNCTION
    return Path(path).expanduser(), name


@cache
def load_custom_function(spec: str) -> Callable:
    """The function `spec` names; CustomFunctionError saying what is wrong if there is none.
    Whatever the module raises while it is imported propagates as it is."""
    path, name = parse_spec(spec)
    if not path.is_file():
        raise CustomFunctionError(f"reward.custom_function: file {path} does not exist")
    module = _import_file(path)
    fn = getattr(module, name, None)
    if not callable(fn):
        names = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise CustomFunctionError(
            f"reward.custom_function: {path} has no function {name!r}; "
            f"callables there: {', '.join(names) or 'none'}"
        )
    return fn


def _import_file(path: Path) -> ModuleType:
    """The module of the file at `path`, registered in sys.modules as Python's own import
    does: dataclasses, pickle and typing look a class's module up there while it is defined."""
    name = f"meshrl_custom_reward_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise CustomFunctionError(f"reward.custom_function: cannot import {path} (not a .py file?)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)  # no half-run module left behind
        raise
    return module
