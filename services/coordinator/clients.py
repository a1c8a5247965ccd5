"""Typed clients of the role servers: proto conversion happens here, once, at the edge.

Every call has a deadline. A failed call raises `RoleCallError` naming the service, its
address and what it was doing, so a dead server reads as "rollout at 127.0.0.1:5301 failed
during Generate: UNAVAILABLE ..." rather than a bare gRPC traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from meshrl.api.v1 import (
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from meshrl.ragged import Ragged
from meshrl.rpc.client import open_channel
from meshrl.rpc.options import message_limit
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from meshrl.wire import ragged_from_proto, ragged_to_proto, tensor_from_proto, tensor_to_proto


class RoleCallError(RuntimeError):
    """An RPC to a role server failed; the message names the server and the call."""

    def __init__(self, service: str, address: str, method: str, err: grpc.RpcError):
        self.service, self.address, self.method = service, address, method
        self.code = err.code() if hasattr(err, "code") else None
        details = err.details() if hasattr(err, "details") else str(err)
        code = self.code.name if self.code is not None else "ERROR"
        hint = ""
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            hint = (
                f" (a message over a gRPC size limit, {message_limit() >> 20} MiB in this "
                "process: lower data.train_batch_size (data.gen_batch_size) or rollout.n, or raise "
                "MESHRL_GRPC_MAX_MESSAGE_MB on every process of the run)"
            )
        super().__init__(f"{service} at {address} failed during {method}: {code}: {details}{hint}")


@dataclass(frozen=True)
class GenerationBatch:
    """What rollout returns: B·n responses, sample j of prompt i at row i·n + j."""

    responses: Ragged  # int token ids
    logprobs: Ragged  # float32, aligned with responses
    finish_reasons: list[str]  # "stop" | "length"
    weight_version: int


class _RoleClient:
    service = "role"
    stub: Any  # the subclass's gRPC stub

    def __init__(self, address: str, timeout_s: float):
        self.address = address
        self.timeout_s = timeout_s
        self.channel = open_channel(address)

    def _call(self, method: str, request, timeout_s: float | None = None):
        try:
            return getattr(self.stub, method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            raise RoleCallError(self.service, self.address, method, e) from None

    def info(self) -> common_pb2.ServerInfo:
        return self._call("GetInfo", common_pb2.GetInfoRequest(), timeout_s=10)

    def initialize(self, config_yaml: str, run_dir: str = "") -> common_pb2.ServerInfo:
        req = common_pb2.InitializeRequest(config_yaml=config_yaml, run_dir=run_dir)
        return self._call("Initialize", req).info

    def join_weight_group(self, spec: GroupSpec) -> str:
        req = common_pb2.JoinWeightGroupRequest(spec=spec.to_proto())
        return self._call("JoinWeightGroup", req, timeout_s=spec.timeout_s + 10).group_id

    def close(self) -> None:
        self.channel.close()


def _sequence_batch(prompts: Ragged, responses: Ragged) -> common_pb2.SequenceBatch:
    return common_pb2.SequenceBatch(
        prompts=ragged_to_proto(prompts), responses=ragged_to_proto(responses)
    )


_FINISH = {
    rollout_pb2.FINISH_REASON_STOP: "stop",
    rollout_pb2.FINISH_REASON_LENGTH: "length",
    rollout_pb2.FINISH_REASON_UNSPECIFIED: "unknown",
}


class RolloutClient(_RoleClient):
    service = "rollout"

    def __init__(self, address: str, timeout_s: float):
        super().__init__(address, timeout_s)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    def generate(self, prompts: Ragged, sampling: rollout_pb2.SamplingParams) -> GenerationBatch:
        req = rollout_pb2.GenerateRequest(prompts=ragged_to_proto(prompts), sampling=sampling)
        resp = self._call("Generate", req)
        responses = ragged_from_proto(resp.responses)
        logprobs = responses.with_values(tensor_from_proto(resp.logprobs).float())
        return GenerationBatch(
            responses=responses,
            logprobs=logprobs,
            finish_reasons=[_FINISH[r] for r in resp.finish_reasons],
            weight_version=resp.weight_version,
        )

    def compute_log_probs(self, prompts: Ragged, responses: Ragged, temperature: float) -> Ragged:
        req = common_pb2.LogProbsRequest(
            batch=_sequence_batch(prompts, responses), temperature=temperature
        )
        resp = self._call("ComputeLogProbs", req)
        return responses.with_values(tensor_from_proto(resp.logprobs).float())

    def receive_weights(
        self, manifest: WeightManifest, timeout_s: float
    ) -> common_pb2.WeightSyncResult:
        return self._call("ReceiveWeights", manifest.to_proto(), timeout_s=timeout_s)

    def set_memory_state(self, release: bool) -> int:
        req = rollout_pb2.MemoryStateRequest(release=release)
        return self._call("SetMemoryState", req).kv_cache_bytes


class TrainerClient(_RoleClient):
    service = "trainer"

    def __init__(self, address: str, timeout_s: float, role: str):
        super().__init__(address, timeout_s)
        self.service = role
        self.stub = trainer_pb2_grpc.TrainerServiceStub(self.channel)

    def compute_log_probs(
        self,
        prompts: Ragged,
        responses: Ragged,
        temperature: float,
        with_entropy: bool = False,
        base_model: bool = False,
    ) -> tuple[Ragged, Ragged | None]:
        """``base_model``: a LoRA actor's base weights alone (the reference policy)."""
        req = common_pb2.LogProbsRequest(
            batch=_sequence_batch(prompts, responses),
            temperature=temperature,
            with_entropy=with_entropy,
            base_model=base_model,
        )
        resp = self._call("ComputeLogProbs", req)
        logprobs = responses.with_values(tensor_from_proto(resp.logprobs).float())
        entropy = None
        if with_entropy and resp.entropy.dtype:
            entropy = responses.with_values(tensor_from_proto(resp.entropy).float())
        return logprobs, entropy

    def compute_values(self, prompts: Ragged, responses: Ragged) -> Ragged:
        resp = self._call("ComputeValues", _sequence_batch(prompts, responses))
        return responses.with_values(tensor_from_proto(resp.values).float())

    def update_policy(
        self,
        prompts: Ragged,
        responses: Ragged,
        old_logprobs: Ragged,
        advantages: Ragged,
        global_step: int,
        ref_logprobs: Ragged | None = None,
        rollout_logprobs: Ragged | None = None,
    ) -> dict[str, float]:
        req = trainer_pb2.PolicyUpdateRequest(
            batch=_sequence_batch(prompts, responses),
            old_logprobs=tensor_to_proto(old_logprobs.values.float()),
            advantages=tensor_to_proto(advantages.values.float()),
            global_step=global_step,
        )
        if ref_logprobs is not None:
            req.ref_logprobs.CopyFrom(tensor_to_proto(ref_logprobs.values.float()))
        if rollout_logprobs is not None:
            req.rollout_logprobs.CopyFrom(tensor_to_proto(rollout_logprobs.values.float()))
        return dict(self._call("UpdatePolicy", req).metrics)

    def update_value(
        self,
        prompts: Ragged,
        responses: Ragged,
        old_values: Ragged,
        returns: Ragged,
        global_step: int,
    ) -> dict[str, float]:
        req = trainer_pb2.ValueUpdateRequest(
            batch=_sequence_batch(prompts, responses),
            old_values=tensor_to_proto(old_values.values.float()),
            returns=tensor_to_proto(returns.values.float()),
            global_step=global_step,
        )
        return dict(self._call("UpdateValue", req).metrics)

    def open_weight_group(self, transport: str, world_size: int, timeout_s: float) -> GroupSpec:
        spec = common_pb2.WeightGroupSpec(
            transport=transport, world_size=world_size, rank=0, timeout_s=timeout_s
        )
        return GroupSpec.from_proto(self._call("OpenWeightGroup", spec))

    def prepare_weights(self, version: int, dtype: str | None, bucket_bytes: int) -> WeightManifest:
        req = trainer_pb2.PrepareWeightsRequest(
            version=version, dtype=dtype, bucket_bytes=bucket_bytes
        )
        return WeightManifest.from_proto(self._call("PrepareWeights", req))

    def send_weights(self, version: int, timeout_s: float) -> common_pb2.WeightSyncResult:
        req = trainer_pb2.SendWeightsRequest(version=version)
        return self._call("SendWeights", req, timeout_s=timeout_s)

    def save_checkpoint(self, path: str, with_optimizer: bool = True) -> None:
        self._call(
            "SaveCheckpoint",
            trainer_pb2.CheckpointRequest(path=path, with_optimizer=with_optimizer),
        )

    def load_checkpoint(self, path: str, with_optimizer: bool = True) -> None:
        self._call(
            "LoadCheckpoint",
            trainer_pb2.CheckpointRequest(path=path, with_optimizer=with_optimizer),
        )


