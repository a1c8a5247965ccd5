"""What offline evaluation scores, read from its two kinds of input, each checked line by line.

- verl-schema parquet files (``--data``) and a responses file (``--responses``) that names
  rows by index: ``{"index": i, "response": "..."}`` or ``{"index": i, "responses": [...]}``
  a line; lines for the same index add up.
- a samples file (``--samples``), JSONL or parquet, each row complete in itself:
  ``data_source``, ``response`` (or ``responses``, a list), ``ground_truth``, and optional
  ``extra_info`` (an object), ``prompt`` (for a reward model) and ``index`` (the prompt's id:
  rows of one index are n responses to one prompt, for pass@n and maj@n; default: the row's
  position in the file).

A file that cannot be read, or a row of the wrong shape, is a ValueError naming the file
(and the line or row).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrl.data.rows import RawRow, read_rows
from services.reward.types import ScoreItem

SAMPLE_FIELDS = '{"data_source": str, "response": str, "ground_truth": str}'
"""A samples row's required fields, as the errors name them."""
RESPONSE_LINE = '{"index": int, "response": str} or {"index": int, "responses": [str, ...]}'
"""A responses line's shape, as the errors name it."""


@dataclass
class EvalInput:
    """The responses to score: ``keys[i]`` = (prompt index, which response of the prompt)
    of ``items[i]``; ``missing_rows``: data rows that got no response."""

    keys: list[tuple[int, int]] = field(default_factory=list)
    items: list[ScoreItem] = field(default_factory=list)
    missing_rows: int = 0


def responses_input(data_files: list[str | Path], responses_path: str | Path) -> EvalInput:
    """The rows of the parquet files joined with the responses file by index."""
    rows = read_rows(data_files)
    responses = read_responses(responses_path, len(rows))
    out = EvalInput()
    for i in sorted(responses):
        for k, response in enumerate(responses[i]):
            out.keys.append((i, k))
            out.items.append(to_item(rows[i], response))
    answered = sum(1 for r in responses.values() if r)  # "responses": [] answers nothing
    out.missing_rows = len(rows) - answered
    return out


def read_responses(path: str | Path, num_rows: int) -> dict[int, list[str]]:
    """Row index -> its responses, from a responses.jsonl file; ValueError naming the file
    (and the line) when it cannot be read, a line is wrong, or it holds no line at all."""
    out: dict[int, list[str]] = defaultdict(list)
    for n, rec in _json_lines(path, "responses file", RESPONSE_LINE):
        try:
            index, responses = _parse_response_line(rec, num_rows)
        except ValueError as e:
            raise ValueError(f"{path} line {n}: {e}") from None
        out[index].extend(responses)
    if not any(out.values()):  # nothing to score: a table of zeros would say nothing true
        raise ValueError(
            f'responses file {path} holds no responses: one JSON object a line, {{"index": i, '
            f'"response": "..."}} or {{"index": i, "responses": [...]}}'
        )
    return out


def _json_lines(path: str | Path, what: str, expected: str):
    """(line number, parsed JSON) of each non-blank line; ValueError naming the file and
    line for bytes that are not UTF-8 or text that is not JSON (`expected`: the shape a
    line should have)."""
    try:
        f = open(path, "rb")  # decoded a line at a time: bad bytes are named by their line
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror or e}") from None
    with f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield n, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                reason = f"not UTF-8 text ({e.reason} at byte {e.start})"
                raise ValueError(f"{path} line {n}: {reason}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: expected {expected} (not JSON: {e})") from None


