"""Partial rollouts on real vLLM (its CPU build), through a rollout server process: a weight
sync over gloo lands while a greedy Generate runs; vLLM's engine aborts the unfinished
requests, the sync loads the new weights into vLLM's worker, and each response continues,
prefilled again under the new weights. Token by token, the versions switch once (0 to 1)
and each log-prob is what a full forward of the weights that sampled it gives
(``partial_rollout_kv=recompute``, the only way vLLM continues)."""

from __future__ import annotations

import re

import pytest
import torch
from partial_rollout_checks import full_forward_logprobs, response_rows, split_point
from rollout_server_process import Server, sync_weights, wait_for_log

from meshrl.api.v1 import common_pb2, rollout_pb2
from meshrl.config import build_config, config_to_yaml
from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_qwen2_dir
from meshrl.wire import ragged_to_proto
from services.rollout.convert import generation_from_proto
from services.rollout.native.engine import NativeEngine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.timeout(300),
]

PROMPTS = [[1, 4, 5, 6], [1, 7], [1, 8, 9]]
MAX_TOKENS = 900


def test_a_sync_mid_generate_aborts_and_continues_each_response_on_vllm(tmp_path):
    root = tmp_path / "models"
    old, new = (
        NativeEngine(
            str(make_tiny_qwen2_dir(root / name, seed=seed, hidden=128, intermediate=256,
                                    max_positions=1024))
        )
        for name, seed in [("a", 0), ("b", 1)]
    )  # fmt: skip
    server = Server(tmp_path / "rollout.log")
    try:
        tree = {
            "actor_rollout_ref": {
                "model": {"path": old.model_path},
                "rollout": {
                    "name": "vllm",
                    "partial_rollout": True,
                    "partial_rollout_kv": "recompute",
                },
            },
            "data": {"max_prompt_length": 16, "max_response_length": MAX_TOKENS},
        }
        request = common_pb2.InitializeRequest(config_yaml=config_to_yaml(build_config(tree)))
        server.stub.Initialize(request, timeout=180)
        started = len(re.findall(r"rpc Generate #\d+ started", server.log_path.read_text()))
        call = server.stub.Generate.future(
            rollout_pb2.GenerateRequest(
                prompts=ragged_to_proto(Ragged.from_lists(PROMPTS)),
                sampling=rollout_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=1),
            ),
            timeout=180,
        )
        wait_for_log(server, f"rpc Generate #{started + 1} started")
        assert sync_weights(server, new.runner.model, version=1).version == 1
        result = generation_from_proto(call.result())
        log_text = server.log_path.read_text()
    finally:
        server.stop()
    assert "vLLM 0.32" in log_text  # served by vLLM, not the native engine
    assert result.weight_version == 1 and result.token_versions is not None
    spans = 0
    for i, (response, versions, lps) in enumerate(response_rows(result)):
        k = split_point(versions, 0, 1)
        lps = torch.tensor(lps)
        if k:  # greedy: log-probs at temperature 1, the old weights' full forward
            want = full_forward_logprobs(old, PROMPTS[i], response, 1.0)[:k]
            torch.testing.assert_close(lps[:k], want, atol=1e-4, rtol=0)
        if k < len(response):  # re-prefilled: exactly the new weights' full forward
            want = full_forward_logprobs(new, PROMPTS[i], response, 1.0)[k:]
            torch.testing.assert_close(lps[k:], want, atol=1e-4, rtol=0)
            spans += 0 < k
    assert spans, "no response spans the sync: it landed before or after the generation"
