"""A CUDA out-of-memory error inside a role server, as one line: the role, the call, the
phase of the memory plan (meshrl/config/memory_plan.py) and what would lower the need. The
server answers RESOURCE_EXHAUSTED with it; the coordinator does not retry (the same step
would need the same memory) and the run ends with that line."""

from __future__ import annotations

OUT_OF_MEMORY = "out of GPU memory"
"""How such a RESOURCE_EXHAUSTED's message begins (a gRPC size limit's begins otherwise)."""

# The phase each role call belongs to (the memory plan's names).
CALL_PHASES = {
    "Generate": "generate",
    "ComputeLogProbs": "infer",
    "ComputeValues": "infer",
    "UpdateValue": "update_critic",
    "UpdatePolicy": "update_actor",
    "PrepareWeights": "sync",
    "SendWeights": "sync",
    "ReceiveWeights": "sync",
    "ResumeMemory": "generate",
}


def out_of_memory_line(role: str, call: str, error: BaseException, advice: list[str]) -> str:
    """``error``'s first line, with the role, the call, its phase and ``advice``."""
    text = str(error).strip()
    said = text.splitlines()[0] if text else type(error).__name__
    phase = CALL_PHASES.get(call, call)
    tips = "; to fit, set " + ", or ".join(advice) if advice else ""
    return f"{OUT_OF_MEMORY}: {role} during {call} ({phase}): {said}{tips}"
