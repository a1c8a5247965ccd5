"""Settings for the whole suite.

Hypothesis: under CI (``CI=true``) every property test draws the same examples on every
run (``derandomize``) and prints the blob that reproduces a failure, so a red CI run is
reproducible and a green one is not luck; elsewhere the examples are random, and
remembered in .hypothesis/. ``HYPOTHESIS_PROFILE`` picks a profile by name.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
settings.register_profile("dev")
settings.load_profile(
    os.environ.get(
        "HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI", "").lower() == "true" else "dev"
    )
)
