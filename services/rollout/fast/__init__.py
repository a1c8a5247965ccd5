"""The fast engine for CUDA: static KV cache, slot refill, decode steps as CUDA graphs over
fused GEMMs and Triton kernels (Llama / Qwen2 architectures)."""
