"""An error message of `meshrl` comes at once: matching it to an exit code imports nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def test_a_bad_request_is_told_without_loading_torch():
    """Before: matching the error imported meshrl_app.export (torch) and the coordinator's
    modules, 4 s before any message, on every error and on Ctrl-C."""
    code = (
        "import sys; from meshrl_app import cli; "
        "rc = cli.main(['run', '/no/such/run.yaml']); print(rc, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert done.stderr == "meshrl: config file /no/such/run.yaml does not exist\n"


def test_every_error_class_the_cli_names_exists():
    """The CLI names its exit-code classes as "module:Class" strings; a rename must fail
    here, not as an AttributeError while a user's error is being reported."""
    import importlib

    from meshrl_app import cli

    for name in cli.BAD_REQUEST_ERRORS + cli.FAILURE_ERRORS:
        module, cls = name.split(":")
        assert issubclass(getattr(importlib.import_module(module), cls), Exception), name
