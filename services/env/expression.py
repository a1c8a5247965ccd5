"""A restricted evaluator of arithmetic expressions: the calculator tool's language.

The expression is parsed with :mod:`ast` and only numbers, ``+ - * / // % **``, unary signs,
parentheses and a short list of math functions are evaluated; names, attributes,
subscripts, comprehensions, lambdas and every other node are refused before anything runs,
so there is no way to reach builtins, imports, files or the network. Exponents are bounded
(a ``9**9**9`` is refused rather than computed); what is left of runaway time or memory is
the sandbox's limits' to stop (``sandbox.py``).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
"""Largest |exponent| of ``**``: big enough for any word problem, small enough that no
power can fill the memory."""

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., float]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "floor": math.floor,
    "ceil": math.ceil,
}


class ExpressionError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def evaluate(expression: str) -> float | int:
    """The value of ``expression``; ExpressionError for anything outside the language."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ExpressionError(f"not an arithmetic expression: {expression!r}") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise ExpressionError("division by zero") from None
    except (OverflowError, TypeError, ValueError) as e:
        if isinstance(e, ExpressionError):
            raise
        raise ExpressionError(f"{type(e).__name__}: {e}") from None


def _eval(node: ast.expr) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        if isinstance(node.value, bool):  # True / False are ints to Python, not to us
            raise ExpressionError(f"not allowed in an expression: {node.value!r}")
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ExpressionError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _FUNCTIONS[node.func.id](*[_eval(a) for a in node.args])
    raise ExpressionError(f"not allowed in an expression: {ast.unparse(node)!r}")


def format_value(value: float | int) -> str:
    """A result as the model reads it: integers without a decimal point (``12.0`` -> ``12``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)
