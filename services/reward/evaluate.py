"""Offline evaluation: score saved responses, per data_source.

    python -m services.reward.evaluate --data test.parquet --responses responses.jsonl \\
        [--server HOST:PORT | --reward-model DIR] [--output report.json] [--strict]
    python -m services.reward.evaluate --samples samples.jsonl [...]

The inputs (``eval_inputs``): verl-schema parquet rows joined with a responses file by row
index (rows without responses are counted as ``missing_rows``, not scored), or a samples file
(JSONL or parquet) whose rows carry ``data_source``, ``response`` and ``ground_truth``.

Per data_source: ``mean_score`` is the mean reward over responses; ``acc`` the fraction of
responses counted correct (the scorer's ``acc`` extra, which rule scorers set to
``score >= 1 - 1e-6``); ``pass@n`` the fraction of prompts with at least one correct
response; ``maj@n`` the fraction of prompts whose majority answer (the scorers' ``pred``) is
correct; ``failed`` the responses whose scorer failed (scored 0). A data_source whose scored
samples carry no ``acc`` (a reward model alone: its score is a logit, no verdict) has no
``acc``, ``pass@n`` or ``maj@n`` (``-``); the ``all`` line's are over the other data_sources.
Responses of a data_source no scorer knows are left unscored, counted per data_source
(``unscored``) and named on stderr, and the rest is scored; ``--strict`` fails the whole
evaluation on them instead, as does a run. After the table, each data_source with failed
samples is named on stderr with the first sample's reason; when every sample failed the exit
code is 1 (arguments.EVAL_EXIT_CODES).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from meshrl.config.sections import RewardConfig
from meshrl.output_paths import output_problem
from meshrl.progress_ticker import ProgressTicker
from services.reward.arguments import (
    DEFAULT_NUM_WORKERS,
    DEFAULT_TIMEOUT_S,
    EVAL_EXIT_CODES,
    RM_FLAGS,
    add_eval_arguments,
    flag_value,
    reward_config,
    reward_model_settings,
)
from services.reward.eval_inputs import (
    EvalInput,
    read_responses,
    responses_input,
    samples_input,
    to_item,
)
from services.reward.scorers.custom import CustomFunctionError
from services.reward.scorers.registry import UnknownDataSource, known_data_sources
from services.reward.types import RewardModelError, ScoreItem, ScoreOutcome

__all__ = ["evaluate", "evaluate_samples", "read_responses", "run", "summarize", "to_item"]

EXIT_SCORED, EXIT_FAILED, EXIT_BAD_ARGUMENTS = 0, 1, 2
ANY_SOURCE = "*"
"""Listed by a scorer that scores every data_source (a custom function, a reward model)."""
"""See arguments.EVAL_EXIT_CODES."""
CHUNK = 512
"""Items per Score call when scoring through a server."""
NEEDS_A_REWARD_MODEL = (
    'Rows of a data_source with no rule scorer (reward_model.style "model") are scored by a '
    "reward model: pass `--reward-model DIR` to load one in this process, or `--server "
    "HOST:PORT` of a `meshrl reward serve --reward-model DIR` (or score every row with "
    "`--custom-function FILE.py:NAME`)"
)
"""The hint of an unknown data_source when scoring in this process without a reward
model."""
WORKER_RESPAWN_S = 5.0
"""Room per sample for the server's pool to replace a worker killed at its timeout (a spawned
worker takes 1-3 s to import the scorers)."""


@dataclass
class SourceStats:
    data_source: str
    prompts: int = 0
    responses: int = 0
    mean_score: float = 0.0
    acc: float | None = 0.0
    """None when the scorer judges no response (a reward model alone)."""
    pass_at_n: float | None = 0.0
    """None as ``acc``."""
    maj_at_n: float | None = None
    """None when the scorer reads no answers (a custom function without ``pred``) or judges
    none."""
    failed: int = 0


@dataclass
class SampleResult:
    index: int
    sample: int
    """Which response of the prompt (0 for n=1)."""
    data_source: str
    score: float
    acc: float | None
    """1.0 correct, 0.0 wrong or failed; None when the scorer gives no verdict (a reward
    model alone)."""
    ok: bool
    reason: str = ""
    pred: str | None = None
    """The answer the scorer read from the response (None: it does not say)."""
    response: str = ""
    ground_truth: str = ""


@dataclass
class EvalReport:
    sources: list[SourceStats]
    overall: SourceStats
    missing_rows: int
    samples: list[SampleResult] = field(default_factory=list)
    unscored: dict[str, int] = field(default_factory=dict)
    """data_source -> its responses left unscored: no scorer knows it."""
    known: list[str] = field(default_factory=list)
    """The data_sources the scorer knows (``*``: every one), when some were unscored."""

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate(
    data_path: str | Path | list[str | Path],
    responses_path: str | Path,
    server: str | None = None,
    *,
    output: str | Path | None = None,
    cfg: RewardConfig | None = None,
    sample_timeout_s: float | None = None,
    strict: bool = False,
) -> EvalReport:
    """Scores the responses to the parquet rows (through `server` if given, else in this
    process with `cfg`). `sample_timeout_s`: each sample's limit sent to the server; None
    keeps the server's own. `strict`: a data_source no scorer knows fails the evaluation
    (ValueError) instead of being left unscored."""
    files = data_path if isinstance(data_path, list) else [data_path]
    inputs = responses_input(files, responses_path)
    return score_input(inputs, server, output, cfg, sample_timeout_s, strict)


def evaluate_samples(
    samples_path: str | Path | list[str | Path],
    server: str | None = None,
    *,
    output: str | Path | None = None,
    cfg: RewardConfig | None = None,
    sample_timeout_s: float | None = None,
    strict: bool = False,
) -> EvalReport:
    """:func:`evaluate` of samples files: rows with data_source, response, ground_truth."""
    files = samples_path if isinstance(samples_path, list) else [samples_path]
    return score_input(samples_input(files), server, output, cfg, sample_timeout_s, strict)


def score_input(
    inputs: EvalInput,
    server: str | None,
    output: str | Path | None = None,
    cfg: RewardConfig | None = None,
    sample_timeout_s: float | None = None,
    strict: bool = False,
) -> EvalReport:
    """Scores what the scorer knows of `inputs` and reports it (see :func:`evaluate`)."""
    cfg = cfg or RewardConfig()
    known = _known_data_sources(server, cfg)
    accepts_any = ANY_SOURCE in known
    scorable = [i for i, it in enumerate(inputs.items) if accepts_any or it.data_source in known]
    unscored: Counter[str] = Counter(
        it.data_source for it in inputs.items if not accepts_any and it.data_source not in known
    )
    if unscored and (strict or not scorable):
        name = unscored.most_common(1)[0][0]  # the commonest: likely the one to fix first
        hint = "" if cfg.reward_model.enable or server else f". {NEEDS_A_REWARD_MODEL}"
        raise ValueError(f"{UnknownDataSource(name, known)}{hint}")
    outcomes = _score([inputs.items[i] for i in scorable], server, cfg, sample_timeout_s)
    samples = []
    for i, o in zip(scorable, outcomes, strict=True):
        (index, k), it = inputs.keys[i], inputs.items[i]
        samples.append(
            SampleResult(
                index=index,
                sample=k,
                data_source=it.data_source,
                score=o.score,
                acc=_acc(o),
                ok=o.ok,
                reason=o.reason,
                pred=o.pred,
                response=it.response,
                ground_truth=it.ground_truth,
            )
        )
    report = summarize(samples, missing_rows=inputs.missing_rows)
    report.unscored = dict(sorted(unscored.items()))
    report.known = known if unscored else []
    if output is not None:
        write_report(report, output)
    return report


def _known_data_sources(server: str | None, cfg: RewardConfig) -> list[str]:
    """The data_sources the scorer knows: the server's list, or in process the rule
    scorers' (and ANY_SOURCE with a custom function or a reward model)."""
    if server is None:
        names = known_data_sources()
        accepts_any = cfg.custom_function or cfg.reward_model.enable
        return [*names, ANY_SOURCE] if accepts_any else names
    from meshrl.rpc.role_client import RoleCallError
    from services.reward.client import RewardClient

    with RewardClient(server, timeout_s=60.0) as client:
        try:
            return client.list_scorers()
        except RoleCallError as e:
            code = e.code.name if e.code is not None else "ERROR"
            raise RuntimeError(f"reward server {server}: {code}: {e.details}") from None


