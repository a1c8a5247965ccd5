"""Triton kernels of the fast engine's decode step (CUDA; the tests run them in Triton's
CPU interpreter).

A decode step at a few hundred rows is bound by kernel count, not bytes: each of these
replaces several torch kernels of :meth:`StaticDecoder.decode` or of the sampler.

- :func:`rope_store` (``rope_store.py``): rope at each row's position, the rotated key and the
  value into the row's cache slot; returns the rotated q.
- :func:`decode_attention` (``attention.py``): grouped-query flash-decoding over the cache.
- :func:`decode_attention_rope` (``attention.py``): both of the above in one launch (rope,
  the cache write and the attention; the new key attended from registers).
- :func:`silu_mul_halves` (``silu.py``): SiLU(gate) x up of the fused gate/up projection.
- :func:`sample_gumbel` (``sampling.py``): a token and its log-prob per row, one pass.
- :func:`sample_inverse_cdf` (``sampling_cdf.py``): the same from one uniform per row, in two
  light passes (no random number and no log per column).
- :func:`linear` (``matmul.py``): ``F.linear`` tiled for few rows (split-K for long K).
- :func:`linear_partials` (``matmul.py``): the same product as split-K float32 partials,
  tiled by :func:`partial_config` (about one wave of programs).
- :func:`add_rms_norm_partials` (``add_norm.py``): the residual add and RMSNorm after a
  projection, summing its split-K partials as it loads them (no reduction kernel).
- :func:`gate_up_silu` (``matmul.py``): the fused gate/up projection and SiLU(gate) x up in
  one GEMM, the (rows, 2I) projection never written.

The pure-torch ``*_reference`` functions compute what the torch paths compute; the tests
check the kernels against them.
"""

from services.rollout.fast.kernels.add_norm import (
    add_rms_norm_partials,
    add_rms_norm_partials_reference,
)
from services.rollout.fast.kernels.attention import (
    KEYS_PER_SPLIT_MIN,
    MAX_SPLITS,
    decode_attention,
    decode_attention_reference,
    decode_attention_rope,
    split_count,
)
from services.rollout.fast.kernels.matmul import (
    MatmulConfig,
    default_config,
    gate_up_silu,
    linear,
    linear_partials,
    partial_config,
)
from services.rollout.fast.kernels.rope_store import rope_store, rope_store_reference
from services.rollout.fast.kernels.runtime import available, sm_count, supports_head_dim
from services.rollout.fast.kernels.sampling import sample_gumbel
from services.rollout.fast.kernels.sampling_cdf import sample_inverse_cdf
from services.rollout.fast.kernels.silu import silu_mul_halves

__all__ = [
    "KEYS_PER_SPLIT_MIN",
    "MAX_SPLITS",
    "MatmulConfig",
    "add_rms_norm_partials",
    "add_rms_norm_partials_reference",
    "available",
    "decode_attention",
    "decode_attention_reference",
    "decode_attention_rope",
    "default_config",
    "gate_up_silu",
    "linear",
    "linear_partials",
    "partial_config",
    "rope_store",
    "rope_store_reference",
    "sample_gumbel",
    "sample_inverse_cdf",
    "silu_mul_halves",
    "sm_count",
    "split_count",
    "supports_head_dim",
]
