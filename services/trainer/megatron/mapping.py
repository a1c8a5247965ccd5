"""Hugging Face <-> Megatron-Core weight names and layouts, for Llama and Qwen2 decoders built
with Megatron's local (torch-native) layer spec. Pure torch: no megatron import, so the
mapping is tested on every machine (tests/services/trainer/megatron/test_mapping.py).

Every tensor maps exactly (splits and concatenations only, no arithmetic):

    HF                                           Megatron (decoder.layers.{i}.)
    model.embed_tokens.weight                    embedding.word_embeddings.weight
    model.layers.{i}.input_layernorm.weight      input_layernorm.weight
    self_attn.{q,k,v}_proj.{weight,bias}         self_attention.linear_qkv.{weight,bias}
    self_attn.o_proj.weight                      self_attention.linear_proj.weight
    model.layers.{i}.post_attention_layernorm    pre_mlp_layernorm.weight
    mlp.gate_proj.weight, mlp.up_proj.weight     mlp.linear_fc1.weight  (gate rows, then up)
    mlp.down_proj.weight                         mlp.linear_fc2.weight
    model.norm.weight                            decoder.final_layernorm.weight
    lm_head.weight (untied only)                 output_layer.weight

``linear_qkv`` holds the rows query group by query group: for group g, its
``heads_per_group`` query heads, then its key head, then its value head (Megatron's
``SelfAttention.get_query_key_value_tensors`` splits them so). mbridge's
``Bridge._weight_to_mcore_format`` does the same; its tables name the TE spec's fused norms
(``linear_qkv.layer_norm_weight``), the local spec keeps them apart (``input_layernorm``).

With tensor parallelism (size ``tp``) each rank holds a shard of the column- and row-parallel
weights (:func:`split_dim`; the rest is replicated): rank ``r`` holds block ``r`` of ``tp``
equal blocks along that dimension. The fused QKV rows are group-major, so block ``r`` is the
query groups ``r*G/tp .. (r+1)*G/tp - 1`` with their heads, keys, values (and Qwen2's biases);
``linear_fc1`` is a gated pair, so rank ``r`` holds its block of the gate rows then its block
of the up rows (Megatron's MLP chunks the local output in two).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

LAYER = "decoder.layers."
_PLAIN = {  # Megatron name inside a layer -> HF name inside model.layers.{i}.
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


# Megatron name suffix -> the dimension tensor parallelism splits (column-parallel: the
# output rows, 0; row-parallel: the input columns, 1; vocab-parallel: the rows, 0).
_SPLIT = {
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "mlp.linear_fc1.weight": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc2.weight": 1,
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
}


def split_dim(name: str) -> int | None:
    """The dimension a Megatron parameter is split along across the tensor-parallel ranks;
    None: every rank holds all of it (norms, a value head)."""
    if name in _TOP:
        return _SPLIT.get(name)
    if name.startswith(LAYER):
        return _SPLIT.get(name[len(LAYER) :].split(".", 1)[1])
    return None


def shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of the full Megatron tensor ``full`` (itself when replicated)."""
    dim = split_dim(name)
    if tp == 1 or dim is None:
        return full
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: {full.shape[dim]} rows/columns do not split over {tp} ranks")
    return full.chunk(tp, dim=dim)[rank]


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`shard`: every rank's part, in rank order -> the full tensor."""
    dim = split_dim(name)
    if len(shards) == 1 or dim is None:
        return shards[0]
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def full_shape(name: str, local: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The full shape of a parameter whose shard on one of ``tp`` ranks is ``local``."""
    dim = split_dim(name)
    if tp == 1 or dim is None:
        return tuple(local)
    return tuple(n * tp if i == dim else n for i, n in enumerate(local))


@dataclass(frozen=True)
class AttentionShape:
    """What the fused QKV layout depends on."""

    heads: int  # query heads
    groups: int  # key/value heads (query groups)
    head_dim: int

    @staticmethod
    def of(hf_config) -> AttentionShape:
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        groups = getattr(hf_config, "num_key_value_heads", None) or heads
        return AttentionShape(heads, groups, head_dim)

    @property
    def per_group(self) -> int:
        return self.heads // self.groups


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: AttentionShape) -> torch.Tensor:
    """q ``(heads*d, ...)``, k and v ``(groups*d, ...)`` -> ``((heads + 2*groups)*d, ...)``,
    group by group [q heads of g, k_g, v_g]; a weight ``(rows, hidden)`` or a bias ``(rows,)``."""
    rest = q.shape[1:]
    q = q.reshape(a.groups, a.per_group * a.head_dim, *rest)
    k = k.reshape(a.groups, a.head_dim, *rest)
    v = v.reshape(a.groups, a.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, a: AttentionShape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fuse_qkv`."""
    rest = qkv.shape[1:]
    grouped = qkv.reshape(a.groups, (a.per_group + 2) * a.head_dim, *rest)
    q, k, v = grouped.split([a.per_group * a.head_dim, a.head_dim, a.head_dim], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


def hf_names(name: str) -> list[str]:
    """The Hugging Face name(s) of one Megatron parameter; names not of the decoder (a value
    head) are their own."""
    if name in _TOP:
        return [_TOP[name]]
    if not name.startswith(LAYER):
        return [name]
    index, inner = name[len(LAYER) :].split(".", 1)
    prefix = f"model.layers.{index}."
    if inner in _PLAIN:
        return [prefix + _PLAIN[inner]]
    if inner.startswith("self_attention.linear_qkv."):
        kind = inner.rsplit(".", 1)[1]  # weight or bias
        return [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
    if inner == "mlp.linear_fc1.weight":
        return [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
    raise KeyError(f"{name}: no Hugging Face name for this Megatron parameter")


def to_hf(name: str, tensor: torch.Tensor, a: AttentionShape) -> list[tuple[str, torch.Tensor]]:
    """One Megatron parameter -> its Hugging Face tensor(s), in :func:`hf_names` order."""
    names = hf_names(name)
    if "linear_qkv" in name:
        parts: tuple[torch.Tensor, ...] = split_qkv(tensor, a)
    elif name.endswith("mlp.linear_fc1.weight"):
        parts = tuple(tensor.chunk(2, dim=0))
    else:
        parts = (tensor,)
    return list(zip(names, parts, strict=True))


def from_hf(
    names: list[str], hf: Mapping[str, torch.Tensor], a: AttentionShape
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensor of every Megatron parameter in ``names``, from a Hugging Face state dict
    (a tied model's ``lm_head.weight`` is not read: Megatron shares the embedding)."""
    for name in names:
        tensors = [hf[n] for n in hf_names(name)]
        if "linear_qkv" in name:
            q, k, v = tensors
            yield name, fuse_qkv(q, k, v, a)
        elif name.endswith("mlp.linear_fc1.weight"):
            yield name, torch.cat(tensors, dim=0)
        else:
            yield name, tensors[0]
