"""Our own forward of a Llama/Qwen2/Qwen3-style decoder over a static KV cache.

Hugging Face's forward re-plans its cache and masks on every call, which a CUDA graph
cannot hold; this one has fixed shapes per (rows, attended width), so one decode step is
one graph replay. It reuses the Hugging Face model's own submodules (embeddings, norms,
projections, MLPs, rotary tables), so weights are shared, never copied: ``load_weights``
on the model updates what this forward reads.

Layout: sequence s lives in cache slot ``slot[s]``; its token at position p has its key
and value at ``k[layer, slot, :, p]``. Prompts start at position 0 (no padding inside a
slot), so the position of a token is its index in the slot.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from meshrl.packed_attention import packed_causal_attention
from services.rollout.fast import kernels
from services.rollout.fast.fused_ops import FusedOps
from services.rollout.fast.fused_weights import FusedLayer, can_fuse, fuse_layer
from services.rollout.fast.kv_cache import KVShape

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
LINEAR_KERNEL_ROWS = 512
"""Above this many rows (a prefill) cuBLAS's large tiles are the better GEMMs."""


def unsupported_reason(cfg) -> str | None:
    """Why this forward cannot run a model of this Hugging Face config (None when it can)."""
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") == "dynamic":
        return "dynamic rope scaling (its table depends on the sequence length)"
    return None


# What this forward reads of a Llama/Qwen2/Qwen3 model (nn.Module types every submodule
# attribute as "Tensor | Module"): StaticDecoder views the model through _CausalLM.


class _RMSNorm(Protocol):
    weight: torch.Tensor
    variance_epsilon: float


class _Attention(Protocol):
    head_dim: int
    scaling: float
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear


class _QKNormAttention(_Attention, Protocol):
    """Qwen3's attention: an RMSNorm over each query and key head."""

    q_norm: _RMSNorm
    k_norm: _RMSNorm


class _MLP(Protocol):
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class _Layer(Protocol):
    self_attn: _Attention
    mlp: _MLP
    input_layernorm: _RMSNorm
    post_attention_layernorm: _RMSNorm


