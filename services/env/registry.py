"""The environments a server runs, by name."""

from __future__ import annotations

from services.env.arithmetic_chain import ArithmeticChainEnv
from services.env.calculator import CalculatorEnv
from services.env.environment import Environment
from services.env.sandbox import Sandbox

ENVIRONMENT_NAMES = ("calculator", "arithmetic_chain")


def build_environments(sandbox: Sandbox, tool_timeout_s: float) -> dict[str, Environment]:
    """Every shipped environment; the calculator's calls run in ``sandbox``."""
    return {
        "calculator": CalculatorEnv(sandbox, tool_timeout_s),
        "arithmetic_chain": ArithmeticChainEnv(),
    }
