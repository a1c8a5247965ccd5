"""The `meshrl` command: run, status, stop, rollout, serve, preprocess, reward, export, demo."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from meshrl.rpc.metrics_port import use_metrics_port
from services.coordinator.types import INTERRUPTED_EXIT_CODE, RunState

# Exit codes of every command: a local `meshrl run` ends as a run followed through the
# coordinator does (RunState.exit_code).
EXIT_SUCCEEDED = RunState.SUCCEEDED.exit_code
EXIT_FAILED = RunState.FAILED.exit_code
EXIT_BAD_REQUEST = RunState.REJECTED.exit_code
EXIT_STOPPED = RunState.STOPPED.exit_code
EXIT_INTERRUPTED = INTERRUPTED_EXIT_CODE


PREPROCESS_DATASETS = ("gsm8k", "gsm8k_tool", "math", "hellaswag", "hh_rlhf", "full_hh_rlhf")
"""The names of meshrl.data.preprocess.PREPROCESSORS (docs/data.md), written out so that
building the parser does not import pyarrow; tests/data/test_data_preprocess.py keeps them
equal."""


def _launcher_overrides(args: argparse.Namespace) -> list[str]:
    """--launcher / --ray-address as config overrides (after the user's, so they win)."""
    extra = [f"launcher.kind={args.launcher}"] if args.launcher else []
    if args.ray_address:
        extra += ([] if args.launcher else ["launcher.kind=ray"]) + [
            f"launcher.ray_address={args.ray_address}"
        ]
    return extra


def config_and_overrides(config: str | None, overrides: list[str]) -> tuple[str | None, list]:
    """`meshrl run`'s first argument is the config file, unless it reads as an override:
    verl's command lines (``python -m verl.trainer.main_ppo data.train_files=...``) name
    no config file, every setting a ``key=value``. A file of that name still wins."""
    if config is not None and "=" in config and not Path(config).is_file():
        return None, [config, *overrides]
    return config, overrides


def _cmd_run(args: argparse.Namespace) -> int:
    config, overrides = config_and_overrides(args.config, args.overrides)
    overrides = [*overrides, *_launcher_overrides(args)]
    if args.print_config or args.cfg:
        from meshrl_app.print_config import print_resolved_config

        return print_resolved_config(config, overrides)
    if args.coordinator:
        from meshrl_app.remote import submit

        return submit(args.coordinator, config, overrides, detach=args.detach)
    from meshrl.config import ConfigError, load_config

    # A run here has no service to leave it to, nor a standard input to read a config from.
    if args.detach:
        raise ConfigError("--detach leaves a run to a coordinator service: give --coordinator")
    if config == "-":
        raise ConfigError("config '-' (standard input) is read only with --coordinator")
    from meshrl_app.graceful_stop import GracefulStop

    with GracefulStop() as stop:  # a signal from now on stops the run, even mid-import
        cfg = load_config(config, overrides)
        from meshrl_app.run_local import run_local
        from meshrl_app.run_summary import ended_line

        result = run_local(cfg, stop)
    print(ended_line(result, Path(cfg.trainer.default_local_dir)))
    return EXIT_SUCCEEDED if result.finished else EXIT_STOPPED


def _cmd_status(args: argparse.Namespace) -> int:
    from meshrl_app.remote import status
    from services.coordinator.client import default_address

    return status(args.coordinator or default_address(), args.run_id)


def _cmd_stop(args: argparse.Namespace) -> int:
    from meshrl_app.remote import stop
    from services.coordinator.client import default_address

    return stop(args.coordinator or default_address(), args.run_id)


def _cmd_rollout(args: argparse.Namespace) -> int:
    from meshrl_app.remote import rollout
    from services.coordinator.client import default_address

    coordinator = args.coordinator or default_address()
    return rollout(coordinator, args.rollout_command, args.address, args.run_id)


def _cmd_serve(args: argparse.Namespace) -> int:
    use_metrics_port(args)  # MESHRL_METRICS_PORT, where every server reads it
    if args.service == "coordinator":
        from services.coordinator.server import serve as serve_coordinator

        serve_coordinator(
            host=args.host, port=50050 if args.port is None else args.port, workdir=args.workdir
        )
        return 0
    if args.service == "reward":  # options came before it (`serve --port 5 reward`)
        port = [] if args.port is None else ["--port", str(args.port)]
        return _cmd_reward(
            build_parser().parse_args(["reward", "serve", "--host", args.host, *port])
        )
    args.port = args.port or 0
    if args.service == "rollout":
        from services.rollout.server import serve as serve_rollout

        serve_rollout(host=args.host, port=args.port)
    elif args.service == "trainer":
        from services.trainer.server import serve as serve_trainer

        serve_trainer(role=args.role, host=args.host, port=args.port)
    elif args.service == "env":  # default sandbox; a run's Initialize sets its time limits
        from services.env.server import serve as serve_env

        serve_env(host=args.host, port=args.port)
    return 0


def _check_output(option: str, path: str | Path) -> None:
    """ConfigError (exit 2, one line) when ``path`` cannot take the command's output."""
    from meshrl.config import ConfigError
    from meshrl.output_paths import output_problem

    if (problem := output_problem(path)) is not None:
        raise ConfigError(f"{option} {path}: cannot write the output there: {problem}")


def _cmd_preprocess(args: argparse.Namespace) -> int:
    from meshrl.data.preprocess import run

    _check_output("--output", args.output)
    counts = run(args.dataset, args.input, args.output)
    for split, n in counts.items():
        print(f"{split}: {n} rows -> {args.output}/{split}.parquet")
    return 0


def _cmd_reward(args: argparse.Namespace) -> int:
    if args.reward_command == "serve":
        from services.reward.server import serve_from_args

        serve_from_args(args)
        return 0
    from services.reward.evaluate import run

    return run(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    _check_output("--out", args.out)
    from meshrl.progress_ticker import ProgressTicker

    def say(line: str) -> None:
        print(line, flush=True)

    # Said at once: importing torch and transformers alone took 16 s of silence on a
    # loaded machine before the demo's first line.
    say("demo: loading torch and transformers")
    with ProgressTicker(lambda s: f"demo: still loading torch and transformers ({s:.0f} s)", say):
        from meshrl_app.demo.run import run_demo

    return run_demo(out_dir=args.out, overrides=args.overrides, config_path=args.config)


def _cmd_export(args: argparse.Namespace) -> int:
    _check_output("--to", args.to)
    if args.adapter:
        from meshrl_app.export import ExportError
        from meshrl_app.export_adapter import export_adapter

        if args.role != "actor":
            raise ExportError("--adapter exports the actor's LoRA adapters only, not the critic's")
        out = export_adapter(args.checkpoint, args.to)
        print(f"exported the actor's LoRA adapters of {args.checkpoint} to {out}")
        return 0
    from meshrl_app.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.role, args.to)
    print(f"exported {args.role} of {args.checkpoint} to {out}")
    return 0


class _VersionAction(argparse.Action):
    """argparse's "version" action with the line read only when asked for (it reads three
    packages' metadata)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from meshrl.version import versions_line

        print(versions_line())  # to standard output, as argparse's own version action
        parser.exit()


def _add_coordinator_argument(parser: argparse.ArgumentParser) -> None:
    """``--coordinator HOST:PORT`` of the verbs that talk to a coordinator service."""
    from meshrl.rpc.address import host_port

    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        type=host_port,
        default=None,
        help="default: $MESHRL_COORDINATOR or 127.0.0.1:50050",
    )


def build_parser() -> argparse.ArgumentParser:
    # light: argument definitions only (no grpc, pyarrow or pydantic)
    from meshrl.rpc.address import host_port
    from meshrl.rpc.metrics_port import add_metrics_port_argument
    from services.reward.arguments import (
        DEFAULT_PORT,
        EVAL_EXIT_CODES,
        add_eval_arguments,
        add_serve_arguments,
        port_number,
    )

    p = argparse.ArgumentParser(
        prog="meshrl", description="PPO post-training as a mesh of gRPC role servers"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument(
        "--version", action=_VersionAction, help="print meshrl's, torch's and grpcio's versions"
    )
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run PPO from a YAML config (+ key=value overrides), or from overrides alone",
        description="meshrl run [CONFIG.yaml] [key=value ...]: the config file may be left "
        "out, as in verl's command lines (every setting a key=value).",
    )
    run.add_argument(
        "config",
        nargs="?",
        default=None,
        help="YAML run config ('-' = stdin with --coordinator); optional",
    )
    # default=[]: argparse names a "*" positional without one among the required arguments
    run.add_argument(
        "overrides",
        nargs="*",
        default=[],
        help="dotted overrides, e.g. data.train_batch_size=64",
    )
    run.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        type=host_port,
        default=None,
        help="submit to a coordinator service and follow the run (Ctrl-C stops it)",
    )
    run.add_argument("--detach", action="store_true", help="with --coordinator: submit and return")
    run.add_argument(
        "--launcher",
        choices=["local", "ray", "external"],
        default=None,
        help="how role servers start (launcher.kind; default: the config's, local)",
    )
    run.add_argument(
        "--ray-address",
        metavar="ADDR",
        default=None,
        help="Ray cluster to place role servers on (implies --launcher ray)",
    )
    run.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (file, overrides, defaults) as YAML and exit; "
        "starts nothing",
    )
    run.add_argument(
        "--cfg", choices=["job", "all"], default=None, help="Hydra's spelling of --print-config"
    )
    run.set_defaults(fn=_cmd_run)

    status = sub.add_parser("status", help="runs of a coordinator service")
    status.add_argument("run_id", nargs="?", default=None, help="one run (default: all)")
    _add_coordinator_argument(status)
    status.set_defaults(fn=_cmd_status)

    stop = sub.add_parser(
        "stop", help="stop a run on a coordinator service (after its current step)"
    )
    stop.add_argument("run_id")
    _add_coordinator_argument(stop)
    stop.set_defaults(fn=_cmd_stop)

    pool = sub.add_parser(
        "rollout", help="add or remove a rollout replica of a run on a coordinator service"
    )
    pool_sub = pool.add_subparsers(dest="rollout_command", required=True)
    for verb, what in (
        ("add", "a running rollout server joins the run's pool at its next step"),
        ("remove", "a replica leaves the run's pool at its next step (its server runs on)"),
    ):
        change = pool_sub.add_parser(verb, help=what)
        change.add_argument("address", type=host_port, help="the rollout server's HOST:PORT")
        change.add_argument("--run-id", required=True, help="the run (meshrl status lists them)")
        _add_coordinator_argument(change)
        change.set_defaults(fn=_cmd_rollout)

    serve = sub.add_parser(
        "serve",
        help="start one role server, or the coordinator service",
        description="`meshrl serve reward` is `meshrl reward serve`, with its arguments.",
    )
    serve.add_argument("service", choices=["rollout", "trainer", "reward", "coordinator", "env"])
    serve.add_argument("--role", choices=["actor", "critic", "ref"], default="actor")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument(
        "--port",
        type=port_number,
        default=None,
        help="default: 50050 for the coordinator, else any free port",
    )
    serve.add_argument("--workdir", default=".", help="coordinator: base of relative run folders")
    add_metrics_port_argument(serve)
    serve.set_defaults(fn=_cmd_serve)

    pre = sub.add_parser("preprocess", help="convert a raw data set to verl-schema parquet")
    pre.add_argument(
        "dataset", choices=PREPROCESS_DATASETS, help="full_hh_rlhf is another name of hh_rlhf"
    )
    pre.add_argument("--input", required=True, help="raw file or folder on local disk")
    pre.add_argument("--output", required=True, help="folder for train.parquet / test.parquet")
    pre.set_defaults(fn=_cmd_preprocess)

    reward = sub.add_parser("reward", help="the reward service on its own")
    rsub = reward.add_subparsers(dest="reward_command", required=True)
    rserve = rsub.add_parser("serve", help="start the reward server")
    add_serve_arguments(rserve, default_port=DEFAULT_PORT)
    rserve.set_defaults(fn=_cmd_reward)
    reval = rsub.add_parser(
        "eval",
        help="accuracy per data_source of saved responses (to a parquet set, or in samples files)",
        epilog=EVAL_EXIT_CODES,
    )
    add_eval_arguments(reval)
    reval.set_defaults(fn=_cmd_reward)

    export = sub.add_parser(
        "export", help="a step checkpoint's actor or critic as a Hugging Face folder"
    )
    export.add_argument("checkpoint", help="a checkpoints/global_step_<k> folder")
    export.add_argument("--role", choices=["actor", "critic"], default="actor")
    export.add_argument("--to", required=True, help="output folder")
    export.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA actor's adapters alone, as a peft adapter folder (without it: the whole "
        "model with the adapters merged)",
    )
    export.set_defaults(fn=_cmd_export)

    demo = sub.add_parser(
        "demo", help="the embedded default: PPO on a tiny model learning addition"
    )
    demo.add_argument("--out", default="demo_out", help="output folder")
    demo.add_argument(
        "--config", default=None, help="another config to run on the demo task (examples/)"
    )
    demo.add_argument("overrides", nargs="*", default=[], help="dotted config overrides")
    demo.set_defaults(fn=_cmd_demo)
    return p


def _loaded_error_types(*names: str) -> tuple[type[BaseException], ...]:
    """The error classes named "module:Class" whose modules are loaded. One whose module was
    never imported cannot have been raised, and importing it only to match an exception
    held every error message (a bad --config, Ctrl-C) back 4 s: meshrl_app.export loads torch,
    the coordinator's modules take 1.4 s."""
    out = []
    for name in names:
        module, cls = name.split(":")
        if module in sys.modules:
            out.append(getattr(sys.modules[module], cls))
    return tuple(out)


BAD_REQUEST_ERRORS = (
    "meshrl.config.loader:ConfigError",
    "meshrl.rpc.server:ServerBindError",  # `meshrl serve` on a port in use
    "meshrl.data.errors:DataError",
    "meshrl_app.export:ExportError",
)
"""The request itself is wrong (exit 2): its message names what to change."""
FAILURE_ERRORS = (
    "services.coordinator.recovery.checkpointing:CheckpointError",
    "meshrl.rpc.client:ServiceUnavailable",
    "meshrl.rpc.role_client:RoleCallError",
    "services.coordinator.client:CoordinatorError",
    "services.coordinator.step.dynamic_sampling:FilterGroupsExhausted",
    "services.coordinator.step.ppo_step:RewardFailedEverySample",
)
"""The work could not go on (exit 1): a role failing past its restarts, a lost service, a
checkpoint that cannot be read or written, a batch with no sample scored. The message says
all a user needs."""


def reward_serve_spelled_once(argv: list[str]) -> list[str]:
    """`meshrl serve reward ...` as `meshrl reward serve ...`: one reward server command,
    with one set of arguments and defaults (port 50051, --custom-function, --reward-model).
    Before, `serve reward` took none of them and listened on any free port."""
    commands = [i for i, a in enumerate(argv) if not a.startswith("-")][:2]
    if [argv[i] for i in commands] == ["serve", "reward"]:
        first, second = commands
        return [*argv[:first], "reward", "serve", *argv[second + 1 :]]
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = reward_serve_spelled_once(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.fn(args)
    except _loaded_error_types(*BAD_REQUEST_ERRORS) as e:
        print(f"meshrl: {e}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    except _loaded_error_types(*FAILURE_ERRORS) as e:
        print(f"meshrl: {e}", file=sys.stderr)
        return EXIT_FAILED
    except _loaded_error_types("services.coordinator.types:StoppedBeforeStart") as e:
        print(f"meshrl: {e}; every role server stopped, nothing trained", file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        if args.fn is _cmd_run and not _run_handles_signals():
            # a first Ctrl-C before `meshrl run` could install its handler: nothing started
            print("meshrl: stopped by SIGINT before the run started", file=sys.stderr)
            return EXIT_STOPPED
        print("meshrl: interrupted; all role servers stopped", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run_handles_signals() -> bool:
    """Whether `meshrl run` had installed its signal handling (then a KeyboardInterrupt is
    a second signal, or the run's own: exit 130)."""
    stop = sys.modules.get("meshrl_app.graceful_stop")
    return stop is not None and stop.GracefulStop.installed


if __name__ == "__main__":
    sys.exit(main())