class _Rotary(Protocol):
    def __call__(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class _Decoder(Protocol):
    embed_tokens: nn.Embedding
    layers: Iterable[_Layer]
    norm: _RMSNorm
    rotary_emb: _Rotary


class _Config(Protocol):
    num_attention_heads: int
    num_key_value_heads: int


class _CausalLM(Protocol):
    config: _Config
    model: _Decoder
    lm_head: nn.Linear


class StaticDecoder:
    """Prefill and decode of a Hugging Face causal LM over a :class:`StaticKVCache` view."""

    def __init__(self, model: nn.Module):
        reason = unsupported_reason(model.config)
        if reason is not None:
            raise ValueError(f"the static decoder cannot run this model: {reason}")
        lm = cast(_CausalLM, model)
        cfg = lm.config
        self.model = model
        base = lm.model
        self.embed = base.embed_tokens
        self.layers = list(base.layers)
        self.norm = base.norm
        self.lm_head = lm.lm_head
        self.rotary = base.rotary_emb
        attn = self.layers[0].self_attn
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.groups = self.num_heads // self.kv_heads
        self.scaling = attn.scaling
        self.dtype = self.embed.weight.dtype
        self.device: torch.device = self.embed.weight.device
        self.eps = self.norm.variance_epsilon
        self.silu = getattr(cfg, "hidden_act", "silu") == "silu"
        self.ops = FusedOps(compile=False)
        self.fused: list[FusedLayer] | None = None
        if all(can_fuse(layer) for layer in self.layers):
            # The modules' q/k/v and gate/up weights become views of one buffer each.
            self.fused = [fuse_layer(layer) for layer in self.layers]
        self.triton_mlp = kernels.available(self.device)
        """SiLU-times-up of the fused gate/up projection as a Triton kernel."""
        triton_attention = self.triton_mlp and kernels.supports_head_dim(self.head_dim)
        self.attention = "triton" if triton_attention else "matmul"
        """Decode attention: "triton" (one kernel: rope, cache write, grouped-query
        flash-decoding over the slot; CUDA), "matmul" (grouped heads as rows of one
        batched matmul) or "sdpa" (the same, through scaled_dot_product_attention)."""
        self.linear_kernels = False
        """Decode-step projections (up to ``LINEAR_KERNEL_ROWS`` rows) as the Triton GEMMs of
        :mod:`kernels.matmul`, gate/up with SiLU x up fused, instead of cuBLAS. Off: only
        with configs tuned for the GPU and shape (``benchmarks/rollout/matmul.py``) did they
        match cuBLAS on the H200 (within 1%), and their default configs lost by 4%."""
        self.matmul_configs: dict[
            tuple[str, int, int, int], kernels.MatmulConfig | Literal["torch"]
        ] = {}
        """(kind "linear" or "gate_up", n, k, rows) -> a tuned ``MatmulConfig``, or "torch"
        where cuBLAS won for that shape; missing: the kernel's default config."""
        self.split_projections = self.triton_mlp
        """A decode step's o_proj and down_proj (up to ``LINEAR_KERNEL_ROWS`` rows) split over
        K (``kernels.partial_config``: about a wave of programs, each a short stretch of K),
        their float32 partials summed by the residual add + norm after them as it loads
        them (``kernels.add_rms_norm_partials``): no reduction kernel, and one kernel for the
        add + norm. Off: cuBLAS and the compiled add + norm. On the H200 a step was 1.02x
        to 1.07x faster at every row bucket from 16 to 256, 1.04x at 256
        (``benchmarks/rollout/split_k.py``; docs/benchmarks.md, "Rollout engine")."""
        self.rope_in_attention = True
        """With the Triton attention, rope and the cache write inside the attention kernel
        (:func:`kernels.decode_attention_rope`, one launch a layer; 2.6% more tokens/s on the
        H200) instead of a kernel of their own before it."""
        self.pack_prompts = True
        """With the Triton attention, prefill prompts packed back to back
        (:meth:`prefill_packed`); False: right-padded through SDPA (:meth:`prefill`)."""
        self._cos = self._sin = torch.empty(0)

    def use_compiled_ops(self, on: bool) -> bool:
        """Fuses the element-wise ops with torch.compile (CUDA only); returns whether on."""
        if on and self.device.type == "cuda":
            if not self.ops.compiled:
                self.ops = FusedOps(compile=True)
        else:
            self.ops = FusedOps(compile=False)
        return self.ops.compiled

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(len(self.layers), self.kv_heads, self.head_dim, self.dtype)

    def rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (length, d) in the model dtype, from the model's own rotary module (so
        every rope type it knows, scaling included, comes out as it computes it)."""
        if self._cos.shape[0] < length:
            positions = torch.arange(length, device=self.device)[None]  # (1, length)
            probe = torch.zeros(1, device=self.device, dtype=self.dtype)
            with torch.inference_mode():
                cos, sin = self.rotary(probe, positions)
            self._cos, self._sin = cos[0].contiguous(), sin[0].contiguous()
        return self._cos, self._sin

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """``F.linear``, or the Triton GEMM for a decode step's few rows."""
        if self.linear_kernels and x.dim() == 2 and x.shape[0] <= LINEAR_KERNEL_ROWS:
            config = self.matmul_configs.get(("linear", weight.shape[0], x.shape[1], x.shape[0]))
            if config != "torch":
                return kernels.linear(x, weight, bias, config=config)
        return F.linear(x, weight, bias)

    def _qkv(self, i: int, h: torch.Tensor, lead: tuple[int, ...]):
        """q (*lead, H, d), k and v (*lead, kvh, d) of layer i, from normed hidden states
        h (*lead, hidden); views of one fused projection's output when fused."""
        attn = self.layers[i].self_attn
        if self.fused is not None:
            w = self.fused[i]
            qkv = self._linear(h, w.qkv_weight, w.qkv_bias)
            q, k, v = qkv.split([w.q_out, w.kv_out, w.kv_out], dim=-1)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.kv_heads, self.head_dim)
        v = v.view(*lead, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before rope
            qk = cast(_QKNormAttention, attn)
            q = self.ops.rms_norm(q, qk.q_norm.weight, qk.q_norm.variance_epsilon)
            k = self.ops.rms_norm(k, qk.k_norm.weight, qk.k_norm.variance_epsilon)
        return q, k, v

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        mlp = self.layers[i].mlp
        if h.dim() == 2 and self._mlp_act_fused(i):
            return self._linear(self._mlp_act(i, h), mlp.down_proj.weight, mlp.down_proj.bias)
        fused = self.fused[i] if self.fused is not None else None
        if self.silu and fused is not None and fused.gate_up_weight is not None:
            gate_up = F.linear(h, fused.gate_up_weight)
            if self.triton_mlp:  # (batch, length, 2I): the right-padded prefill's
                lead = gate_up.shape[:-1]
                act = kernels.silu_mul_halves(gate_up.reshape(-1, gate_up.shape[-1]))
                return mlp.down_proj(act.view(*lead, -1))
            return mlp.down_proj(self.ops.silu_mul_halves(gate_up))
        if self.silu:
            return mlp.down_proj(self.ops.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
        return mlp(h)

    def _mlp_act_fused(self, i: int) -> bool:
        """Whether layer i's MLP activation is SiLU x up of a fused gate/up projection on
        the Triton kernels (what :meth:`_mlp_act` computes)."""
        fused = self.fused[i] if self.fused is not None else None
        return (
            self.silu and self.triton_mlp and fused is not None and fused.gate_up_weight is not None
        )

    def _mlp_act(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """silu(h @ Wg.T) * (h @ Wu.T) of layer i, h (rows, hidden) -> (rows, I): down_proj's
        input. With ``linear_kernels``, one Triton GEMM does both (unless cuBLAS won there)."""
        fused = self.fused[i] if self.fused is not None else None
        assert fused is not None and fused.gate_up_weight is not None  # _mlp_act_fused(i)
        w = fused.gate_up_weight
        if self.linear_kernels and h.shape[0] <= LINEAR_KERNEL_ROWS:
            config = self.matmul_configs.get(("gate_up", w.shape[0] // 2, h.shape[1], h.shape[0]))
            if config != "torch":
                return kernels.gate_up_silu(h, w, config=config)
        return kernels.silu_mul_halves(F.linear(h, w))

    def _project_add_norm(self, x, a, proj: nn.Linear, norm_weight) -> tuple:
        """(x + proj(a), its RMSNorm) for a (rows, in) of a decode step: split over K with
        the partials summed by the add + norm (``split_projections``), else the projection
        whole and the compiled add + norm."""
        config = self._partial_config(a.shape[0], proj.weight)
        if config is None:
            delta = self._linear(a, proj.weight, proj.bias)
            return self.ops.add_rms_norm(x, delta, norm_weight, self.eps)
        parts = kernels.linear_partials(a, proj.weight, config)
        return kernels.add_rms_norm_partials(x, parts, norm_weight, self.eps, proj.bias)

    def _mlp_add_norm(self, i: int, x: torch.Tensor, h: torch.Tensor) -> tuple:
        """(x + layer i's MLP of h, its RMSNorm by the next norm) for a decode step."""
        down, norm = self.layers[i].mlp.down_proj, self._next_norm_weight(i)
        if not self._mlp_act_fused(i):
            return self.ops.add_rms_norm(x, self._mlp(i, h), norm, self.eps)
        return self._project_add_norm(x, self._mlp_act(i, h), down, norm)

    def _partial_config(self, rows: int, weight: torch.Tensor):
        """The split-K tiling of a ``rows``-row projection by ``weight`` (N, K) whose partials
        the add + norm after it sums, or None: that projection runs whole."""
        if not self.split_projections or rows > LINEAR_KERNEL_ROWS:
            return None
        n, k = weight.shape
        return kernels.partial_config(rows, n, k, kernels.sm_count(self.device))

    def _next_norm_weight(self, i: int) -> torch.Tensor:
        """The norm after layer i's MLP: the next layer's input norm, or the final one."""
        if i + 1 < len(self.layers):
            return self.layers[i + 1].input_layernorm.weight
        return self.norm.weight

    @torch.inference_mode()
    def prefill(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        dest_slots: torch.Tensor,
        src_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Runs right-padded prompts and stores their keys/values; returns last-token logits.

        ids (u, P) int64 right-padded; lengths (u,); caches (layers, slots, kvh, L, d);
        row ``src_rows[i]`` is stored in slot ``dest_slots[i]`` (a prompt sampled n times
        is run once and stored n times). Right padding needs no mask with causal attention:
        a real token never attends to the padding after it. Returns logits (u, V).
        """
        u, width = ids.shape
        ops = self.ops
        cos, sin = self.rope_table(width)
        cos, sin = cos[:width, None, :], sin[:width, None, :]  # (P, 1, d)
        x = self.embed(ids)  # (u, P, hidden)
        h = ops.rms_norm(x, self.layers[0].input_layernorm.weight, self.eps)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, h, (u, width))  # (u, P, h, d)
            q, k = ops.rope(q, k, cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (u, h, P, d)
            k_cache[i, dest_slots, :, :width] = k[src_rows]
            v_cache[i, dest_slots, :, :width] = v[src_rows]
            if self.groups > 1:
                k = k.repeat_interleave(self.groups, dim=1)
                v = v.repeat_interleave(self.groups, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
            o = layer.self_attn.o_proj(o.transpose(1, 2).reshape(u, width, -1))
            x, h = ops.add_rms_norm(x, o, layer.post_attention_layernorm.weight, self.eps)
            x = x + self._mlp(i, h)
            if i + 1 < len(self.layers):
                h = ops.rms_norm(x, self.layers[i + 1].input_layernorm.weight, self.eps)
        last = x[torch.arange(u, device=x.device), lengths - 1]  # (u, hidden)
        return self.lm_head(ops.rms_norm(last, self.norm.weight, self.eps))

    @property
    def packed_prefill(self) -> bool:
        """Whether prompts are prefilled packed back to back (:meth:`prefill_packed`): it
        needs the Triton rope/cache kernel, which stores each token in its slot(s)."""
        return self.attention == "triton" and self.pack_prompts

    @torch.inference_mode()
    def prefill_packed(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seq_lens: torch.Tensor,
        max_len: int,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Runs prompts packed back to back and stores their keys/values; returns each
        prompt's last-token logits (u, V).

        ids (T,) int64, the u prompts one after another; positions (T,) int64, each token's
        index in its prompt; cu_seq_lens (u + 1,) int32 offsets of the prompts; max_len the
        longest; slots (T, C) int64, the cache slots each token's key/value go to (-1:
        none; a prompt sampled n times goes to n slots). No padding is computed, and the
        rope, the rotated keys and the cache writes are one kernel per layer.
        """
        ops = self.ops
        cos_t, sin_t = self.rope_table(max_len)
        x = self.embed(ids)  # (T, hidden)
        h = ops.rms_norm(x, self.layers[0].input_layernorm.weight, self.eps)
        rows = ids.shape[0]
        k_rot = torch.empty(rows, self.kv_heads, self.head_dim, dtype=x.dtype, device=x.device)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, h, (rows,))  # (T, h, d)
            q = kernels.rope_store(
                q, k, v, cos_t, sin_t, positions, k_cache[i], v_cache[i], slots=slots, k_out=k_rot
            )
            o = packed_causal_attention(
                q, k_rot, v.contiguous(), cu_seq_lens, max_len, self.scaling
            )  # (T, H, d)
            o = layer.self_attn.o_proj(o.reshape(rows, -1))
            x, h = ops.add_rms_norm(x, o, layer.post_attention_layernorm.weight, self.eps)
            x, h = ops.add_rms_norm(x, self._mlp(i, h), self._next_norm_weight(i), self.eps)
        return self.lm_head(h[cu_seq_lens[1:].long() - 1])  # h: the final norm's output

    @torch.inference_mode()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        """One token for each of the first ``bs`` slots; returns logits (bs, V).

        tokens, positions (bs,) int64: the token fed to slot s sits at ``positions[s]``;
        its key/value is written there and it attends to positions ``0..positions[s]``,
        read from the first ``width`` positions of the slot (a fixed shape per width, so
        a graph captured once replays for every step with positions < width).
        """
        bs = tokens.shape[0]
        ops = self.ops
        cos_t, sin_t = self.rope_table(width)
        x = self.embed(tokens)  # (bs, hidden)
        h = ops.rms_norm(x, self.layers[0].input_layernorm.weight, self.eps)
        if self.attention == "triton":
            attend = self._triton_attention(positions, k_cache, v_cache, cos_t, sin_t, width)
        else:
            attend = self._torch_attention(positions, k_cache, v_cache, cos_t, sin_t, width)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, h, (bs,))  # (bs, h, d)
            o = attend(i, q, k, v)  # (bs, H, d)
            o = o.reshape(bs, -1)
            x, h = self._project_add_norm(
                x, o, layer.self_attn.o_proj, layer.post_attention_layernorm.weight
            )
            x, h = self._mlp_add_norm(i, x, h)
        return self.lm_head(h)

    def _triton_attention(self, positions, k_cache, v_cache, cos_t, sin_t, width):
        """Layer i's attention as two kernels: rope + cache write, then flash-decoding
        over each row's first ``positions + 1`` keys (nothing past them is read)."""
        if self.rope_in_attention:

            def attend_fused(i, q, k, v):
                return kernels.decode_attention_rope(
                    q, k, v, cos_t, sin_t, positions, k_cache[i], v_cache[i], self.scaling, width
                )

            return attend_fused
        # A finished slot keeps stepping until the host sees it; never read past `width`.
        lengths = (positions + 1).clamp(max=width)

        def attend(i, q, k, v):
            q = kernels.rope_store(q, k, v, cos_t, sin_t, positions, k_cache[i], v_cache[i])
            return kernels.decode_attention(q, k_cache[i], v_cache[i], lengths, self.scaling, width)

        return attend

    def _torch_attention(self, positions, k_cache, v_cache, cos_t, sin_t, width):
        """Layer i's attention in torch ops over the first ``width`` positions, masked."""
        bs = positions.shape[0]
        ops = self.ops
        cos, sin = cos_t[positions][:, None, :], sin_t[positions][:, None, :]  # (bs, 1, d)
        rows = torch.arange(bs, device=positions.device)
        span = torch.arange(width, device=positions.device)
        keep = (span[None, :] <= positions[:, None])[:, None, None, :]  # (bs, 1, 1, w)
        bias = None
        if self.attention == "matmul":
            bias = torch.zeros(keep.shape, dtype=torch.float32, device=positions.device)
            bias.masked_fill_(~keep, float("-inf"))

        def attend(i, q, k, v):
            q, k = ops.rope(q, k, cos, sin)
            k_cache[i, rows, :, positions] = k
            v_cache[i, rows, :, positions] = v
            keys = k_cache[i, :bs, :, :width]  # (bs, kvh, w, d), a strided view
            values = v_cache[i, :bs, :, :width]
            # Grouped-query attention without repeating keys: the g query heads of one kv
            # head are the g "query positions" of one attention against that head's keys.
            qg = q.view(bs, self.kv_heads, self.groups, self.head_dim)  # (bs, kvh, g, d)
            if bias is None:
                o = F.scaled_dot_product_attention(
                    qg, keys, values, attn_mask=keep, scale=self.scaling
                )
            else:
                scores = torch.matmul(qg, keys.transpose(-1, -2))  # (bs, kvh, g, w)
                o = torch.matmul(
                    ops.masked_softmax(scores, self.scaling, bias, values.dtype), values
                )  # (bs, kvh, g, d)
            return o

        return attend
