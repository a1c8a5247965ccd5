"""The reward service's command-line arguments, for `serve` and `eval`, each defined once and
shared by ``python -m services.reward.server`` / ``meshrl reward serve`` and
``python -m services.reward.evaluate`` / ``meshrl reward eval``.

Kept apart from the service itself so that building the `meshrl` parser does not import grpc,
pyarrow and pydantic (0.25 s on every command).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from meshrl.rpc.address import host_port
from meshrl.rpc.metrics_port import add_metrics_port_argument

DEFAULT_PORT = 50055
"""`meshrl reward serve`'s port: the reward server's in the mesh's own defaults
(deploy/compose.yaml's MESHRL_REWARD_PORT; 50050 the coordinator, 50051 rollout, 50052 to
50054 actor, critic and ref), as docs/reward.md's examples use it."""
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_NUM_WORKERS = 2
DEFAULT_RM_MAX_LENGTH = 2048
DEFAULT_RM_MICRO_BATCH_SIZE = 16
DEFAULT_RM_WEIGHT = 1.0
"""RewardModelConfig's defaults, written out for the help (tests check they agree)."""
DEFAULT_MAX_CALLS = 8
"""Score calls served at once (ScorerSlot's default too). Below the gRPC server's 16 threads,
so health checks, GetInfo and Initialize always find a thread while Score calls wait."""

EVAL_EXIT_CODES = (
    "Exit code: 0 when the responses were scored, even if some samples could not be (each "
    "data_source with failed samples is named on stderr, with the first reason); 1 when no "
    "sample could be scored (every number printed would be 0), or on a bad data or responses "
    "file or a reward server that does not answer; 2 for arguments that are wrong or do not "
    "go together."
)