def _score(
    items: list[ScoreItem], server: str | None, cfg: RewardConfig, sample_timeout_s: float | None
) -> list[ScoreOutcome]:
    """The outcome of each item, in process or by the reward server at ``server``; a line on
    stderr every PROGRESS_EVERY_S (10 s) while it lasts says what it waits for (before, 79 s
    of silence with slow scorers)."""
    done = [0]  # items scored so far (by the server: a chunk at a time)
    where = f"by the reward server at {server}" if server else "in process"

    def waiting(elapsed_s: float) -> str:
        so_far = f"{done[0]} of {len(items)} scored" if server else f"{len(items)} responses"
        return f"reward eval: scoring {where}: {so_far} ({elapsed_s:.0f} s)"

    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    with ProgressTicker(waiting, say):
        return _score_all(items, server, cfg, sample_timeout_s, done)


def _score_all(
    items: list[ScoreItem],
    server: str | None,
    cfg: RewardConfig,
    sample_timeout_s: float | None,
    done: list[int],
) -> list[ScoreOutcome]:
    if server is None:
        from services.reward.scoring import RewardScorer

        with RewardScorer(cfg) as scorer:
            return scorer.score(items)
    from meshrl.rpc.role_client import RoleCallError
    from services.reward.client import RewardClient

    out: list[ScoreOutcome] = []
    # Without a limit of our own the server's applies, which we do not know: no deadline then
    # (the server's per-sample timeouts bound each call; a dead server still fails at once).
    deadline = None if sample_timeout_s is None else score_deadline_s(CHUNK, sample_timeout_s)
    with RewardClient(server, timeout_s=deadline) as client:
        for start in range(0, len(items), CHUNK):
            try:
                out.extend(client.score(items[start : start + CHUNK], sample_timeout_s or 0.0))
                done[0] = len(out)
            except RoleCallError as e:
                code = e.code.name if e.code is not None else "ERROR"
                raise RuntimeError(f"reward server {server}: {code}: {e.details}") from None
    return out


