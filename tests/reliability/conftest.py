"""benchmarks/ is not an installed package: the load test and the server helper come from the
checkout itself (as with `python -m pytest` from the repository root)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