@dataclass(frozen=True)
class ScoredSample:
    score: float
    ok: bool
    reason: str
    extra: dict[str, float]
    pred: str | None = None  # the answer the scorer read; None when it does not say

    @property
    def reported_acc(self) -> float | None:
        """The scorer's own ``acc`` (every rule scorer gives one); None where it gives none:
        a reward model's score is no verdict, and validation then reports the reward alone."""
        return self.extra.get("acc")

    @property
    def failure(self) -> str:
        """Why the reward service could not score the sample; "" when it did."""
        return "" if self.ok else self.reason or "not scored (no reason given)"


def sample_acc(score: float, extra: dict[str, float]) -> float:
    """A sample's accuracy: the reward's ``acc`` extra (every rule scorer gives one), else
    whether the score reached 1 (a reward model alone, a custom function without it)."""
    return extra.get("acc", float(score >= 1.0))


class RewardRoleClient(_RoleClient):
    service = "reward"

    def __init__(self, address: str, timeout_s: float):
        super().__init__(address, timeout_s)
        from meshrl.api.v1 import reward_pb2_grpc

        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)

    def score(self, items: list[dict]) -> list[ScoredSample]:
        """items: dicts with data_source, response, ground_truth, prompt, extra_info_json."""
        from meshrl.api.v1 import reward_pb2

        req = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(**it) for it in items])
        resp = self._call("Score", req)
        return [
            ScoredSample(
                r.score, r.ok, r.reason, dict(r.extra), r.pred if r.HasField("pred") else None
            )
            for r in resp.results
        ]

    def list_scorers(self) -> list[str]:
        """data_source names the server scores ("*" = any)."""
        from meshrl.api.v1 import reward_pb2

        return list(self._call("ListScorers", reward_pb2.ListScorersRequest()).data_sources)
