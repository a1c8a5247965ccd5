"""``python -m meshrl.data.preprocess NAME INPUT OUTPUT_DIR``: prints rows per split as JSON."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from meshrl.data.errors import DataError
from meshrl.data.preprocess import PREPROCESSORS, convert
from meshrl.data.preprocess.common import write_splits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshrl.data.preprocess", description=__doc__)
    parser.add_argument("name", choices=sorted(PREPROCESSORS))
    parser.add_argument("input", help="raw file or folder (jsonl, jsonl.gz, json, parquet)")
    parser.add_argument("output_dir", help="where train.parquet / test.parquet are written")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        result = convert(args.name, args.input)
        written = write_splits(result.rows, args.output_dir)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"written": written, "skipped": result.skipped}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
