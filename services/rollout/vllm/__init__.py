"""The vLLM engine: ``vllm.LLM`` behind the rollout engine interface; weights arrive in
vLLM's own worker process through a worker extension."""
