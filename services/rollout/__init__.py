"""Rollout service: samples responses with the current policy weights.

server.py    gRPC glue: `python -m services.rollout.server --port 50051`
client.py    the typed client, for the coordinator and users
convert.py   SamplingParams / GenerationResult <-> protos
types.py     SamplingParams, GenerationResult, TokenScores
worker.py    the engine behind a lock, weight syncs (no gRPC)
engine.py    the engine interface (RolloutEngine, WeightIntake)
registry.py  the engines by `actor_rollout_ref.rollout.name`: auto, native, fast, vllm
intake.py    weight intake of the engines living in this process (gloo, NCCL, CUDA IPC)
native/      the plain torch engine: prefill, decode loop, scoring on any HF causal LM
fast/        the CUDA-graph engine: static KV cache, slot refill, Triton decode kernels
vllm/        vLLM behind the same interface; weights land in its worker (extension.py)
"""
