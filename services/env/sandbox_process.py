"""What runs inside a sandbox worker: its limits, set once, then one tool call per task.

Workers are spawned (not forked: the server has gRPC threads), so this module imports only
what a worker needs.
"""

from __future__ import annotations

import resource

from services.env.expression import ExpressionError, evaluate, format_value


def limit_worker(memory_limit_mb: int) -> None:
    """Caps the worker's address space (a runaway computation fails with MemoryError alone)
    and the size of any file it could write (0: none), and forbids new processes."""
    limit = int(memory_limit_mb) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))


def calculate(expression: str) -> str:
    """The calculator's answer to ``expression``: its value, or ``error: ...``."""
    try:
        value = evaluate(expression)
    except ExpressionError as e:
        return f"error: {e}"
    except MemoryError:
        return "error: the expression needs more memory than the calculator has"
    try:
        return format_value(value)
    except ValueError as e:  # an int past Python's digit limit for str(): no text of it
        return f"error: the result cannot be written out ({e})"
