"""Device memory of each role, per phase of a PPO step, estimated from the model's shape and
the config before any server starts; summed over the roles that share a GPU.

Every role is a process of its own, so what co-located roles hold adds up: the trainers'
float32 masters, AdamW moments, gradients and activations, the reference's weights, the
rollout engine's weights and KV cache. What a role holds depends on the phase:

    generate       rollout decodes; the trainers hold what they keep between calls
    infer          actor (old log-probs), critic (values), ref: forward passes together
    update_critic  the critic's update; the actor holds its weights (and, on one rank, the
                   compute-dtype copy its log-prob pass kept for its update)
    update_actor   the actor's update; the critic holds what it keeps between calls
    sync           the actor streams its weights to rollout

A GPU's need is the largest phase. The figures are estimates, from the formulas below,
within a few percent of what an H100 showed for the 0.5B and 1.5B shapes (docs/memory.md);
``launcher.check_gpu_memory=false`` skips the check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from meshrl.config.placement import hands_gpu_memory_over
from meshrl.config.schema import RunConfig
from meshrl.config.sections import ActorConfig, CriticConfig

GIB = 2**30
CUDA_CONTEXT = GIB  # a process's CUDA context, cuBLAS workspaces, compiled kernels
# What a caching allocator reserves over what it hands out (H100, 0.5B step: the actor's
# update peaked at 12.6 GB allocated, 16.3 GB reserved; 1.5B: 38.3 and 44.4).
ALLOCATOR_SLACK = 1.25
HEAD_CHUNK_ROWS = 2048  # services/trainer/chunked_head.py: positions per LM-head chunk
VLLM_WORKSPACE = 4 * GIB  # vLLM's profiled activations and CUDA graphs beside weights + cache
FAST_PREFILL_TOKENS = 16384  # the fast engine's prefill chunk (its activation reserve)
PHASES = ("generate", "infer", "update_critic", "update_actor", "sync")
# Share of the device the plan may fill: the caching allocators fragment what they hold.
USABLE = 0.95


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Hugging Face decoder that its memory depends on."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    max_positions: int = 2048

    @staticmethod
    def from_config(config: dict) -> ModelShape:
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        return ModelShape(
            hidden=hidden,
            layers=config["num_hidden_layers"],
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            tied=bool(config.get("tie_word_embeddings", False)),
            max_positions=int(config.get("max_position_embeddings") or 2048),
        )

    @staticmethod
    def from_folder(path: str | Path) -> ModelShape:
        return ModelShape.from_config(json.loads((Path(path) / "config.json").read_text()))

    @property
    def layer_params(self) -> int:
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * q + 2 * self.hidden * kv + q + 2 * kv  # q,o; k,v; biases
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        """Parameters of the causal LM (embeddings, LM head unless tied, layers, norm)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.layer_params + self.hidden

    @property
    def value_params(self) -> int:
        """A value model on the same decoder: no LM head, a one-output value head."""
        return self.vocab * self.hidden + self.layers * self.layer_params + 2 * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def activation_bytes(self, tokens: int, dtype_bytes: int, checkpointing: bool) -> int:
        """What backward needs of a micro-batch of ``tokens``: per token and layer about
        10 hidden-wide and 3 intermediate-wide tensors (q/k/v/o, norms, residuals; gate, up,
        their product), or, recomputed, each layer's input plus one layer's worth."""
        per_layer = dtype_bytes * (10 * self.hidden + 3 * self.intermediate) * tokens
        if not checkpointing:
            return self.layers * per_layer
        return self.layers * dtype_bytes * self.hidden * tokens + per_layer

    def forward_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """A forward without gradients: a few tensors of one layer live at a time."""
        return dtype_bytes * (4 * self.hidden + 2 * self.intermediate) * tokens


@dataclass
class RoleMemory:
    """One role's estimated bytes on its GPU in each phase, and what they are made of at
    its own peak (for the refusal's advice)."""

    role: str
    gpu: str
    phases: dict[str, int]
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.phases.values())


