"""Rollout service: samples responses with the current policy weights.

engine.py        the engine interface (RolloutEngine) and its typed containers
native_engine.py the torch + transformers engine: prefill, step() loop, scoring
model_runner.py  runs the Hugging Face model (prefill / decode / scoring forward, weights)
batch.py         state of the sequences decoded together (KV cache, masks, outputs)
sampler.py       temperature / top-k / top-p sampling and sampling log-probs
fast_engine.py   the GPU fast path: static KV cache, slots kept full, graph-captured decode
decoder.py       our forward of Llama/Qwen2/Qwen3 decoders over the static cache
kv_cache.py      the static KV cache, sized from gpu_memory_utilization, releasable
cuda_graphs.py   the decode step captured per (rows, attended width)
scheduler.py     host bookkeeping of slots: admit, refill, when to check, compaction
slots.py         per-slot decoding state on the device
worker.py        the engine behind a lock, weight syncs (no gRPC)
server.py        gRPC glue: `python -m services.rollout.server --port 50051`
"""