def _number(kind: type[int] | type[float], text: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def _checked(kind: type[int] | type[float], ok, says: str):
    """An argparse type: a number of `kind` for which `ok(value)` holds, else "must be
    <says>, got <text>" (a comparison refuses nan too)."""

    def parse(text: str) -> int | float:
        value = _number(kind, text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {says}, got {text}")
        return value

    return parse


_finite_float = _checked(float, math.isfinite, "a finite number")
positive_int = _checked(int, lambda v: v >= 1, "at least 1")
positive_float = _checked(float, lambda v: v > 0, "more than 0")
non_negative_int = _checked(int, lambda v: v >= 0, "0 or more")
# gRPC would wrap 99999 round to 34463 without a word
port_number = _checked(int, lambda v: 0 <= v <= 65535, "0 to 65535")


def existing_folder(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"no folder {text}")
    return text


def add_serve_arguments(p: argparse.ArgumentParser, default_port: int) -> None:
    """The reward server's arguments (`default_port`: the command's own default)."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port",
        type=port_number,
        default=default_port,
        help="default %(default)s; 0 = any free port (printed at start)",
    )
    p.add_argument(
        "--custom-function",
        metavar="FILE.py:NAME",
        default=None,
        help="score with this function (as the config's reward.custom_function)",
    )
    p.add_argument(
        "--timeout-s",
        metavar="SECONDS",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        help="per-sample scorer limit in seconds (default %(default)s)",
    )
    p.add_argument(
        "--num-workers",
        metavar="N",
        type=positive_int,
        default=DEFAULT_NUM_WORKERS,
        help="scorer worker processes (default %(default)s)",
    )
    add_reward_model_arguments(p)
    p.add_argument(
        "--memory-limit-mb",
        metavar="MB",
        type=non_negative_int,
        default=None,
        help="address-space limit of each scorer worker (default 4096; 0 = none)",
    )
    p.add_argument(
        "--max-calls",
        metavar="N",
        type=positive_int,
        default=DEFAULT_MAX_CALLS,
        help="Score calls served at once (default %(default)s)",
    )
    add_metrics_port_argument(p)


RM_FLAGS = {
    "--reward-model-max-length": "max_length",
    "--reward-model-micro-batch-size": "micro_batch_size",
    "--reward-model-weight": "weight",
}
"""The flags that set `reward.reward_model` fields besides its path."""


def add_reward_model_arguments(p: argparse.ArgumentParser, where: str = "") -> None:
    """--reward-model and its settings, for `serve` and (in process, `where`) `eval`."""
    p.add_argument(
        "--reward-model",
        metavar="DIR",
        type=existing_folder,
        default=None,
        help=f"score with this reward model{where}: a local Hugging Face classification model "
        "folder",
    )
    # The reward model's other settings (a run sends them by Initialize); defaults None, to
    # tell them given: they are refused without --reward-model.
    p.add_argument(
        "--reward-model-max-length",
        metavar="TOKENS",
        type=positive_int,
        default=None,
        help="tokens of a (prompt, response) pair at most, cut from the left "
        f"(reward.reward_model.max_length; default {DEFAULT_RM_MAX_LENGTH})",
    )
    p.add_argument(
        "--reward-model-micro-batch-size",
        metavar="N",
        type=positive_int,
        default=None,
        help="pairs per reward-model forward "
        f"(reward.reward_model.micro_batch_size; default {DEFAULT_RM_MICRO_BATCH_SIZE})",
    )
    p.add_argument(
        "--reward-model-weight",
        metavar="W",
        type=_finite_float,
        default=None,
        help="score = rule + W * model score, or W * model score for a data_source "
        f"without a rule scorer (reward.reward_model.weight; default {DEFAULT_RM_WEIGHT:g})",
    )


def flag_value(args: argparse.Namespace, flag: str) -> object:
    """The parsed value of ``flag`` ("--reward-model-weight" -> args.reward_model_weight)."""
    return getattr(args, flag[2:].replace("-", "_"))


def reward_model_settings(args: argparse.Namespace) -> dict[str, object]:
    """The `reward.reward_model` fields given by `RM_FLAGS` (the others keep the config's
    defaults)."""
    given = {field: flag_value(args, flag) for flag, field in RM_FLAGS.items()}
    return {field: value for field, value in given.items() if value is not None}


def reward_config(
    custom_function: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    num_workers: int = DEFAULT_NUM_WORKERS,
    reward_model_path: str | None = None,
    reward_model_settings: dict[str, object] | None = None,
):
    """The RewardConfig the flags describe. `reward_model_settings`: other
    `reward.reward_model` fields (max_length, micro_batch_size, weight), which need
    `reward_model_path` (ValueError naming the flags otherwise)."""
    from meshrl.config.sections import RewardConfig, RewardModelConfig  # pydantic: when used

    settings = reward_model_settings or {}
    if settings and not reward_model_path:
        flags = [f for f, field in RM_FLAGS.items() if field in settings]
        verb = "needs" if len(flags) == 1 else "need"
        raise ValueError(f"{', '.join(flags) or 'reward-model settings'} {verb} --reward-model DIR")
    return RewardConfig(
        custom_function=custom_function,
        timeout_s=timeout_s,
        num_workers=num_workers,
        reward_model=RewardModelConfig(
            enable=bool(reward_model_path), path=reward_model_path or "", **settings
        ),
    )


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    """The offline evaluation's arguments."""
    p.add_argument(
        "--data",
        nargs="+",
        default=None,
        help="verl-schema parquet file(s), whose rows --responses names by index",
    )
    p.add_argument(
        "--responses",
        default=None,
        help='responses.jsonl: {"index": i, "response": "..."} (or "responses": [...]) a line',
    )
    p.add_argument(
        "--samples",
        nargs="+",
        default=None,
        metavar="FILE",
        help="instead of --data and --responses: JSONL or parquet rows, each with "
        "data_source, response (or responses) and ground_truth, and optional extra_info, "
        "prompt and index (rows of one index are responses to one prompt)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="a data_source no scorer knows fails the evaluation (default: its responses are "
        "left unscored, counted and named, and the others scored)",
    )
    p.add_argument(
        "--server",
        metavar="HOST:PORT",
        type=host_port,
        default=None,
        help="score through this reward server (default: in this process)",
    )
    p.add_argument("--output", default=None, help="write the report as JSON here")
    # The next ones build the in-process scorer: a server scores with what it was started
    # with, so they are refused with --server (their defaults are None to tell them given).
    p.add_argument(
        "--custom-function",
        metavar="FILE.py:NAME",
        default=None,
        help="score with this function (in process only; for a server, start it with "
        "`meshrl reward serve --custom-function`)",
    )
    p.add_argument(
        "--num-workers",
        metavar="N",
        type=positive_int,
        default=None,
        help=f"scorer worker processes (in process only; default {DEFAULT_NUM_WORKERS})",
    )
    add_reward_model_arguments(p, where=" (in process only)")
    p.add_argument(
        "--timeout-s",
        metavar="SECONDS",
        type=positive_float,
        default=None,
        help=f"each sample's scoring limit in seconds (default {DEFAULT_TIMEOUT_S:g} in "
        "process; with --server it is sent with each call, else the server's own applies)",
    )
