"""Rollout service: samples responses with the current policy weights.

engine.py        the engine interface (RolloutEngine) and its typed containers
native_engine.py the torch + transformers engine: prefill, step() loop, scoring
model_runner.py  runs the Hugging Face model (prefill / decode / scoring forward, weights)
batch.py         state of the sequences decoded together (KV cache, masks, outputs)
sampler.py       temperature / top-k / top-p sampling and sampling log-probs
worker.py        the engine behind a lock, weight syncs (no gRPC)
server.py        gRPC glue: `python -m services.rollout.server --port 50051`
"""