def score_deadline_s(num_items: int, per_sample_timeout_s: float) -> float:
    """A deadline for one Score call that only a dead or stuck server reaches: every sample
    may run to its timeout, one after another on a single worker. A shorter one (the client's
    300 s) failed the whole evaluation when a chunk held many slow samples."""
    return 60.0 + num_items * (per_sample_timeout_s + WORKER_RESPAWN_S)


def _acc(o: ScoreOutcome) -> float | None:
    """The scorer's verdict: its ``acc`` extra (every rule scorer and custom function gives
    one: the scorer sets it to ``score >= 1 - 1e-6`` when the function does not), 0 for a
    failed sample, None without one (a reward model alone: a logit is no verdict)."""
    if not o.ok:
        return 0.0
    return o.extra.get("acc")


def summarize(samples: list[SampleResult], missing_rows: int = 0) -> EvalReport:
    by_source: dict[str, list[SampleResult]] = defaultdict(list)
    for s in samples:
        by_source[s.data_source].append(s)
    sources = [_stats(name, group) for name, group in sorted(by_source.items())]
    judged = [s for s in samples if _judged(by_source[s.data_source])]
    return EvalReport(sources, _stats("all", samples, judged), missing_rows, samples)


def _judged(samples: list[SampleResult]) -> bool:
    """Whether the scorer of these samples (one data_source's) gives verdicts: not when its
    scored samples carry no ``acc`` (a reward model alone)."""
    return not any(s.ok and s.acc is None for s in samples)


