"""The plain torch engine: eager forward passes with a growing KV cache (CPU and GPU)."""
