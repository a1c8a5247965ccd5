"""The Hugging Face <-> Megatron weight mapping (services/trainer/megatron/mapping.py): exact
both ways, for a Llama with grouped-query attention and a Qwen2 (q/k/v biases, tied
embeddings). Pure torch: runs without megatron-core. That Megatron reads the fused layout
as these rows say is checked by the forwards (test_megatron_backend.py)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from services.trainer.megatron.mapping import (
    AttentionShape,
    from_hf,
    full_shape,
    fuse_qkv,
    hf_names,
    shard,
    split_dim,
    split_qkv,
    to_hf,
    unshard,
)

SHAPE = dict(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def megatron_names(layers: int, qkv_bias: bool, tied: bool) -> list[str]:
    """The parameters of a GPTModel of the local spec, as megatron-core names them."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_proj.weight",
                  p + "self_attention.linear_qkv.weight"]  # fmt: skip
        names += [p + "self_attention.linear_qkv.bias"] if qkv_bias else []
        names += [p + "pre_mlp_layernorm.weight", p + "mlp.linear_fc1.weight",
                  p + "mlp.linear_fc2.weight"]  # fmt: skip
    names.append("decoder.final_layernorm.weight")
    return names if tied else [*names, "output_layer.weight"]


def random_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor random (biases too: a zero bias would hide a misplaced row)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens


@pytest.mark.parametrize(
    "model,qkv_bias,tied",
    [
        (lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False)), False, False),
        (lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True)), True, True),
    ],
    ids=["llama_gqa", "qwen2_bias_tied"],
)
def test_hf_to_megatron_and_back_is_exact(model, qkv_bias, tied):
    hf_model = model()
    hf = random_state(hf_model)
    a = AttentionShape.of(hf_model.config)
    names = megatron_names(2, qkv_bias, tied)
    mcore = dict(from_hf(names, hf, a))
    # The fused tensors have Megatron's shapes: (heads + 2 groups) x head_dim rows.
    assert mcore["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
        (4 + 2 * 2) * 16,
        64,
    )
    assert mcore["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * 96, 64)
    back = dict(item for name in names for item in to_hf(name, mcore[name], a))
    assert sorted(back) == sorted(hf)  # every HF weight once; a tied lm_head not twice
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_the_fused_qkv_is_laid_out_group_by_group():
    """Hand-made: 4 query heads over 2 groups, head size 1, so each row is its head's id.
    Megatron splits each group's rows as [its 2 query heads, its key, its value]."""
    a = AttentionShape(heads=4, groups=2, head_dim=1)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # query heads 0..3
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = fuse_qkv(q, k, v, a)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert all(torch.equal(x, y) for x, y in zip(split_qkv(fused, a), (q, k, v), strict=True))
    bias = fuse_qkv(q.flatten(), k.flatten(), v.flatten(), a)  # a bias: 1-D, the same order
    assert bias.tolist() == [10, 11, 20, 30, 12, 13, 21, 31]


def test_gate_and_up_are_linear_fc1_halves_and_unknown_names_are_refused():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    name = "decoder.layers.3.mlp.linear_fc1.weight"
    (fc1_name, fc1), = from_hf([name], {"model.layers.3.mlp.gate_proj.weight": gate,
                                       "model.layers.3.mlp.up_proj.weight": up}, AttentionShape(1, 1, 4))  # fmt: skip
    assert torch.equal(fc1[:6], gate) and torch.equal(fc1[6:], up)
    assert hf_names("value_head.weight") == ["value_head.weight"]  # the critic's, as is
    with pytest.raises(KeyError, match="no Hugging Face name"):
        hf_names("decoder.layers.0.self_attention.q_layernorm.weight")


def test_tensor_parallel_shards_split_as_megatron_lays_them_out_and_join_back_exactly():
    """Block r of the fused QKV rows is query groups r*G/tp.. with their heads, keys and
    values; fc1's is its gate block then its up block; o/down split by columns."""
    a = AttentionShape(heads=4, groups=2, head_dim=3)
    q, k, v = (torch.randn(n * 3, 8) for n in (4, 2, 2))
    qkv = fuse_qkv(q, k, v, a)
    one_group = AttentionShape(heads=2, groups=1, head_dim=3)
    for r in range(2):
        part = shard("decoder.layers.0.self_attention.linear_qkv.weight", qkv, 2, r)
        assert torch.equal(part, fuse_qkv(q[r * 6 : r * 6 + 6], k[r * 3 : r * 3 + 3],
                                          v[r * 3 : r * 3 + 3], one_group))  # fmt: skip
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    assert torch.equal(shard(fc1, torch.cat([gate, up]), 2, 1), torch.cat([gate[3:], up[3:]]))
    fc2 = torch.randn(8, 6)
    assert torch.equal(shard("decoder.layers.1.mlp.linear_fc2.weight", fc2, 2, 0), fc2[:, :3])
    names = {
        "embedding.word_embeddings.weight": torch.randn(22, 8),
        "output_layer.weight": torch.randn(22, 8),
        "decoder.layers.0.self_attention.linear_qkv.bias": torch.randn(24),
        "decoder.layers.0.self_attention.linear_qkv.weight": qkv,
        "decoder.layers.0.self_attention.linear_proj.weight": torch.randn(8, 12),
        fc1: torch.cat([gate, up]),
        "decoder.layers.0.input_layernorm.weight": torch.randn(8),
        "decoder.final_layernorm.weight": torch.randn(8),
        "value_head.weight": torch.randn(1, 8),
    }
    for name, full in names.items():
        parts = [shard(name, full, 2, r) for r in range(2)]
        assert torch.equal(unshard(name, parts), full), name
        assert full_shape(name, tuple(parts[0].shape), 2) == tuple(full.shape), name
        if split_dim(name) is None:  # replicated: every rank the whole tensor
            assert all(p is full for p in parts), name
