"""Generates the Python stubs in meshrl/api/v1 from protos/meshrl/api/v1/*.proto.

Run with the pinned grpcio-tools (see pyproject's `dev` extra): the stubs check the
grpcio version at import, so they are made with the oldest grpcio they must run on.
`python protos/generate.py --check` fails when the committed stubs drift from the protos.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE = Path("meshrl/api/v1")


def generate(out_root: Path) -> list[Path]:
    protos = sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))
    grpc_include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{grpc_include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / PACKAGE).glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    target = ROOT / PACKAGE
    if not args.check:
        for path in generate(ROOT):
            print("wrote", path.relative_to(ROOT))
        return
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            p.name
            for p in fresh
            if not (target / p.name).exists() or not filecmp.cmp(p, target / p.name, shallow=False)
        ]
    if stale:
        sys.exit(f"generated stubs drift from protos/: {stale}; run `python protos/generate.py`")
    print("stubs match protos")


if __name__ == "__main__":
    main()