@dataclass(frozen=True)
class GpuPlan:
    gpu: str
    roles: list[RoleMemory]

    def total(self, phase: str) -> int:
        return sum(r.phases[phase] for r in self.roles)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)

    def describe(self) -> str:
        phase = self.peak_phase
        roles = ", ".join(f"{r.role} {r.phases[phase] / GIB:.1f}" for r in self.roles)
        return f"GPU {self.gpu}: {self.peak / GIB:.1f} GiB at {phase} ({roles} GiB)"


def _dtype_bytes(dtype: str | None) -> int:
    return 4 if dtype in (None, "float32") else 2


def _update_tokens(role: ActorConfig | CriticConfig, dynamic: bool, seq_len: int) -> int:
    if dynamic:
        return role.ppo_max_token_len_per_gpu
    return role.ppo_micro_batch_size_per_gpu * seq_len


def _trained_role(
    name: str,
    gpu: str,
    params: int,
    shape: ModelShape,
    role: ActorConfig | CriticConfig,
    cfg: RunConfig,
    lora: bool,
    checkpointing: bool,
    dtype: str | None,
    world_size: int,
    with_head: bool,
) -> RoleMemory:
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    dynamic = bool(role.use_dynamic_bsz)
    if isinstance(role, CriticConfig) and role.use_dynamic_bsz is None:
        dynamic = cfg.actor_rollout_ref.actor.use_dynamic_bsz
    b = _dtype_bytes(dtype)
    trained = params // 100 if lora else params  # LoRA adapters: about 1% at rank 32
    masters = 4 * params // world_size
    moments = 8 * trained // world_size
    grads = 4 * trained // world_size
    # one rank, the whole model one FSDP2 unit: its float32 gradient reduction buffer
    reduced = 4 * trained if world_size == 1 else 4 * trained // (world_size * shape.layers)
    # one rank gathers the whole model in the compute dtype (float32: the masters are it)
    copy = 2 * params if b == 2 and world_size == 1 else 2 * b * params // shape.layers
    tokens = _update_tokens(role, dynamic, seq_len)
    head = 2 * min(tokens, HEAD_CHUNK_ROWS) * shape.vocab * 4 if with_head else 0
    activations = shape.activation_bytes(tokens, b, checkpointing) + head
    forward = shape.forward_bytes(tokens, b) + head // 2
    kept = CUDA_CONTEXT + (0 if role.param_offload else masters)
    kept += 0 if role.optimizer_offload else moments
    infer = CUDA_CONTEXT + masters + (0 if role.optimizer_offload else moments) + copy + forward
    update = CUDA_CONTEXT + masters + moments + grads + reduced + copy + activations
    # between its log-prob pass and its update, one rank keeps the gathered copy
    waiting = kept + (copy if world_size == 1 and not role.param_offload else 0)
    own = "update_actor" if name == "actor" else "update_critic"
    other = "update_critic" if name == "actor" else "update_actor"
    bucket = 2 * cfg.actor_rollout_ref.rollout.weight_sync.bucket_bytes("cuda")
    sync = CUDA_CONTEXT + masters + bucket + (0 if role.optimizer_offload else moments)
    phases = {
        "generate": kept,
        "infer": infer,
        own: update,
        other: waiting if name == "actor" else kept,
        "sync": sync if name == "actor" else kept,
    }
    parts = {
        "float32 weights": masters,
        "optimizer moments": moments,
        "gradients": grads + reduced,
        "compute-dtype copy": copy,
        "activations": activations,
    }
    return RoleMemory(name, gpu, _with_slack(phases), parts)


def _with_slack(phases: dict[str, int]) -> dict[str, int]:
    """The allocator's reserve over its tensors (the CUDA context is not the allocator's)."""
    return {k: CUDA_CONTEXT + int(ALLOCATOR_SLACK * (v - CUDA_CONTEXT)) for k, v in phases.items()}


