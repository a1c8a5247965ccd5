"""Whether files can be written where a user points a command's output (``meshrl demo --out``,
``meshrl preprocess --output``, ``meshrl export --to``, ``meshrl reward eval --output``),
asked before the work starts: a file of that name, a read-only mount or a path under /proc
is one line naming the option, not an OSError traceback once the work is done."""

from __future__ import annotations

import tempfile
from pathlib import Path


def output_problem(path: str | Path) -> str | None:
    """Why the folder ``path`` (there, or to be made) cannot take new files; None when it
    can. Asked of the nearest folder that exists, by writing a temporary file in it."""
    path = Path(path).expanduser().absolute()
    if path.exists() and not path.is_dir():
        return "a file of that name exists"
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        return f"nothing can be written in {probe} ({e.strerror or e})"
    return None
