"""The rollout side of ``cuda_ipc.py``: joins the cuda_ipc group and loads every sync into
its own bf16 model, then reports per-parameter sums so the actor can check them."""

from __future__ import annotations

import argparse
import json
from datetime import timedelta

import torch
from transformers import Qwen2ForCausalLM

from benchmarks.gpu_models import qwen05_config
from meshrl.api.v1 import common_pb2
from meshrl.weight_sync.cuda_ipc import IpcGroup
from meshrl.weight_sync.types import GroupSpec, WeightManifest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--syncs", type=int, required=True)
    args = parser.parse_args()
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(qwen05_config()).to(torch.bfloat16)
    targets = dict(model.named_parameters())
    spec = GroupSpec(
        transport="cuda_ipc",
        master_addr="127.0.0.1",
        master_port=args.port,
        world_size=2,
        rank=1,
        timeout_s=120,
        group_id=args.group,
    )
    group = IpcGroup.join(spec)
    store = group._root
    with torch.no_grad():
        for version in range(1, args.syncs + 1):
            store.wait([f"bench/manifest/{version}"], timedelta(seconds=120))
            msg = common_pb2.WeightManifest.FromString(store.get(f"bench/manifest/{version}"))
            for name, tensor in group.receive(WeightManifest.from_proto(msg)):
                targets[name].copy_(tensor)
            sums = [p.double().sum().item() for _, p in model.named_parameters()]
            store.set(f"bench/sums/{version}", json.dumps(sums))


if __name__ == "__main__":
    main()
