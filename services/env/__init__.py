"""The environment service: episodes of a multi-turn rollout (Reset, Step, Close over gRPC),
with a sandboxed calculator tool and a guessing dialogue shipped."""