def _parse_response_line(rec: Any, num_rows: int) -> tuple[int, list[str]]:
    """(index, responses) of one responses.jsonl line; ValueError saying what is wrong."""
    try:
        index = rec["index"]
        responses = rec["responses"] if "responses" in rec else [rec["response"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"expected {RESPONSE_LINE} ({type(e).__name__}: {e})") from None
    # Checked by type, not converted: int() would make true row 1 and 1.7 row 1.
    if type(index) is not int:
        raise ValueError(f"index must be an integer, got {json.dumps(index)}")
    if not 0 <= index < num_rows:
        raise ValueError(f"index {index} is outside the data's {num_rows} rows")
    return index, _responses_of(rec, responses)


def _responses_of(rec: dict[str, Any], responses: Any) -> list[str]:
    """The line's responses, checked: a bare string of responses would be scored one
    character at a time, and of both keys one would be scored and the other dropped."""
    if "response" in rec and "responses" in rec:
        raise ValueError('both "response" and "responses": give one of them')
    if not isinstance(responses, list):
        raise ValueError(f"responses must be a list of strings, got {type(responses).__name__}")
    if "responses" not in rec and not isinstance(responses[0], str):
        raise ValueError(f"response must be a string, got {type(responses[0]).__name__}")
    if not all(isinstance(r, str) for r in responses):
        raise ValueError("responses must be strings")
    return responses


def to_item(row: RawRow, response: str) -> ScoreItem:
    prompt = row.prompt if isinstance(row.prompt, str) else json.dumps(row.prompt)
    return ScoreItem(row.data_source, response, row.ground_truth, prompt, row.extra_info)


def samples_input(paths: list[str | Path]) -> EvalInput:
    """The rows of samples files (JSONL, or parquet by its suffix), each with its response
    and ground truth; an ``index`` groups the responses to one prompt. Indexes run on across
    files: a file's row positions (its default indexes) start after the previous file's."""
    out = EvalInput()
    offset = 0
    given: Counter[int] = Counter()  # responses so far per prompt index
    for path in paths:
        if str(path).endswith(".parquet"):
            rows = _parquet_rows(path)
        else:
            lines = _json_lines(path, "samples file", SAMPLE_FIELDS)
            rows = ((f"line {n}", rec) for n, rec in lines)
        count = 0
        for where, rec in rows:
            count += 1
            try:
                index, responses, item = _parse_sample(rec, default_index=offset + count - 1)
            except ValueError as e:
                raise ValueError(f"{path} {where}: {e}") from None
            for response in responses:
                out.keys.append((index, given[index]))
                out.items.append(item(response))
                given[index] += 1
        if count == 0:
            raise ValueError(f"samples file {path} holds no rows: {SAMPLE_FIELDS} a line")
        offset += count
    return out


def _parquet_rows(path: str | Path):
    """("row n", dict) of each row of a parquet file; ValueError naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"samples file {path} is not a readable parquet file: {e}") from None
    columns = set(table.column_names)
    has_response = bool(columns & {"response", "responses"})
    missing = [
        c
        for c in ("data_source", "response", "ground_truth")
        if c not in columns and (c != "response" or not has_response)
    ]
    if missing:
        raise ValueError(
            f"samples file {path} has no column {missing[0]!r}; columns present: "
            f"{', '.join(table.column_names)}"
        )
    for n, rec in enumerate(table.to_pylist()):
        yield f"row {n}", rec


def _parse_sample(rec: Any, default_index: int):
    """(index, responses, response -> ScoreItem) of one samples row; ValueError saying what
    is wrong."""
    try:
        data_source, ground_truth = rec["data_source"], rec["ground_truth"]
        responses = rec["responses"] if "responses" in rec else [rec["response"]]
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"expected {SAMPLE_FIELDS} (or responses: [str, ...]), and optional extra_info, "
            f"prompt, index ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(data_source, str):
        raise ValueError(f"data_source must be a string, got {json.dumps(data_source)}")
    if isinstance(ground_truth, int | float) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)  # as the data loader reads a number (72 -> "72")
    if not isinstance(ground_truth, str):
        raise ValueError(f"ground_truth must be a string, got {json.dumps(ground_truth)}")
    index = rec.get("index", default_index)
    if index is None:
        index = default_index
    if type(index) is not int:
        raise ValueError(f"index must be an integer, got {json.dumps(index)}")
    extra_info = rec.get("extra_info") or {}
    if isinstance(extra_info, str):  # verl's rows sometimes hold it as JSON text
        try:
            extra_info = json.loads(extra_info)
        except json.JSONDecodeError:
            raise ValueError("extra_info is text that is not JSON") from None
    if not isinstance(extra_info, dict):
        raise ValueError(f"extra_info must be an object, got {type(extra_info).__name__}")
    prompt = rec.get("prompt") or ""
    prompt = prompt if isinstance(prompt, str) else json.dumps(prompt)
    responses = _responses_of(rec, responses)

    def item(response: str) -> ScoreItem:
        return ScoreItem(data_source, response, ground_truth, prompt, extra_info)

    return index, responses, item