def _reference(gpu: str, shape: ModelShape, cfg: RunConfig) -> RoleMemory:
    ref = cfg.actor_rollout_ref.ref
    b = _dtype_bytes(cfg.actor_rollout_ref.model.dtype)
    params, world = shape.params, ref.world_size
    masters = 4 * params // world
    copy = 2 * params if b == 2 and world == 1 else 2 * b * params // shape.layers
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    tokens = ref.log_prob_micro_batch_size_per_gpu * seq_len
    forward = shape.forward_bytes(tokens, b) + min(tokens, HEAD_CHUNK_ROWS) * shape.vocab * 4
    kept = CUDA_CONTEXT + (0 if ref.param_offload else masters)
    phases = dict.fromkeys(PHASES, kept)
    phases["infer"] = CUDA_CONTEXT + masters + copy + forward
    return RoleMemory("ref", gpu, _with_slack(phases), {"float32 weights": masters})


def rollout_need_bytes(shape: ModelShape, cfg: RunConfig) -> tuple[int, int, int]:
    """(weights, KV cache, workspace) the rollout engine needs for ``max_num_seqs``
    sequences of ``max_prompt_length + max_response_length`` positions."""
    rollout = cfg.actor_rollout_ref.rollout
    b = _dtype_bytes(rollout.dtype)
    # the fast engine keeps fused q/k/v and gate/up copies beside the model's own weights
    weights = b * shape.params * (1 if rollout.name in ("vllm", "native") else 2)
    positions = rollout.max_num_seqs * (cfg.data.max_prompt_length + cfg.data.max_response_length)
    kv = positions * shape.kv_bytes_per_token(b)
    if rollout.name == "vllm":
        return weights, kv, VLLM_WORKSPACE
    # the fast engine's reserve: float32 logits of a full batch, one prefill chunk
    logits = 4 * rollout.max_num_seqs * shape.vocab * 4
    prefill = FAST_PREFILL_TOKENS * (2 * shape.intermediate + 6 * shape.hidden) * 4
    return weights, kv, logits + prefill


def vllm_memory_fraction(shape: ModelShape, cfg: RunConfig, device_bytes: int) -> float:
    """vLLM's ``gpu_memory_utilization``: what the batch needs (weights, the KV cache of
    max_num_seqs full-length sequences, vLLM's workspace), at most the configured share.
    vLLM would otherwise fill the whole share with KV cache it never uses."""
    need = sum(rollout_need_bytes(shape, cfg))
    cap = cfg.actor_rollout_ref.rollout.gpu_memory_utilization
    return min(cap, round(need / device_bytes + 0.005, 3))


def _rollout(gpu: str, shape: ModelShape, cfg: RunConfig, device_bytes: int) -> RoleMemory:
    rollout = cfg.actor_rollout_ref.rollout
    weights, kv, workspace = rollout_need_bytes(shape, cfg)
    cap = int(rollout.gpu_memory_utilization * device_bytes)
    if rollout.name == "vllm":
        generating = int(vllm_memory_fraction(shape, cfg, device_bytes) * device_bytes)
        # asleep (level 1): weights in CPU memory, cache discarded
        idle = CUDA_CONTEXT + GIB if hands_gpu_memory_over(cfg) else generating
    else:
        kv = min(kv, max(0, cap - weights - workspace))
        generating = CUDA_CONTEXT + weights + kv + workspace
        idle = CUDA_CONTEXT + weights + (0 if hands_gpu_memory_over(cfg) else kv)
    overlapped = cfg.trainer.one_step_off_policy or cfg.trainer.async_training.enable
    phases = dict.fromkeys(PHASES, generating if overlapped else idle)
    phases["generate"] = generating
    return RoleMemory("rollout", gpu, _with_slack(phases), {"weights": weights, "KV cache": kv})


