"""tests/conftest.py: CI=true derandomises every property test."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PRINT = (
    "import conftest\n"
    "from hypothesis import settings\n"
    "print(settings.default.derandomize, settings.default.print_blob, settings.default.database)"
)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"CI": "true"}, "True True None"),
        ({"HYPOTHESIS_PROFILE": "ci"}, "True True None"),
    ],
)
def test_ci_profile_derandomizes(env, expected):
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    out = subprocess.run(
        [sys.executable, "-c", PRINT],
        cwd=TESTS,
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == expected


def test_without_ci_examples_are_random():
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    out = subprocess.run(
        [sys.executable, "-c", PRINT], cwd=TESTS, env=clean, capture_output=True, text=True
    )
    assert out.stdout.split()[0] == "False", out.stderr
