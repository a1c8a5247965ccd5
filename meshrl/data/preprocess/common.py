"""What every preprocessor shares: finding raw files, reading them, telling their split,
writing verl-schema parquet files.

Raw inputs may be one file or a folder tree of ``.jsonl``, ``.jsonl.gz``, ``.json`` (one
object, or a list of objects) and ``.parquet`` files (the Hugging Face hub's exports). The
split of a file comes from its name or the nearest folder named like a split
(``train-00000-of-00001.parquet``, ``hellaswag_val.jsonl``, ``MATH/test/algebra/1.json``),
looking no higher than the input folder itself.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from meshrl.data.errors import DataError

RAW_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")

# Name tokens -> split; "val"/"dev" are the hub's "validation".
SPLIT_TOKENS = {
    "train": "train",
    "test": "test",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "validation",
}

# convert(record, split, index) -> a verl row, or a str saying why the record is skipped.
Converter = Callable[[dict[str, Any], str, int], "dict[str, Any] | str"]
# output_split(record, split) -> the output file a record goes to (its split, unless a data set
# keeps a subset apart: MATH-500 within MATH's test split).
Router = Callable[[dict[str, Any], str], str]


def same_split(record: dict[str, Any], split: str) -> str:
    """The default :data:`Router`: every record goes to its split's file."""
    return split


@dataclass
class Converted:
    """Rows per output split, and how many raw records were skipped for each reason."""

    rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)


def find_raw_files(input_path: str | Path) -> list[Path]:
    """The raw files of `input_path` (itself, or every raw file below it, in natural order)."""
    path = Path(input_path)
    if not path.exists():
        raise DataError(f"raw input {path} does not exist")
    if path.is_file():
        return [path]
    files = [p for p in path.rglob("*") if p.is_file() and p.name.endswith(RAW_SUFFIXES)]
    files = [p for p in files if not any(part.startswith(".") for part in p.parts)]
    if not files:
        raise DataError(f"no raw files ({', '.join(RAW_SUFFIXES)}) under {path}")
    return sorted(files, key=_natural_key)


def _natural_key(p: Path) -> list:
    # 2.json before 10.json, as the files were numbered.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def split_of(path: Path, root: Path | None = None) -> str | None:
    """The split of a raw file, read from its name, then its folders up to `root` (included).

    Folders above the input root are never read: a checkout under ``/tmp/test_x/`` is not a
    test split.
    """
    parts = [path.name]
    if root is not None and root != path:
        parts += [root.name, *path.parent.relative_to(root).parts][::-1]
    for part in parts:
        for token in re.split(r"[^a-z0-9]+", part.lower()):
            if token in SPLIT_TOKENS:
                return SPLIT_TOKENS[token]
    return None


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of one raw file, as dicts."""
    name = path.name
    try:
        if name.endswith(".parquet"):
            yield from pq.read_table(path).to_pylist()
        elif name.endswith((".jsonl", ".jsonl.gz")):
            yield from _jsonl_records(path)
        else:  # .json: one record (MATH's per-problem files) or a list of them
            with _open_text(path) as f:
                obj = json.load(f)
            for record in obj if isinstance(obj, list) else [obj]:
                yield _as_record(record, str(path))
    # EOFError: a .gz file cut short ("Compressed file ended before the end-of-stream ...")
    except (json.JSONDecodeError, pa.ArrowException, OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read raw file {path}: {e}") from None


def _jsonl_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file. A bad line is named by its line in the file:
    json's own position counts within the line ("line 1 column 24")."""
    with _open_text(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                # e.msg may end in its own "at" ("Invalid control character at")
                reason = f"{e.msg.removesuffix(' at')} at column {e.colno}"
                raise DataError(f"{path} line {number}: not JSON ({reason})") from None
            yield _as_record(record, f"{path} line {number}")


def _as_record(value: Any, where: str) -> dict[str, Any]:
    # The converters read fields by name: a list or a number would fail there with a
    # traceback that names no file.
    if not isinstance(value, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(value).__name__}")
    return value


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def convert_files(
    input_path: str | Path,
    convert: Converter,
    split_map: dict[str, str] | None = None,
    output_split: Router = same_split,
) -> Converted:
    """Runs `convert` over every record; `split_map` renames raw splits (e.g.
    validation->test); `output_split` picks each record's output file."""
    out = Converted()
    root = Path(input_path)
    for path in find_raw_files(root):
        raw_split = split_of(path, root)
        if raw_split is None:
            raise DataError(
                f"cannot tell the split of {path} from its name or folders; "
                "name it (or a folder above it) train, test or validation"
            )
        split = (split_map or {}).get(raw_split, raw_split)
        for rec in read_records(path):
            rows = out.rows.setdefault(output_split(rec, split), [])
            row = convert(rec, split, len(rows))
            if isinstance(row, str):
                out.skipped[row] = out.skipped.get(row, 0) + 1
            else:
                rows.append(row)
    return out


def write_splits(rows: dict[str, list[dict[str, Any]]], output_dir: str | Path) -> dict[str, int]:
    """Writes ``<split>.parquet`` for every split with rows; returns rows written per split."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, split_rows in rows.items():
        if split_rows:
            pq.write_table(pa.Table.from_pylist(split_rows), out / f"{split}.parquet")
            written[split] = len(split_rows)
    return written


def user_prompt(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]
