"""What every rank of a trainer does with each command (no gRPC here): rank 0's server hands
it the request, the other ranks get the same request over the command channel, and each
runs the role's typed call between ``convert.py``'s checks and the response proto."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from google.protobuf.message import Message

from meshrl.api.v1 import common_pb2, trainer_pb2
from meshrl.config import RunConfig, config_from_yaml
from meshrl.config.placement import hands_gpu_memory_over
from meshrl.config.roles import role_settings
from meshrl.gpus import gathered_gpu_names
from meshrl.version import package_version
from meshrl.wire import tensor_to_proto
from services.trainer.actor import ActorRole
from services.trainer.convert import (
    batch_from_proto,
    checkpoint_path,
    per_token,
    required_per_token,
)
from services.trainer.critic import CriticRole
from services.trainer.distributed import World
from services.trainer.model_loading import decoder_config
from services.trainer.reference import RefRole
from services.trainer.trained_role import TrainedRole
from services.trainer.types import SequenceBatch
from services.trainer.weight_publisher import WeightPublisher

log = logging.getLogger(__name__)

ROLES: dict[str, type[ActorRole] | type[CriticRole] | type[RefRole]] = {
    "actor": ActorRole,
    "critic": CriticRole,
    "ref": RefRole,
}

# Which roles serve which RPC (Initialize and GetInfo: all).
SERVED_BY = {
    "ComputeLogProbs": ("actor", "ref"),
    "ComputeValues": ("critic",),
    "UpdatePolicy": ("actor",),
    "UpdateValue": ("critic",),
    "OpenWeightGroup": ("actor",),
    "JoinWeightGroup": ("actor",),
    "PrepareWeights": ("actor",),
    "SendWeights": ("actor",),
    "SaveCheckpoint": ("actor", "critic"),
    "LoadCheckpoint": ("actor", "critic"),
}

# RPCs that every rank runs; a command's id on the channel is its index here.
COMMANDS: dict[str, type[Message]] = {
    "Initialize": common_pb2.InitializeRequest,
    "ComputeLogProbs": common_pb2.LogProbsRequest,
    "ComputeValues": common_pb2.SequenceBatch,
    "UpdatePolicy": trainer_pb2.PolicyUpdateRequest,
    "UpdateValue": trainer_pb2.ValueUpdateRequest,
    "PrepareWeights": trainer_pb2.PrepareWeightsRequest,
    "SendWeights": trainer_pb2.SendWeightsRequest,
    "SaveCheckpoint": trainer_pb2.CheckpointRequest,
    "LoadCheckpoint": trainer_pb2.CheckpointRequest,
}
COMMAND_IDS = {name: i for i, name in enumerate(COMMANDS)}

# The commands that read or write the optimizer's moments (with optimizer_offload, only
# these bring them back to the GPU).
USES_OPTIMIZER = ("UpdatePolicy", "UpdateValue", "SaveCheckpoint", "LoadCheckpoint")


class RankHandlers:
    """What every rank does with a command: request proto -> typed call -> response proto."""

    def __init__(self, role: str, host: str):
        self.role_name = role
        self.host = host
        self.role: ActorRole | CriticRole | RefRole | None = None
        self.publisher: WeightPublisher | None = None
        self.model_path = ""
        self.vocab_size = 0  # of the loaded model: token ids of a request are checked against it
        self.gives_memory_back = False  # set by Initialize (launcher placement, config)
        self.cfg: RunConfig | None = None  # set by Initialize
        self.gpus: list[str] = []  # every rank's GPU, by UUID (set by Initialize)

    def dispatch(self, method_id: int, payload: bytes):
        """A command from rank 0, on the other ranks."""
        name = list(COMMANDS)[method_id]
        return self.run(name, COMMANDS[name].FromString(payload))

    def run(self, name: str, request: Message):
        """Command ``name`` on this rank, with the role's memory plan around it: offloaded
        state back before, offloaded and the allocator's cache given back after."""
        if isinstance(self.role, TrainedRole):  # offloaded state back for the call
            self.role.memory.load(with_optimizer=name in USES_OPTIMIZER)
        try:
            return getattr(self, name)(request)
        finally:
            if isinstance(self.role, TrainedRole):  # Initialize made it: offloaded at once
                self.role.memory.release()
            if self.gives_memory_back:
                # The caching allocator keeps freed blocks for this process; on a GPU
                # shared with rollout they must go back, or its KV cache cannot return.
                # Blocks still in use by another stream's pending work are kept: wait first.
                torch.cuda.synchronize()
                torch.cuda.empty_cache()

    def info(self) -> common_pb2.ServerInfo:
        role = self.role
        return common_pb2.ServerInfo(
            api_version="meshrl.api.v1",
            service="trainer",
            role=self.role_name,
            model_path=self.model_path,
            weight_version=self.publisher.sent_version if self.publisher is not None else -1,
            update_count=role.update_count if role is not None else 0,
            world_size=dist.get_world_size(),
            num_parameters=role.num_parameters if role is not None else 0,
            ready=role is not None,
            meshrl_version=package_version(),
            gpus=self.gpus,
        )

    def Initialize(self, req: common_pb2.InitializeRequest) -> common_pb2.InitializeResponse:
        cfg = config_from_yaml(req.config_yaml)
        self.cfg = cfg
        settings = role_settings(cfg, self.role_name)
        if self.publisher is not None:
            self.publisher.close()
        self.role, self.publisher = None, None
        world = World.current(settings.device)
        self.gpus = gathered_gpu_names(world.device)
        self.gives_memory_back = hands_gpu_memory_over(cfg)
        configured = settings.world_size
        if configured != world.world_size:
            log.warning(
                "the config asks for %d %s rank(s) but %d are running; using %d",
                configured, self.role_name, world.world_size, world.world_size,
            )  # fmt: skip
        self.role = ROLES[self.role_name].build(cfg, world)
        self.model_path = settings.model_path
        self.vocab_size = _vocab_size(self.role.model)
        if isinstance(self.role, ActorRole):
            rollout = cfg.actor_rollout_ref.rollout
            self.publisher = WeightPublisher(
                self.role,
                self.host,
                bucket_bytes=rollout.weight_sync.bucket_bytes(cfg.trainer.device),
                timeout_s=rollout.weight_sync.timeout_s,
                world_size=1 + rollout.replicas,
            )
        return common_pb2.InitializeResponse(info=self.info())

    def ComputeLogProbs(self, req: common_pb2.LogProbsRequest) -> common_pb2.LogProbsResponse:
        role = self.role
        assert isinstance(role, (ActorRole, RefRole))  # served by (SERVED_BY), initialised
        logprobs, entropy = role.compute_log_probs(
            self._batch(req.batch),
            req.temperature if req.temperature > 0 else None,
            req.with_entropy,
            base_model=req.base_model,
        )
        return common_pb2.LogProbsResponse(
            logprobs=tensor_to_proto(logprobs.values),
            entropy=tensor_to_proto(entropy.values) if entropy is not None else None,
            weight_version=-1,
            update_count=role.update_count,
        )

    def ComputeValues(self, req: common_pb2.SequenceBatch) -> trainer_pb2.ValuesResponse:
        assert isinstance(self.role, CriticRole)  # served by (SERVED_BY), initialised
        values = self.role.compute_values(self._batch(req))
        return trainer_pb2.ValuesResponse(values=tensor_to_proto(values.values))

    def UpdatePolicy(self, req: trainer_pb2.PolicyUpdateRequest) -> trainer_pb2.UpdateResponse:
        assert isinstance(self.role, ActorRole)  # served by (SERVED_BY), initialised
        batch = self._batch(req.batch)
        metrics = self.role.update_policy(
            batch,
            required_per_token(batch, req.old_logprobs, "old_logprobs"),
            required_per_token(batch, req.advantages, "advantages"),
            per_token(batch, req.ref_logprobs, "ref_logprobs"),
            per_token(batch, req.rollout_logprobs, "rollout_logprobs"),
            req.global_step,
        )
        return trainer_pb2.UpdateResponse(metrics=metrics)

    def UpdateValue(self, req: trainer_pb2.ValueUpdateRequest) -> trainer_pb2.UpdateResponse:
        assert isinstance(self.role, CriticRole)  # served by (SERVED_BY), initialised
        batch = self._batch(req.batch)
        metrics = self.role.update_value(
            batch,
            required_per_token(batch, req.old_values, "old_values"),
            required_per_token(batch, req.returns, "returns"),
            req.global_step,
        )
        return trainer_pb2.UpdateResponse(metrics=metrics)

    def _batch(self, msg: common_pb2.SequenceBatch) -> SequenceBatch:
        batch = batch_from_proto(msg)
        batch.check_token_ids(self.vocab_size)
        return batch

    def PrepareWeights(self, req: trainer_pb2.PrepareWeightsRequest) -> common_pb2.WeightManifest:
        assert self.publisher is not None  # the actor's, made by Initialize
        publisher = self.publisher
        manifest = publisher.prepare(req.version, req.dtype, req.bucket_bytes, req.delta, req.full)
        return manifest.to_proto()

    def SendWeights(self, req: trainer_pb2.SendWeightsRequest) -> common_pb2.WeightSyncResult:
        assert self.publisher is not None  # the actor's, made by Initialize
        result = self.publisher.send(req.version)
        return common_pb2.WeightSyncResult(
            version=result.version,
            seconds=result.seconds,
            bytes=result.bytes,
            delta=result.delta,
            changed=result.changed,
            elements=result.elements,
        )

    def SaveCheckpoint(self, req: trainer_pb2.CheckpointRequest) -> trainer_pb2.CheckpointResponse:
        assert isinstance(self.role, TrainedRole)  # served by (SERVED_BY), initialised
        start = time.perf_counter()
        self.role.save(checkpoint_path(req), req.with_optimizer)
        return trainer_pb2.CheckpointResponse(path=req.path, seconds=time.perf_counter() - start)

    def LoadCheckpoint(self, req: trainer_pb2.CheckpointRequest) -> trainer_pb2.CheckpointResponse:
        assert isinstance(self.role, TrainedRole)  # served by (SERVED_BY), initialised
        start = time.perf_counter()
        self.role.load(checkpoint_path(req), req.with_optimizer)
        return trainer_pb2.CheckpointResponse(path=req.path, seconds=time.perf_counter() - start)


def _vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's input embedding (a causal LM, or the critic's wrapped decoder)."""
    return decoder_config(model).vocab_size