def _stats(
    name: str, samples: list[SampleResult], judged: list[SampleResult] | None = None
) -> SourceStats:
    """`judged`: the samples that acc, pass@n and maj@n are over (default: `samples`, if
    their scorer gives verdicts)."""
    if not samples:
        return SourceStats(name)
    if judged is None:
        judged = samples if _judged(samples) else []
    n = len(samples)
    stats = SourceStats(
        data_source=name,
        prompts=len({s.index for s in samples}),
        responses=n,
        mean_score=sum(s.score for s in samples) / n,
        acc=None,
        pass_at_n=None,
        failed=sum(not s.ok for s in samples),
    )
    if judged:
        best: dict[int, float] = defaultdict(float)
        for s in judged:
            best[s.index] = max(best[s.index], s.acc or 0.0)
        stats.acc = sum(s.acc or 0.0 for s in judged) / len(judged)
        stats.pass_at_n = sum(best.values()) / len(best)
        stats.maj_at_n = _majority_accuracy(judged)
    return stats


def _majority_accuracy(samples: list[SampleResult]) -> float | None:
    """The fraction of prompts whose most given answer is correct: per prompt, the answer
    most of its responses give wins (a tie goes to the one given first; a response without
    an answer votes for "none"), and the first response giving it is judged. None when no
    response has an answer."""
    if all(s.pred is None for s in samples):
        return None
    by_prompt: dict[int, list[SampleResult]] = defaultdict(list)
    for s in samples:
        by_prompt[s.index].append(s)
    correct = 0.0
    for group in by_prompt.values():
        votes: dict[str, list[SampleResult]] = {}
        for s in group:  # dict order: first given first, so max() breaks ties by it
            votes.setdefault(s.pred or "", []).append(s)
        correct += max(votes.values(), key=len)[0].acc or 0.0
    return correct / len(by_prompt)


def format_table(report: EvalReport) -> str:
    """A fixed-width table, one line per data_source and an "all" line."""
    rows = [*report.sources, report.overall]
    width = max(len("data_source"), *(len(r.data_source) for r in rows))
    head = (
        f"{'data_source':<{width}}  prompts  responses  mean_score     acc  pass@n   maj@n  failed"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        acc, pass_at_n, maj = (_fraction(v) for v in (r.acc, r.pass_at_n, r.maj_at_n))
        lines.append(
            f"{r.data_source:<{width}}  {r.prompts:>7}  {r.responses:>9}  {r.mean_score:>10.4f}"
            f"  {acc:>6}  {pass_at_n:>6}  {maj:>6}  {r.failed:>6}"
        )
    if report.missing_rows:
        lines.append(f"({report.missing_rows} rows of the data had no response)")
    if report.unscored:
        named = ", ".join(f"{ds} {n}" for ds, n in report.unscored.items())
        lines.append(f"({sum(report.unscored.values())} responses not scored: {named})")
    return "\n".join(lines)


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def write_report(report: EvalReport, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_dict(), indent=1) + "\n")


def failure_lines(report: EvalReport) -> list[str]:
    """One line per data_source with failed samples: how many, and the first one's reason
    (otherwise only in the --output report), e.g. a custom function of the wrong signature."""
    first_reason: dict[str, str] = {}
    for s in report.samples:
        if not s.ok:
            first_reason.setdefault(s.data_source, s.reason)
    return [
        f"{s.data_source}: {s.failed} of {s.responses} samples could not be scored "
        f"(first: {first_reason[s.data_source]})"
        for s in report.sources
        if s.failed
    ]


def unscored_lines(report: EvalReport) -> list[str]:
    """One warning a data_source whose responses were left unscored, saying why and how to
    make that an error (``--strict``)."""
    return [
        f"warning: data_source {ds!r}: {n} responses not scored, no reward scorer knows it "
        f"(known: {', '.join(report.known)}); --strict makes this an error"
        for ds, n in report.unscored.items()
    ]


