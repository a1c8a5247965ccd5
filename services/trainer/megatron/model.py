"""A Megatron-Core GPTModel built from a Hugging Face config, wearing the Hugging Face call
convention the trainer's forwards use (``model(input_ids=..., logits_to_keep=...).logits``,
or a critic's ``(b, t)`` values), so that the roles' log-prob, value and loss code is the
FSDP2 backend's, unchanged.

The layers are Megatron's local (torch-native) spec: no Transformer Engine, no apex. Its
core attention is swapped for torch's ``scaled_dot_product_attention`` (flash attention on a
GPU; Megatron's local one builds the full ``(b, heads, s, s)`` scores in a CUDA buffer).
Rows are right-padded (``sequences.pack_sequences``), so a causal mask is the whole mask: a
real token never sees a padding token after it, and the padding positions are never read.

With tensor parallelism the linear layers are Megatron's column- and row-parallel ones and
the embedding and output layer are split by vocabulary; the LM head gathers each chunk's
vocabulary-parallel logits (:class:`VocabGather`) and scores them as one rank does, so the
log-probs and entropies are those of the unsplit model.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

from services.trainer.chunked_head import ChunkedLMHead

SUPPORTED = ("llama", "qwen2")  # model_type of config.json


class SdpaAttention(MegatronModule):
    """Megatron's core-attention slot filled by torch SDPA: ``[s, b, heads, d]`` query,
    ``[s, b, groups, d]`` key and value -> ``[s, b, heads * d]``, causal."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__(config=config)
        self.scale = kwargs.get("softmax_scale") or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask=None, **kwargs):
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # (b, heads, s, d)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        s, b = out.shape[2], out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def rope_theta(hf_config) -> float:
    """transformers 5 keeps it in ``rope_parameters``; earlier releases on the config."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(hf_config, "rope_scaling", None)
    if rope_type != "default" or (scaling and scaling.get("rope_type", "default") != "default"):
        raise ValueError(
            f"rope scaling {rope_type!r}: the Megatron backend builds plain RoPE only yet"
        )
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    return float(theta)


def transformer_config(hf_config, tensor_parallel: int = 1) -> TransformerConfig:
    """Megatron's config of a Llama or Qwen2 decoder, split over ``tensor_parallel`` ranks;
    float32 parameters (the masters: a bf16 compute dtype is autocast in the forward,
    :class:`MegatronLM`)."""
    if hf_config.model_type not in SUPPORTED:
        raise ValueError(
            f"model_type {hf_config.model_type!r}: the Megatron backend builds "
            f"{', '.join(SUPPORTED)} (strategy=fsdp2 builds any causal LM)"
        )
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    # Qwen2 has q/k/v biases; Llama only with attention_bias.
    qkv_bias = hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", 0))
    return TransformerConfig(
        tensor_model_parallel_size=tensor_parallel,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight is overwritten from the HF folder
        # the fused kernels are CUDA/TE ones; these are the torch paths
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def build_gpt(hf_config, recompute: bool, with_lm_head: bool, tensor_parallel: int = 1) -> GPTModel:
    """This rank's shard of the decoder on the CPU, its weights uninitialised; without
    ``with_lm_head`` (the critic) no output layer is kept. ``tensor_parallel`` must be the
    size of Megatron's tensor-parallel group (``parallel_state``)."""
    config = transformer_config(hf_config, tensor_parallel)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    gpt = GPTModel(
        config,
        spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        share_embeddings_and_output_weights=tied and with_lm_head,
        parallel_output=False,
    )
    if not with_lm_head:
        gpt.output_layer = None
    if recompute:
        recompute_layers(gpt)
    return gpt


def recompute_layers(gpt: GPTModel) -> None:
    """Each decoder layer's activations recomputed in backward (the role's
    ``enable_gradient_checkpointing``), by torch's non-reentrant checkpoint, as the FSDP2
    backend's Hugging Face models do. Not Megatron's own recompute: its reentrant function
    runs the recomputation outside the forward's autocast (float32 where the forward was
    bf16) and needs CUDA's RNG tracker."""
    for layer in gpt.decoder.layers:
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed


def head_weight(gpt: GPTModel) -> nn.Parameter:
    """The LM head's weight: the embedding's when tied."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


class VocabGather(torch.autograd.Function):
    """``(..., V/tp)`` logits of this rank's vocabulary block -> ``(..., V)`` on every rank of
    the tensor-parallel group; backward keeps this rank's block of the gradient (the loss
    after it is computed alike on every rank of the group, Megatron's convention).

    Megatron's ``gather_from_tensor_model_parallel_region`` allocates on
    ``torch.cuda.current_device()``; this one runs over gloo too."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


