"""The committed stubs must be exactly what protoc makes from protos/ (no drift)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_match_protos():
    result = subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "stubs match protos" in result.stdout


def test_drift_is_detected(tmp_path, monkeypatch):
    """Editing a stub by hand is caught by the same check."""
    import shutil

    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "protos", copy / "protos")
    shutil.copytree(ROOT / "meshrl" / "api", copy / "meshrl" / "api")
    stub = copy / "meshrl" / "api" / "v1" / "reward_pb2.py"
    stub.write_text(stub.read_text() + "\n# edited by hand\n")
    result = subprocess.run(
        [sys.executable, str(copy / "protos" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "reward_pb2.py" in result.stderr
