"""The trainer service's typed client (actor, critic or reference role), used by the
coordinator and by users alike."""

from __future__ import annotations

from meshrl.api.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from meshrl.ragged import Ragged
from meshrl.rpc.role_client import RoleClient
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from meshrl.wire import sequences_to_proto, tensor_from_proto, tensor_to_proto


class TrainerClient(RoleClient):
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
            batch=sequences_to_proto(prompts, responses),
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
        resp = self._call("ComputeValues", sequences_to_proto(prompts, responses))
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
        loss_mask: Ragged | None = None,
    ) -> dict[str, float]:
        """``loss_mask``: 1 on the response tokens the model sampled (None: all)."""
        req = trainer_pb2.PolicyUpdateRequest(
            batch=sequences_to_proto(prompts, responses, loss_mask),
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
        loss_mask: Ragged | None = None,
    ) -> dict[str, float]:
        """``loss_mask``: 1 on the response tokens the model sampled (None: all)."""
        req = trainer_pb2.ValueUpdateRequest(
            batch=sequences_to_proto(prompts, responses, loss_mask),
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

    def prepare_weights(
        self,
        version: int,
        dtype: str | None,
        bucket_bytes: int,
        delta: bool = False,
        full: bool = False,
    ) -> WeightManifest:
        req = trainer_pb2.PrepareWeightsRequest(
            version=version, dtype=dtype, bucket_bytes=bucket_bytes, delta=delta, full=full
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