def gather_vocab(local: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from this rank's block (see :class:`VocabGather`)."""
    return VocabGather.apply(local, parallel_state.get_tensor_model_parallel_group())


@dataclass(frozen=True)
class CausalLMOutput:
    logits: torch.Tensor  # (b, k, V), or (b, k, 2) scores after lm_head.expect


class _Net(nn.Module):
    """The parameters and the computation: what data parallelism (DDP) wraps."""

    def __init__(self, gpt: GPTModel, value_head: bool):
        super().__init__()
        self.gpt = gpt
        if value_head:  # as ValueModel's: zero, so the first values are exactly 0
            self.value_head = nn.Linear(gpt.config.hidden_size, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
        else:
            shell = nn.Linear(1, 1, bias=False, device="meta")  # carries the shared weight
            shell.weight = head_weight(gpt)
            shell.in_features, shell.out_features = shell.weight.shape[1], shell.weight.shape[0]
            head = ChunkedLMHead(shell)
            if gpt.config.tensor_model_parallel_size > 1:  # the weight is a vocabulary block
                head.gather_logits = gather_vocab
                head.out_features *= gpt.config.tensor_model_parallel_size
            # Not registered as a child: its weight is already gpt's (no second name).
            object.__setattr__(self, "lm_head", head)

    def forward(self, input_ids: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        hidden = self.gpt.embedding(input_ids=input_ids, position_ids=None)  # (s, b, h)
        rope = self.gpt.rotary_pos_emb(s)
        hidden = self.gpt.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope)
        hidden = hidden.transpose(0, 1)  # (b, s, h), final norm applied
        if hasattr(self, "value_head"):
            return self.value_head(hidden).sum(dim=-1).float()  # (b, s)
        # As transformers' logits_to_keep: an int keeps the last k positions (0: all).
        kept = hidden[:, slice(-keep, None) if isinstance(keep, int) else keep, :]
        if self.gpt.config.tensor_model_parallel_size > 1:
            # Each rank's vocabulary block gives a part of the hidden states' gradient: their
            # sum over the group in backward (Megatron's column-parallel input).
            kept = tensor_parallel.copy_to_tensor_model_parallel_region(kept)
        head: ChunkedLMHead = getattr(self, "lm_head")  # noqa: B009 - not a registered child
        return head(kept)


class MegatronLM(nn.Module):
    """A GPTModel called as a Hugging Face causal LM (``value_head``: as ``ValueModel``).

    ``config`` is the folder's Hugging Face config (vocabulary, shapes for MFU);
    ``compute_dtype`` bfloat16 autocasts the forward over the float32 masters."""

    def __init__(
        self, gpt: GPTModel, hf_config, compute_dtype: torch.dtype | None, value_head: bool
    ):
        super().__init__()
        self.net: nn.Module = _Net(gpt, value_head)
        self.config = hf_config
        self.compute_dtype = compute_dtype

    @property
    def inner(self) -> _Net:
        net = self.net
        if isinstance(net, nn.parallel.DistributedDataParallel):
            net = net.module
        assert isinstance(net, _Net)
        return net

    @property
    def gpt(self) -> GPTModel:
        return self.inner.gpt

    @property
    def lm_head(self) -> ChunkedLMHead | None:
        return getattr(self.inner, "lm_head", None)

    def get_input_embeddings(self) -> nn.Module:
        return self.gpt.embedding.word_embeddings

    def data_parallel(self, device: torch.device, group=None) -> None:
        """Gradients averaged over the data-parallel ranks (``group``; None: all) in
        backward, as FSDP2's reduce does; tensor-parallel shards keep their own."""
        ids = [device.index] if device.type == "cuda" else None
        self.net = nn.parallel.DistributedDataParallel(
            self.net, device_ids=ids, broadcast_buffers=False, process_group=group
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **unused,
    ):
        """Right-padded rows (positions 0..t-1, as ``pack_sequences`` makes them)."""
        autocast = torch.autocast(
            input_ids.device.type,
            dtype=self.compute_dtype or torch.float32,
            enabled=self.compute_dtype is not None,
        )
        with autocast:
            out = self.net(input_ids, logits_to_keep)
        return out if hasattr(self.inner, "value_head") else CausalLMOutput(out)


def on_cpu(gpt: GPTModel) -> None:
    """Megatron moves RoPE's frequencies to ``torch.cuda.current_device()`` at the first
    forward; on a CPU-only machine that call fails. The same embedding, where they are."""
    rope = gpt.rotary_pos_emb

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # (s, d/2)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # not interleaved

    rope.get_emb = types.MethodType(get_emb, rope)
