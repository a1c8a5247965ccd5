"""What runs inside a scorer worker process: limits, then one sample per call.

Workers are spawned (not forked: the server has gRPC threads, and a fork of a threaded
process can deadlock), so this module imports only what a worker needs.
"""

from __future__ import annotations

import logging
import math
import os
import resource
from typing import Any

from services.reward.scorers.custom import CustomFunctionError, load_custom_function
from services.reward.scorers.registry import family_of, get_answer_reader, get_scorer
from services.reward.types import ScoreOutcome


class BadScore(Exception):
    """A scorer returned something that is not a number; the message says what."""


class ScorerError(Exception):
    """What a scorer (or a custom module, loading) raised, as ``"TypeName: message"``.

    A plain exception that always pickles back: a user's own exception class lives in a module
    loaded by path, which the server cannot import, so pebble would report a PicklingError in
    its place; and SystemExit or KeyboardInterrupt, not being Exceptions, would leave the
    server's call (or end an in-process evaluation) instead of costing their sample.
    """

    @classmethod
    def of(cls, e: BaseException) -> ScorerError:
        return cls(f"{type(e).__name__}: {e}")


def init_worker(memory_limit_mb: int | None) -> None:
    """Loads the scorers, then caps the worker's address space (a runaway scorer fails with
    MemoryError alone).

    Loading here, before the worker takes a task, keeps the import of math-verify (a second
    or more) out of the first sample's timeout, also in a worker that replaces a killed one.
    """
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    warm_up()
    if memory_limit_mb:
        limit = int(memory_limit_mb) * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def warm_up() -> int:
    """Imports every scorer family and runs it once; returns the worker's pid."""
    for data_source in ("openai/gsm8k", "lighteval/MATH", "Rowan/hellaswag"):
        get_scorer(data_source)("\\boxed{1} #### 1 (B)", "1", {})
    return os.getpid()


def check_custom(spec: str) -> str:
    """Loads the custom function once, so a bad spec fails at Initialize, not mid-run."""
    try:
        fn = load_custom_function(spec)
    except CustomFunctionError:  # our own message: no such file or function
        raise
    except BaseException as e:  # noqa: BLE001 - the user's module failed to import
        raise ScorerError.of(e) from None
    return getattr(fn, "__name__", "?")


def score_sample(
    data_source: str,
    response: str,
    ground_truth: str,
    extra_info: dict[str, Any],
    custom_function: str | None,
    rule_options: dict[str, dict[str, Any]] | None = None,
) -> ScoreOutcome:
    """One sample's outcome; raises ScorerError (what the scorer raised) or BadScore.

    ``rule_options``: keyword arguments per scorer family (``{"gsm8k": {"method":
    "lenient"}}``), given to its ``compute_score`` and ``read_answer`` alike."""
    pred = None  # a custom function gives its own, or none
    try:
        if custom_function:
            fn = load_custom_function(custom_function)
            value = fn(data_source, response, ground_truth, extra_info)
        else:
            options = (rule_options or {}).get(family_of(data_source), {})
            value = get_scorer(data_source)(response, ground_truth, extra_info, **options)
            pred = get_answer_reader(data_source)(response, extra_info, **options) or ""
    except BaseException as e:  # noqa: BLE001 - any failure is this sample's; see ScorerError
        raise ScorerError.of(e) from None
    outcome = coerce(value)
    if outcome.pred is None:
        outcome.pred = pred
    return outcome


def coerce(value: Any) -> ScoreOutcome:
    """A scorer's return value as an outcome: a finite score, its numeric extras, and its
    ``pred`` (verl's key for the extracted answer) when it gives one."""
    extra: dict[str, float] = {}
    pred = None
    if isinstance(value, dict):
        if "score" not in value:
            raise BadScore(f"returned a dict without 'score' (keys: {', '.join(map(str, value))})")
        # Only finite numbers: one NaN "acc" would make every mean over the batch NaN.
        extra = {
            str(k): float(v)
            for k, v in value.items()
            if k not in ("score", "pred") and _is_number(v) and math.isfinite(float(v))
        }
        if value.get("pred") is not None:
            pred = str(value["pred"])
        value = value["score"]
    if not _is_number(value):
        raise BadScore(f"returned {type(value).__name__}, expected a number")
    score = float(value)
    if not math.isfinite(score):
        raise BadScore(f"returned {score}, expected a finite number")
    return ScoreOutcome(score=score, extra=extra, pred=pred)


def _is_number(v: Any) -> bool:
    if isinstance(v, (bool, int, float)):
        return True
    try:  # numpy / torch scalars
        return hasattr(v, "item") and isinstance(v.item(), (bool, int, float))
    except Exception:  # noqa: BLE001 - anything that cannot say is not a number
        return False