def _gpu_of(cfg: RunConfig, role: str) -> str:
    """The first GPU a role's server sees (unplaced roles: GPU 0)."""
    return cfg.launcher.role_gpus.get(role, "0").split(",")[0].strip()


def role_memory(cfg: RunConfig, shape: ModelShape, device_bytes: int) -> list[RoleMemory]:
    """Each GPU role's estimate (rollout replicas on one GPU count once each)."""
    arr = cfg.actor_rollout_ref
    roles: list[RoleMemory] = []
    for _ in range(arr.rollout.replicas):
        roles.append(_rollout(_gpu_of(cfg, "rollout"), shape, cfg, device_bytes))
    if not cfg.trainer.val_only:
        roles.append(
            _trained_role(
                "actor", _gpu_of(cfg, "actor"), shape.params, shape, arr.actor, cfg,
                arr.model.lora_rank > 0, bool(arr.model.enable_gradient_checkpointing),
                arr.model.dtype, arr.actor.world_size, with_head=True,
            )
        )  # fmt: skip
    if cfg.use_critic_server:
        critic = cfg.critic
        critic_shape = shape
        if critic.model.path and Path(critic.model.path, "config.json").is_file():
            critic_shape = ModelShape.from_folder(critic.model.path)
        roles.append(
            _trained_role(
                "critic", _gpu_of(cfg, "critic"), critic_shape.value_params, critic_shape,
                critic, cfg, critic.model.lora_rank > 0,
                bool(critic.model.enable_gradient_checkpointing),
                critic.model.dtype or arr.model.dtype, critic.world_size, with_head=False,
            )
        )  # fmt: skip
    if cfg.use_ref_server:
        roles.append(_reference(_gpu_of(cfg, "ref"), shape, cfg))
    return roles


def plan_gpus(cfg: RunConfig, shape: ModelShape, device_bytes: int) -> list[GpuPlan]:
    roles = role_memory(cfg, shape, device_bytes)
    gpus = sorted({r.gpu for r in roles})
    return [GpuPlan(g, [r for r in roles if r.gpu == g]) for g in gpus]


def advice(cfg: RunConfig) -> list[str]:
    """What would lower the estimate, of the settings not already taken."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    tips = []
    for prefix, role in (("actor_rollout_ref.actor", arr.actor), ("critic", critic)):
        if prefix == "critic" and not cfg.use_critic_server:
            continue
        for key in ("param_offload", "optimizer_offload"):
            if not getattr(role, key):
                tips.append(f"{prefix}.{key}=true")
    if cfg.use_ref_server and not arr.ref.param_offload:
        tips.append("actor_rollout_ref.ref.param_offload=true")
    if not arr.model.enable_gradient_checkpointing:
        tips.append("actor_rollout_ref.model.enable_gradient_checkpointing=true")
    tips.append("a smaller ppo_micro_batch_size_per_gpu (or ppo_max_token_len_per_gpu)")
    tips.append("a lower actor_rollout_ref.rollout.gpu_memory_utilization or max_num_seqs")
    tips.append("roles on other GPUs (launcher.role_gpus)")
    return tips


def check_plan_fits(cfg: RunConfig, shape: ModelShape, device_bytes: int) -> list[GpuPlan]:
    """The plan; ValueError in one line when a GPU's peak exceeds what it has."""
    plans = plan_gpus(cfg, shape, device_bytes)
    for plan in plans:
        if plan.peak > USABLE * device_bytes:
            phase = plan.peak_phase
            roles = " + ".join(f"{r.role} {r.phases[phase] / GIB:.1f} GiB" for r in plan.roles)
            raise ValueError(
                f"the roles on GPU {plan.gpu} need about {plan.peak / GIB:.1f} GiB at "
                f"{phase} ({roles}), more than the {device_bytes / GIB:.1f} GiB it has: set "
                + ", or ".join(advice(cfg))
                + " (launcher.check_gpu_memory=false skips this estimate)"
            )
    return plans
