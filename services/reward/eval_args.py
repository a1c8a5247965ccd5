"""The offline evaluation's command-line arguments, apart from the evaluation itself so that
building the `meshrl` parser does not import pyarrow and pydantic (0.4 s on every command)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The evaluation's arguments, shared by ``python -m services.reward.evaluate`` and
    ``meshrl reward eval``."""
    p.add_argument("--data", required=True, nargs="+", help="verl-schema parquet file(s)")
    p.add_argument("--responses", required=True, help="responses.jsonl")
    p.add_argument(
        "--server", default=None, help="HOST:PORT of a reward server (default: in-process)"
    )
    p.add_argument("--output", default=None, help="write the report as JSON here")
    p.add_argument(
        "--custom-function", default=None, help="path/to/file.py:function_name (in-process)"
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="each sample's scoring limit in seconds (default: 10 in process, the server's own "
        "with --server)",
    )
    p.add_argument("--num-workers", type=int, default=2)