def in_process_flags(args: argparse.Namespace) -> dict[str, object]:
    """The flags given that only build the in-process scorer (flag -> value): a reward server
    scores with the custom function, workers and reward model it was started with.
    --timeout-s is not one: it is sent with each call."""
    flags = {
        "--custom-function": args.custom_function,
        "--num-workers": args.num_workers,
        "--reward-model": args.reward_model,
        **{flag: flag_value(args, flag) for flag in RM_FLAGS},
    }
    return {flag: value for flag, value in flags.items() if value is not None}


def input_conflict(args: argparse.Namespace) -> str | None:
    """Why the inputs given are not one of the two kinds (parquet rows and their responses,
    or samples files), or None."""
    if args.samples and (args.data or args.responses):
        return (
            "--samples cannot be used with --data or --responses: a samples file holds each "
            "row's data_source, response and ground truth itself"
        )
    if args.samples:
        return None
    if args.data and args.responses:
        return None
    if args.data:
        return "--data needs --responses FILE, the responses to its rows"
    if args.responses:
        return "--responses needs --data FILE..., the parquet rows its indexes name"
    return (
        "nothing to score: give --data FILE... with --responses FILE, or --samples FILE... "
        "of rows with data_source, response and ground_truth"
    )


def server_conflict(args: argparse.Namespace) -> str | None:
    """Why the flags given do not go with --server (they would be ignored), or None."""
    ignored = in_process_flags(args)
    if args.server is None or not ignored:
        return None
    serve_command = " ".join(f"{flag} {value}" for flag, value in ignored.items())
    *others, last = ignored
    named = f"{', '.join(others)} and {last}" if others else last
    return (
        f"{named} cannot be used with --server: the reward server at "
        f"{args.server} scores with what it was started with. Start it with them (meshrl "
        f"reward serve {serve_command}), or leave out --server to score in this process"
    )


def _in_process_config(args: argparse.Namespace) -> RewardConfig:
    """The flags given; RewardConfig's defaults for the others (ValueError naming a
    reward-model setting given without --reward-model)."""
    return reward_config(
        args.custom_function,
        DEFAULT_TIMEOUT_S if args.timeout_s is None else args.timeout_s,
        DEFAULT_NUM_WORKERS if args.num_workers is None else args.num_workers,
        args.reward_model,
        reward_model_settings(args),
    )


def report_path_problem(path: str | Path) -> str | None:
    """Why the report cannot be written at ``path`` (a folder of that name, a folder that
    cannot be made or written), asked before any sample is scored; None when it can."""
    if Path(path).is_dir():
        return "a folder of that name exists"
    return output_problem(Path(path).expanduser().absolute().parent)


def run(args: argparse.Namespace) -> int:
    """Scores, prints the table and the failures; the exit code is EVAL_EXIT_CODES'."""
    if problem := server_conflict(args):
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    try:
        cfg = _in_process_config(args)
    except ValueError as e:  # a reward-model setting without --reward-model
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    if problem := input_conflict(args):
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    if args.output and (problem := report_path_problem(args.output)):
        print(f"error: --output {args.output}: cannot write the report there: {problem}",
              file=sys.stderr)  # fmt: skip
        return EXIT_BAD_ARGUMENTS
    settings = {
        "output": args.output,
        "cfg": cfg,
        "sample_timeout_s": args.timeout_s,
        "strict": args.strict,
    }
    try:
        if args.samples:
            report = evaluate_samples(args.samples, args.server, **settings)
        else:
            report = evaluate(args.data, args.responses, args.server, **settings)
    except CustomFunctionError as e:  # --custom-function names nothing loadable: an argument
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    except RewardModelError as e:  # --reward-model is no loadable reward model: an argument
        print(f"error: {e.naming('--reward-model')}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    print(format_table(report), flush=True)  # before the failures, which go to stderr
    for line in [*unscored_lines(report), *failure_lines(report)]:
        print(line, file=sys.stderr)
    every_sample_failed = 0 < report.overall.responses == report.overall.failed
    return EXIT_FAILED if every_sample_failed else EXIT_SCORED


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.reward.evaluate",
        description=__doc__.split("\n")[0],
        epilog=EVAL_EXIT_CODES,
    )
    add_eval_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
