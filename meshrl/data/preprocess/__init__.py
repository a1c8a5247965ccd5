"""Raw upstream files -> ``train.parquet`` / ``test.parquet`` in verl's schema.

    python -m meshrl.data.preprocess gsm8k raw/gsm8k data/gsm8k

One module per dataset, each with ``convert(record, split, index)``, ``SPLIT_MAP`` and
``DATA_SOURCE`` (and ``output_split(record, split)`` where a subset gets a file of its own);
the instructions appended to prompts are verl's, so scores compare.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

from meshrl.data.errors import DataError
from meshrl.data.preprocess import gsm8k, gsm8k_tool, hellaswag, hh_rlhf, math_dataset
from meshrl.data.preprocess.common import Converted, convert_files, same_split, write_splits

log = logging.getLogger(__name__)

PREPROCESSORS: dict[str, ModuleType] = {
    "gsm8k": gsm8k,
    "gsm8k_tool": gsm8k_tool,
    "math": math_dataset,
    "hellaswag": hellaswag,
    "hh_rlhf": hh_rlhf,
    "full_hh_rlhf": hh_rlhf,
}


def convert(name: str, input_path: str | Path) -> Converted:
    """The rows (per output split) and skip counts of dataset `name` read from `input_path`."""
    if name not in PREPROCESSORS:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(PREPROCESSORS)}")
    module = PREPROCESSORS[name]
    output_split = getattr(module, "output_split", same_split)
    return convert_files(input_path, module.convert, module.SPLIT_MAP, output_split)


def run(name: str, input_path: str | Path, output_dir: str | Path) -> dict[str, int]:
    """Converts and writes ``<split>.parquet`` files; returns rows written per split."""
    result = convert(name, input_path)
    for reason, count in result.skipped.items():
        log.warning("%s: skipped %d records: %s", name, count, reason)
    written = write_splits(result.rows, output_dir)
    if not written:
        raise DataError(f"{name}: no rows converted from {input_path}")
    return written
