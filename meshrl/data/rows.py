"""Reading verl-schema parquet files into typed rows, with errors that name file and column.

verl's schema, one row per prompt::

    data_source   str                       e.g. "openai/gsm8k"; picks the reward scorer
    prompt        list[{role, content}] | str
    ability       str                       optional, e.g. "math"
    reward_model  {style, ground_truth, ...}
    extra_info    {split, index, ...}       optional

Files written by verl's preprocess scripts (via Hugging Face `datasets`) load as they are.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from meshrl.data.errors import DataError

log = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("data_source", "reward_model")
OPTIONAL_COLUMNS = ("ability", "extra_info")


@dataclass
class RawRow:
    """One parquet row, before rendering and tokenization."""

    index: int
    """Position of the row across all files read (0-based, file order); stable under filtering."""
    source_file: str
    row_in_file: int
    data_source: str
    prompt: list[dict[str, str]] | str
    ability: str = ""
    ground_truth: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    no_truth: str = ""
    """Why the row has no ground truth to score against, naming the column
    (``reward_model is null``); "" when it has one."""

    @property
    def where(self) -> str:
        return f"{self.source_file} row {self.row_in_file}"


def read_table(path: str | Path, columns: list[str]) -> pa.Table:
    """Reads `columns` of one parquet file; every way this can fail becomes a DataError."""
    path = Path(path)
    if not path.exists():
        # a relative path is read from this process's working directory: through the
        # coordinator service, the service's own, which the user may not have in mind
        where = "" if path.is_absolute() else f" (looked for {path.absolute()})"
        raise DataError(f"data file {path} does not exist{where}")
    if path.is_dir():
        raise DataError(f"data file {path} is a folder; give the parquet files themselves")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable parquet file: {e}") from None
    present = list(schema.names)
    for col in columns:
        if col not in present:
            raise DataError(
                f"{path} has no column {col!r}; columns present: {', '.join(present) or 'none'}"
            )
    wanted = columns + [c for c in OPTIONAL_COLUMNS if c in present and c not in columns]
    try:
        table = pq.read_table(path, columns=wanted)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is a malformed parquet file: {e}") from None
    if table.num_rows == 0:
        raise DataError(f"{path} holds no rows")
    return table


def read_rows(files: list[str | Path], prompt_key: str = "prompt") -> list[RawRow]:
    """All rows of `files`, in order. Raises DataError on a missing file, column or bad row."""
    if not files:
        raise DataError("no data files given")
    rows: list[RawRow] = []
    without_truth: list[str] = []  # rule rows with no ground_truth
    for path in files:
        table = read_table(path, [prompt_key, *REQUIRED_COLUMNS])
        for i, rec in enumerate(table.to_pylist()):
            rows.append(_to_row(rec, str(path), i, len(rows), prompt_key))
            if _rule_without_truth(rec):
                without_truth.append(f"{rows[-1].where} (reward_model keys: {_keys(rec)})")
    if without_truth:
        # A warning, not an error: a custom function or a reward model may need none. For the
        # rule scorers every response of such a row scores 0, e.g. after a misspelt key.
        log.warning(
            "%d rows of style 'rule' have no reward_model.ground_truth, which the rule scorers "
            "compare with (they score them 0); the first: %s",
            len(without_truth),
            without_truth[0],
        )
    return rows


def _rule_without_truth(rec: dict) -> bool:
    reward_model = rec.get("reward_model") or {}
    return reward_model.get("style") == "rule" and reward_model.get("ground_truth") is None


def _keys(rec: dict) -> str:
    return ", ".join(k for k, v in (rec.get("reward_model") or {}).items() if v is not None)


def _to_row(rec: dict, path: str, row_in_file: int, index: int, prompt_key: str) -> RawRow:
    where = f"{path} row {row_in_file}"
    prompt = _check_prompt(rec.get(prompt_key), where, prompt_key)
    reward_model = rec.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise DataError(
            f"{where}: reward_model must be a struct, got {type(reward_model).__name__}"
        )
    extra_info = _as_dict(rec.get("extra_info"), where)
    # verl's HellaSwag rows keep the candidate endings in reward_model.choices; scorers only
    # see extra_info, so they travel there too.
    if reward_model.get("choices") is not None and "choices" not in extra_info:
        extra_info["choices"] = list(reward_model["choices"])
    gt = reward_model.get("ground_truth")
    return RawRow(
        no_truth=_no_truth(rec.get("reward_model"), gt),
        index=index,
        source_file=path,
        row_in_file=row_in_file,
        data_source=str(rec.get("data_source") or ""),
        prompt=prompt,
        ability=str(rec.get("ability") or ""),
        ground_truth="" if gt is None else _gt_to_str(gt),
        extra_info=extra_info,
    )


def _no_truth(reward_model: Any, gt: Any) -> str:
    if reward_model is None:
        return "column reward_model is null"
    if gt is None:
        return "reward_model.ground_truth is missing (null)"
    if isinstance(gt, str) and not gt.strip():
        return "reward_model.ground_truth is empty"
    return ""


def _gt_to_str(gt: Any) -> str:
    # Ground truths are strings in verl's rule datasets; an int (HellaSwag's label) or a list
    # is written so that a scorer can read it back unambiguously.
    if isinstance(gt, str):
        return gt
    if isinstance(gt, (list, dict)):
        return json.dumps(gt)
    return str(gt)


def _check_prompt(prompt: Any, where: str, key: str) -> list[dict[str, str]] | str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        messages = []
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or "content" not in m or "role" not in m:
                raise DataError(f"{where}: {key} must be a list of {{role, content}} messages")
            # A message written without a field has it null in parquet (one struct type for
            # every message): read as "" or "None" it trained on a prompt that says nothing.
            missing = [f for f in ("role", "content") if m[f] is None]
            if missing:
                what = " and no ".join(missing)
                raise DataError(f"{where}: {key} message {i} has no {what} (null)")
            messages.append({"role": str(m["role"]), "content": str(m["content"])})
        return messages
    raise DataError(f"{where}: {key} must be a chat message list or a string, got {prompt!r:.80}")


def _as_dict(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):  # some writers store extra_info as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"{where}: extra_info is a string but not JSON") from None
    if not isinstance(value, dict):
        raise DataError(f"{where}: extra_info must be a struct, got {type(value).__name__}")
    return dict(value)
