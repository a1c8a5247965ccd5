"""The rollout service's typed client, used by the coordinator and by users alike."""

from __future__ import annotations

from meshrl.api.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from meshrl.ragged import Ragged
from meshrl.rpc.role_client import RoleClient
from meshrl.weight_sync.types import WeightManifest
from meshrl.wire import ragged_to_proto, sequences_to_proto, tensor_from_proto
from services.rollout.convert import generation_from_proto, sampling_to_proto
from services.rollout.types import GenerationResult, SamplingParams


class RolloutClient(RoleClient):
    service = "rollout"

    def __init__(self, address: str, timeout_s: float):
        super().__init__(address, timeout_s)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    def generate(self, prompts: Ragged, sampling: SamplingParams) -> GenerationResult:
        """B·n responses, sample j of prompt i at row i·n + j."""
        req = rollout_pb2.GenerateRequest(
            prompts=ragged_to_proto(prompts), sampling=sampling_to_proto(sampling)
        )
        return generation_from_proto(self._call("Generate", req))

    def compute_log_probs(self, prompts: Ragged, responses: Ragged, temperature: float) -> Ragged:
        req = common_pb2.LogProbsRequest(
            batch=sequences_to_proto(prompts, responses), temperature=temperature
        )
        resp = self._call("ComputeLogProbs", req)
        return responses.with_values(tensor_from_proto(resp.logprobs).float())

    def receive_weights(
        self, manifest: WeightManifest, timeout_s: float
    ) -> common_pb2.WeightSyncResult:
        return self._call("ReceiveWeights", manifest.to_proto(), timeout_s=timeout_s)

    def set_memory_state(self, release: bool) -> int:
        """Releases or resumes the engine's memory; returns the KV cache bytes held after."""
        req = rollout_pb2.MemoryStateRequest(release=release)
        return self._call("SetMemoryState", req).kv_cache_bytes
