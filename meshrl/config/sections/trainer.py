"""``trainer``: run length, validation, checkpoints, loggers, device and seeds, and the
async-training section."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator

from meshrl.config.sections.base import OneOrList, PathText, Section


def _verl_logger_name(value: object) -> object:
    # verl's `file` logger writes each step's metrics as a JSON line, as `jsonl` does here
    return "jsonl" if value == "file" else value


LoggerName = Annotated[
    Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"],
    BeforeValidator(_verl_logger_name),
]


def _default_loggers() -> list[LoggerName]:
    return ["console", "jsonl"]


class AsyncTrainingConfig(Section):
    """Fully asynchronous training (verl's fully-async recipe names the section so): rollout
    generates continuously into a bounded buffer while the trainers train on what is in it
    (docs/algorithms.md §33)."""

    enable: bool = False
    """Rollout generates batch after batch without waiting for the trainers, each sample
    tagged with the weight version of each of its tokens; a step trains on the next
    `data.train_batch_size` prompts of the buffer whose samples are at most `max_staleness`
    versions behind the actor. The loss then weighs each token by its behaviour policy
    (decoupled PPO: `actor.tis_imp_ratio_cap` defaults to 2 here). Not with
    trainer.one_step_off_policy, algorithm.filter_groups.enable nor rollout.multi_turn."""
    max_staleness: int = Field(1, ge=1)
    """How many weight versions a sample may be behind the actor that trains on it, counted
    from its oldest token (1: as one step off policy, at most)."""
    stale: Literal["wait", "drop"] = "wait"
    """What keeps the bound: `wait`, rollout does not start a batch that would be trained
    past it (it idles instead); `drop`, rollout never waits for the trainers, and the
    prompts whose samples are past the bound when a step takes them are dropped
    (`async/dropped_samples`)."""
    buffer_batches: int = Field(2, ge=1)
    """Batches of `data.train_batch_size` prompts the buffer holds at most, the one being
    generated included: rollout waits while it is full."""


class TrainerConfig(Section):
    project_name: str = "meshrl"
    """The run's project: in the default run folder, the wandb project, the MLflow experiment,
    the TensorBoard folder under `$TENSORBOARD_DIR`."""
    experiment_name: str = "run"
    """The run's name: in the default run folder, the wandb and MLflow run name, the
    TensorBoard folder under `$TENSORBOARD_DIR`."""
    total_epochs: int = Field(1, gt=0)
    """Passes over the training prompts when total_training_steps is None: the run's steps are
    total_epochs × the whole batches of train_batch_size (gen_batch_size with dynamic sampling)
    in the data. verl's default is 30."""
    total_training_steps: int | None = Field(None, gt=0)
    """Stop after this many PPO steps (None = total_epochs over the data)."""
    test_freq: int = -1
    """Validate every this many steps (and at the end); -1 = never."""
    val_before_train: bool = False
    """Validate before training starts (or resumes) when data.val_files is set (verl's
    default is true)."""
    val_only: bool = False
    """Validate once, with the weights the run starts from (the checkpoint `resume_mode`
    finds or names, else the model), log it, and end without training (needs
    data.val_files; data.train_files may be left out and, if given, is not read).
    Evaluates a checkpoint with the run's own validation settings."""
    one_step_off_policy: bool = False
    """Generate step k+1's batch while step k scores, infers and updates, with the weights
    rollout serves meanwhile (step k-1's): rollout works while the trainers do, and each
    batch is one update behind the actor that trains on it (`rollout/weight_lag` 1), as
    verl's one-step off-policy recipe. Pays when rollout computes on devices of its own; on
    a GPU shared with the trainers, rollout keeps its KV cache while they run. Not with
    algorithm.filter_groups.enable (docs/algorithms.md §31)."""
    async_training: AsyncTrainingConfig = Field(default_factory=AsyncTrainingConfig)
    """Fully asynchronous training with a staleness bound (docs/algorithms.md §33)."""
    save_freq: int = -1
    """Checkpoint every this many steps and at the last step; -1 = never (as verl)."""
    max_ckpt_to_keep: int | None = Field(None, ge=0)
    """Keep the newest N checkpoints; None or 0 = all."""
    resume_mode: PathText = "auto"
    """auto (latest complete checkpoint of the run folder), disable, or a checkpoint path."""
    resume_allow_config_changes: bool = False
    """Resume even from a checkpoint saved under a config its state does not fit (another
    adv_estimator, a critic added or dropped, other LoRA settings, a model of other
    shapes) or with a learning rate moved more than 10x: refused otherwise, naming each
    change (docs/checkpoints.md). Other changes are always allowed, and listed."""

    @field_validator("resume_mode")
    @classmethod
    def _resume_mode_is_a_path_not_verls_word(cls, value: str) -> str:
        # verl writes resume_mode=resume_path + resume_from_path=<path>; read here as a
        # path, "resume_path" would only fail later as a folder that does not exist.
        if value == "resume_path":
            raise ValueError(
                "trainer.resume_mode=resume_path is verl's spelling: here resume_mode takes "
                "the checkpoint path itself (trainer.resume_mode=runs/p/e/checkpoints/"
                "global_step_40)"
            )
        return value

    default_local_dir: PathText = "runs/${trainer.project_name}/${trainer.experiment_name}"
    """Run folder: metrics, checkpoints, logs."""
    logger: OneOrList[LoggerName] = Field(default_factory=_default_loggers)
    """Where step metrics go (one name alone is a list of one): the console,
    `<run folder>/metrics.jsonl`, TensorBoard event files in `<run folder>/tensorboard` or
    `$TENSORBOARD_DIR/<project>/<experiment>`
    (`pip install 'meshrl[tensorboard]'`), a Weights & Biases run named
    `<project_name>` / `<experiment_name>`, its files in the run folder or `$WANDB_DIR`,
    online or offline as `$WANDB_MODE` says (`pip install 'meshrl[wandb]'`), and an MLflow
    run `<experiment_name>` in experiment `<project_name>` at `$MLFLOW_TRACKING_URI`, else
    in `<run folder>/mlflow.db` (`pip install 'meshrl[mlflow]'`)."""

    @field_validator("logger")
    @classmethod
    def _each_logger_once(cls, value: list[str]) -> list[str]:
        # verl's `file` is `jsonl` here: [jsonl, file] would write every line twice
        return list(dict.fromkeys(value))

    device: Literal["cpu", "cuda"] = "cpu"
    """Where the rollout and trainer roles compute: cpu (the default here; verl's is cuda) or
    cuda. cpu on a machine with GPUs warns at start (local launcher)."""
    seed: int = 1
    """Seed of sampling and of model init where a fresh head is made."""
    rpc_timeout_s: float = Field(600.0, gt=0)
    """Deadline of each RPC to a role server."""
    plot: bool = True
    """Write metrics.png (score, KL, response length) at the end."""
    rollout_data_dir: PathText | None = None
    """Write each step's generations (prompt, response, ground truth, score, reward extras)
    to `<dir>/<step>.jsonl`; a relative path is under the run folder. None: not written."""
    validation_data_dir: PathText | None = None
    """The same for each validation's generations."""
    log_val_generations: int = Field(0, ge=0)
    """Show this many validation samples (input, output, score) in the loggers that keep
    tables, at each validation: a wandb table `val/generations` (a row a validation, as
    verl's), an MLflow artifact `val_generations/step_<k>.json`, TensorBoard text
    `val/generations`. The same prompts every time (picked with `trainer.seed`). 0: none."""
